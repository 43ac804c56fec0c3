/*
 * verbs-probe: the smallest end-to-end check that a program built on the host
 * against the host's libibverbs runs unchanged inside the Soft-RoCE VM.
 *
 * Opens a device, queries port 1 and a GID, registers 1 MiB, connects one RC
 * queue pair to itself (INIT -> RTR -> RTS over RoCE v2) and moves 64 KiB with
 * RDMA WRITE_WITH_IMM into a posted receive, then checks the bytes and the
 * immediate. Every completion wait is bounded (5 s). Exit 0 on success.
 *
 *   cc -O2 -o verbs-probe tests/softroce/verbs-probe.c -libverbs
 *   verbs-probe [DEVICE [GID_INDEX]]          (defaults: rxe0, 1)
 */
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define BUF (1u << 20)
#define LEN (64u << 10)
#define IMM 0x5eedu

static int fail(const char *what) {
    perror(what);
    fprintf(stderr, "verbs-probe: FAILED at %s\n", what);
    return 1;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* bounded busy-poll for one completion */
static int poll_one(struct ibv_cq *cq, struct ibv_wc *wc, const char *what) {
    double end = now() + 5.0;
    for (;;) {
        int n = ibv_poll_cq(cq, 1, wc);
        if (n < 0) return fail("ibv_poll_cq");
        if (n == 1) {
            if (wc->status != IBV_WC_SUCCESS) {
                fprintf(stderr, "verbs-probe: %s completed with %s\n", what,
                        ibv_wc_status_str(wc->status));
                return 1;
            }
            return 0;
        }
        if (now() > end) {
            fprintf(stderr, "verbs-probe: no %s completion within 5 s\n", what);
            return 1;
        }
    }
}

int main(int argc, char **argv) {
    const char *want = argc > 1 ? argv[1] : "rxe0";
    int gid_index = argc > 2 ? atoi(argv[2]) : 1;
    int n = 0;
    struct ibv_device **list = ibv_get_device_list(&n);
    if (!list) return fail("ibv_get_device_list");
    struct ibv_device *dev = NULL;
    for (int i = 0; i < n; i++)
        if (strcmp(ibv_get_device_name(list[i]), want) == 0) dev = list[i];
    if (!dev) {
        fprintf(stderr, "verbs-probe: no device %s among %d\n", want, n);
        return 1;
    }
    struct ibv_context *ctx = ibv_open_device(dev);
    if (!ctx) return fail("ibv_open_device");

    struct ibv_port_attr pa;
    if (ibv_query_port(ctx, 1, &pa)) return fail("ibv_query_port");
    union ibv_gid gid;
    if (ibv_query_gid(ctx, 1, gid_index, &gid)) return fail("ibv_query_gid");
    printf("verbs-probe: %s port 1 %s, active_mtu %d, link_layer %s, gid[%d] ",
           want, ibv_port_state_str(pa.state), 128 << pa.active_mtu,
           pa.link_layer == IBV_LINK_LAYER_ETHERNET ? "Ethernet" : "InfiniBand", gid_index);
    for (int i = 0; i < 16; i += 2) printf("%02x%02x%s", gid.raw[i], gid.raw[i + 1], i < 14 ? ":" : "\n");
    if (pa.state != IBV_PORT_ACTIVE) {
        fprintf(stderr, "verbs-probe: port 1 is not ACTIVE\n");
        return 1;
    }

    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    if (!pd) return fail("ibv_alloc_pd");
    unsigned char *buf = aligned_alloc(4096, BUF);
    if (!buf) return fail("aligned_alloc");
    memset(buf, 0, BUF);
    for (unsigned i = 0; i < LEN; i++) buf[i] = (unsigned char)(i * 7 + 1);
    struct ibv_mr *mr = ibv_reg_mr(pd, buf, BUF,
                                   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                       IBV_ACCESS_REMOTE_READ);
    if (!mr) return fail("ibv_reg_mr");
    struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
    if (!cq) return fail("ibv_create_cq");
    struct ibv_qp_init_attr qia = {
        .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
        .cap = {.max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1},
    };
    struct ibv_qp *qp = ibv_create_qp(pd, &qia);
    if (!qp) return fail("ibv_create_qp");

    /* connect the QP to itself */
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .port_num = 1,
                            .qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ};
    if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
        return fail("ibv_modify_qp(INIT)");
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = pa.active_mtu;
    a.dest_qp_num = qp->qp_num;
    a.rq_psn = 0;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 12;
    a.ah_attr.is_global = 1;
    a.ah_attr.grh.dgid = gid;
    a.ah_attr.grh.sgid_index = gid_index;
    a.ah_attr.grh.hop_limit = 1;
    a.ah_attr.port_num = 1;
    if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                  IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
        return fail("ibv_modify_qp(RTR)");
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTS;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.sq_psn = 0;
    a.max_rd_atomic = 1;
    if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                  IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
        return fail("ibv_modify_qp(RTS)");

    /* WRITE_WITH_IMM buf[0..LEN) -> buf[LEN..2*LEN), consuming a posted receive */
    struct ibv_recv_wr rwr = {.wr_id = 2}, *bad_r;
    if (ibv_post_recv(qp, &rwr, &bad_r)) return fail("ibv_post_recv");
    struct ibv_sge sge = {.addr = (uintptr_t)buf, .length = LEN, .lkey = mr->lkey};
    struct ibv_send_wr swr = {
        .wr_id = 1, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE_WITH_IMM,
        .send_flags = IBV_SEND_SIGNALED, .imm_data = htobe32(IMM),
        .wr.rdma = {.remote_addr = (uintptr_t)(buf + LEN), .rkey = mr->rkey},
    }, *bad_s;
    double t0 = now();
    if (ibv_post_send(qp, &swr, &bad_s)) return fail("ibv_post_send");
    struct ibv_wc wc;
    int got_send = 0, got_recv = 0;
    while (!(got_send && got_recv)) {
        if (poll_one(cq, &wc, got_send ? "receive" : "first")) return 1;
        if (wc.wr_id == 1) got_send = 1;
        if (wc.wr_id == 2) {
            got_recv = 1;
            if (wc.opcode != IBV_WC_RECV_RDMA_WITH_IMM || be32toh(wc.imm_data) != IMM) {
                fprintf(stderr, "verbs-probe: receive completion opcode %d imm 0x%x\n",
                        wc.opcode, be32toh(wc.imm_data));
                return 1;
            }
        }
    }
    double dt = now() - t0;
    if (memcmp(buf, buf + LEN, LEN) != 0) {
        fprintf(stderr, "verbs-probe: written bytes differ\n");
        return 1;
    }
    printf("verbs-probe: RC loopback WRITE_WITH_IMM of %u bytes OK in %.0f us (qpn %u)\n", LEN,
           dt * 1e6, qp->qp_num);

    ibv_destroy_qp(qp);
    ibv_destroy_cq(cq);
    ibv_dereg_mr(mr);
    ibv_dealloc_pd(pd);
    ibv_close_device(ctx);
    ibv_free_device_list(list);
    free(buf);
    printf("verbs-probe: OK\n");
    return 0;
}
