/*
 * A test of every entry point of the C ABI (include/dspark.h), run as one process per rank:
 *
 *   DSPARK_RANK=r DSPARK_WORLD_SIZE=n DSPARK_ROOT_ADDR=127.0.0.1:PORT ./capi_test
 *
 * tests/capi.rs builds it and runs it on 3 ranks. Every result is checked against values
 * computed here, in C, from the rank-dependent inputs of every rank. Prints each failure and,
 * at the end, "N passed, M failed" alone on a line; exits non-zero on any failure.
 */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS, MAP_NORESERVE */

#include <dspark.h>

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "check.h"

static int g_size;

static const char *code_name(dspark_result_t r)
{
    switch (r) {
    case DSPARK_SUCCESS: return "DSPARK_SUCCESS";
    case DSPARK_ERR_TIMEOUT: return "DSPARK_ERR_TIMEOUT";
    case DSPARK_ERR_PEER_LOST: return "DSPARK_ERR_PEER_LOST";
    case DSPARK_ERR_MISMATCH: return "DSPARK_ERR_MISMATCH";
    case DSPARK_ERR_INVALID_ARGUMENT: return "DSPARK_ERR_INVALID_ARGUMENT";
    case DSPARK_ERR_CONFIG: return "DSPARK_ERR_CONFIG";
    case DSPARK_ERR_IO: return "DSPARK_ERR_IO";
    case DSPARK_ERR_ABORTED: return "DSPARK_ERR_ABORTED";
    case DSPARK_ERR_UNAVAILABLE: return "DSPARK_ERR_UNAVAILABLE";
    case DSPARK_ERR_INTERNAL: return "DSPARK_ERR_INTERNAL";
    }
    return "(unknown code)";
}

/* Checks that a call succeeded; returns whether it did. */
#define OK(call, what) ok_((call), (what), __LINE__)
static int ok_(dspark_result_t r, const char *what, int line)
{
    check_(r == DSPARK_SUCCESS, line, "%s: %s: %s", what, code_name(r), dspark_last_error());
    return r == DSPARK_SUCCESS;
}

/* Checks that a call failed with `want` and left a message that contains `needle`. */
#define FAILS(call, want, needle, what) fails_((call), (want), (needle), (what), __LINE__)
static void fails_(dspark_result_t r, dspark_result_t want, const char *needle, const char *what,
                   int line)
{
    const char *msg = dspark_last_error();
    check_(r == want, line, "%s: got %s, want %s (%s)", what, code_name(r), code_name(want), msg);
    check_(msg != NULL && strlen(msg) > 0 && (needle == NULL || strstr(msg, needle) != NULL), line,
           "%s: dspark_last_error() = \"%s\" should mention \"%s\"", what, msg ? msg : "(NULL)",
           needle ? needle : "");
}

/* ---- element types, through double (every test value is exactly representable) ---- */

static const dspark_dtype_t ALL_DTYPES[] = {DSPARK_F32, DSPARK_F64, DSPARK_F16, DSPARK_BF16,
                                            DSPARK_I8,  DSPARK_U8,  DSPARK_I32, DSPARK_U32,
                                            DSPARK_I64, DSPARK_U64};
#define N_DTYPES (sizeof ALL_DTYPES / sizeof ALL_DTYPES[0])

static const char *dt_name(dspark_dtype_t t)
{
    static const char *names[] = {"f32", "f64", "f16", "bf16", "i8",
                                  "u8",  "i32", "u32", "i64",  "u64"};
    return t < 10 ? names[t] : "?";
}

static size_t esz(dspark_dtype_t t)
{
    switch (t) {
    case DSPARK_I8: case DSPARK_U8: return 1;
    case DSPARK_F16: case DSPARK_BF16: return 2;
    case DSPARK_F32: case DSPARK_I32: case DSPARK_U32: return 4;
    default: return 8;
    }
}

/* IEEE binary16 bits of v (normal or zero; the tests only use small integers and halves). */
static uint16_t f16_bits(double v)
{
    uint16_t sign = 0;
    int e;
    double m;
    if (v == 0) return 0;
    if (v < 0) {
        sign = 0x8000;
        v = -v;
    }
    m = frexp(v, &e); /* v = m * 2^e, m in [0.5, 1) */
    return (uint16_t)(sign | (uint16_t)((e - 1 + 15) << 10) |
                      (uint16_t)lround((m * 2 - 1) * 1024));
}

static double f16_value(uint16_t h)
{
    int ex = (h >> 10) & 31;
    double f = h & 1023;
    double v = ex == 0 ? ldexp(f, -24) : ldexp(1 + f / 1024, ex - 15);
    return (h & 0x8000) ? -v : v;
}

static uint16_t bf16_bits(double v)
{
    float f = (float)v;
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16); /* exact for the test values */
}

static double bf16_value(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void put(dspark_dtype_t t, void *buf, size_t i, double v)
{
    switch (t) {
    case DSPARK_F32: ((float *)buf)[i] = (float)v; break;
    case DSPARK_F64: ((double *)buf)[i] = v; break;
    case DSPARK_F16: ((uint16_t *)buf)[i] = f16_bits(v); break;
    case DSPARK_BF16: ((uint16_t *)buf)[i] = bf16_bits(v); break;
    case DSPARK_I8: ((int8_t *)buf)[i] = (int8_t)v; break;
    case DSPARK_U8: ((uint8_t *)buf)[i] = (uint8_t)v; break;
    case DSPARK_I32: ((int32_t *)buf)[i] = (int32_t)v; break;
    case DSPARK_U32: ((uint32_t *)buf)[i] = (uint32_t)v; break;
    case DSPARK_I64: ((int64_t *)buf)[i] = (int64_t)v; break;
    case DSPARK_U64: ((uint64_t *)buf)[i] = (uint64_t)v; break;
    }
}

static double get(dspark_dtype_t t, const void *buf, size_t i)
{
    switch (t) {
    case DSPARK_F32: return ((const float *)buf)[i];
    case DSPARK_F64: return ((const double *)buf)[i];
    case DSPARK_F16: return f16_value(((const uint16_t *)buf)[i]);
    case DSPARK_BF16: return bf16_value(((const uint16_t *)buf)[i]);
    case DSPARK_I8: return ((const int8_t *)buf)[i];
    case DSPARK_U8: return ((const uint8_t *)buf)[i];
    case DSPARK_I32: return ((const int32_t *)buf)[i];
    case DSPARK_U32: return ((const uint32_t *)buf)[i];
    case DSPARK_I64: return (double)((const int64_t *)buf)[i];
    case DSPARK_U64: return (double)((const uint64_t *)buf)[i];
    }
    return NAN;
}

static void *alloc(dspark_dtype_t t, size_t n)
{
    void *p = calloc(n ? n : 1, esz(t));
    if (!p) {
        printf("rank %d: out of memory\n", g_rank);
        exit(2);
    }
    return p;
}

#define SENTINEL 77.0

static void fill_sentinel(dspark_dtype_t t, void *buf, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) put(t, buf, i, SENTINEL);
}

/* Checks buf[i] == want[i] for every i (within rel_tol for floats when rel_tol > 0). */
static void check_buf(const char *what, dspark_dtype_t t, const void *buf, const double *want,
                      size_t n, double rel_tol, int line)
{
    size_t i;
    for (i = 0; i < n; i++) {
        double got = get(t, buf, i);
        double w = want[i];
        int ok = rel_tol > 0 ? fabs(got - w) <= rel_tol * (fabs(w) + 1) : got == w;
        if (!ok) {
            check_(0, line, "%s (%s, count %zu): element %zu is %.17g, want %.17g", what,
                   dt_name(t), n, i, got, w);
            return;
        }
    }
    check_(1, line, "%s", what);
}
#define CHECK_BUF(what, t, buf, want, n) check_buf((what), (t), (buf), (want), (n), 0, __LINE__)

/* ---- inputs: rank r, element i ---- */

static double in_sum(int r, size_t i) { return (double)(r + 1) + (double)(i % 5); }
static double in_minmax(int r, size_t i) { return (double)((r * 7 + (int)(i % 101) * 3) % 11) - 5; }
static double in_prod(int r, size_t i)
{
    int k = (r + (int)(i % 3)) % 3;
    return k == 0 ? -1 : (k == 1 ? 1 : 2);
}
/* Sums over ranks that are negative and positive, and not multiples of the world size (so
 * that integer AVG's truncation toward zero shows). */
static double in_avg(int r, size_t i) { return (double)((r * 7 + (int)(i % 19) * 5) % 13) - 6; }

static double (*input_of(dspark_op_t op))(int, size_t)
{
    switch (op) {
    case DSPARK_MIN: case DSPARK_MAX: return in_minmax;
    case DSPARK_PROD: return in_prod;
    case DSPARK_AVG: return in_avg;
    default: return in_sum;
    }
}

static const char *op_name(dspark_op_t op)
{
    static const char *names[] = {"sum", "prod", "min", "max", "avg"};
    return op < 5 ? names[op] : "?";
}

/* The reduction over every rank of in(q, i), computed here. */
static double reduced(dspark_op_t op, dspark_dtype_t t, size_t i, size_t base)
{
    double (*in)(int, size_t) = input_of(op);
    double acc = in(0, base + i);
    int q;
    for (q = 1; q < g_size; q++) {
        double v = in(q, base + i);
        switch (op) {
        case DSPARK_SUM: case DSPARK_AVG: acc += v; break;
        case DSPARK_PROD: acc *= v; break;
        case DSPARK_MIN: acc = v < acc ? v : acc; break;
        case DSPARK_MAX: acc = v > acc ? v : acc; break;
        }
    }
    if (op == DSPARK_AVG) {
        if (t == DSPARK_F32 || t == DSPARK_F64 || t == DSPARK_F16 || t == DSPARK_BF16)
            acc = acc / g_size;
        else
            acc = (double)((long long)acc / g_size); /* C truncates toward zero */
    }
    return acc;
}

/* ---- non-blocking completion: wait, or poll with dspark_work_test ---- */

static void sleep_ms(long ms)
{
    struct timespec ts;
    ts.tv_sec = ms / 1000;
    ts.tv_nsec = (ms % 1000) * 1000000L;
    nanosleep(&ts, NULL);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Completes `w` (by wait, or by polling when poll is set), checks it succeeded, frees it. */
static int finish(dspark_work_t *w, int poll, const char *what)
{
    int ok;
    CHECK(w != NULL, "%s: no work handle", what);
    if (!w) return 0;
    if (poll) {
        int done = 0, polls = 0;
        double t0 = now_s();
        dspark_result_t r = DSPARK_SUCCESS;
        while (!done && now_s() - t0 < 90) {
            r = dspark_work_test(w, &done);
            if (r != DSPARK_SUCCESS) break;
            if (!done) {
                polls++;
                sleep_ms(1);
            }
        }
        ok = OK(r, what);
        CHECK(done == 1, "%s: dspark_work_test never reported done (%d polls)", what, polls);
        ok = ok && done == 1;
    } else {
        ok = OK(dspark_work_wait(w), what);
        if (ok) {
            /* Asking again gives the same answer. */
            int done = 0;
            OK(dspark_work_wait(w), "second dspark_work_wait");
            OK(dspark_work_test(w, &done), "dspark_work_test after wait");
            CHECK(done == 1, "dspark_work_test after wait: done = %d", done);
        }
    }
    dspark_work_free(w);
    return ok;
}

/* Variants of a collective: 0 blocking, 1 non-blocking + wait, 2 non-blocking + test. */
static const char *variant_name(int v)
{
    return v == 0 ? "blocking" : (v == 1 ? "non-blocking/wait" : "non-blocking/test");
}

/* Runs the call that returned `r` to completion (with the handle it left in `*wp` when
 * v > 0). `*wp` is only read here, after the call: the call is complete(...)'s argument. */
static int complete(dspark_result_t r, dspark_work_t **wp, int v, const char *what)
{
    dspark_work_t *w = *wp;
    if (!OK(r, what)) {
        if (w) dspark_work_free(w);
        return 0;
    }
    if (v == 0) {
        CHECK(w == NULL, "%s: blocking call set a work handle", what);
        return 1;
    }
    return finish(w, v == 2, what);
}

#define WORK(v) ((v) ? &w : NULL)

static const size_t COUNTS[] = {1, 13, 1001};
#define N_COUNTS (sizeof COUNTS / sizeof COUNTS[0])

/* ---- the tests ---- */

static void test_all_reduce(dspark_comm_t *comm)
{
    static const dspark_op_t ops[] = {DSPARK_PROD, DSPARK_MIN, DSPARK_MAX, DSPARK_AVG};
    static const dspark_dtype_t op_types[] = {DSPARK_F32, DSPARK_I32};
    size_t d, c, k, i;
    int v;
    char what[160];

    /* SUM over every type, every count, each variant; out of place for 0 and 2, in place 1. */
    for (d = 0; d < N_DTYPES; d++)
        for (c = 0; c < N_COUNTS; c++)
            for (v = 0; v < 3; v++) {
                dspark_dtype_t t = ALL_DTYPES[d];
                size_t n = COUNTS[c];
                int in_place = v == 1;
                void *send = alloc(t, n), *recv = alloc(t, n);
                double *want = calloc(n, sizeof(double)), *orig = calloc(n, sizeof(double));
                dspark_work_t *w = NULL;
                for (i = 0; i < n; i++) {
                    put(t, send, i, in_sum(g_rank, i));
                    orig[i] = in_sum(g_rank, i);
                    want[i] = reduced(DSPARK_SUM, t, i, 0);
                }
                fill_sentinel(t, recv, n);
                snprintf(what, sizeof what, "all_reduce sum %s %s %s count %zu", dt_name(t),
                         variant_name(v), in_place ? "in place" : "out of place", n);
                if (complete(dspark_all_reduce(comm, send, in_place ? send : recv, n, t,
                                               DSPARK_SUM, WORK(v)),
                             &w, v, what)) {
                    CHECK_BUF(what, t, in_place ? send : recv, want, n);
                    if (!in_place) CHECK_BUF("all_reduce leaves sendbuf alone", t, send, orig, n);
                }
                free(send);
                free(recv);
                free(want);
                free(orig);
            }

    /* PROD MIN MAX AVG on f32 and i32. */
    for (k = 0; k < sizeof ops / sizeof ops[0]; k++)
        for (d = 0; d < 2; d++)
            for (c = 1; c < N_COUNTS; c++)
                for (v = 0; v < 3; v++) {
                    dspark_op_t op = ops[k];
                    dspark_dtype_t t = op_types[d];
                    size_t n = COUNTS[c];
                    int in_place = v != 0;
                    double (*in)(int, size_t) = input_of(op);
                    void *send = alloc(t, n), *recv = alloc(t, n);
                    double *want = calloc(n, sizeof(double));
                    dspark_work_t *w = NULL;
                    for (i = 0; i < n; i++) {
                        put(t, send, i, in(g_rank, i));
                        want[i] = reduced(op, t, i, 0);
                    }
                    snprintf(what, sizeof what, "all_reduce %s %s %s count %zu", op_name(op),
                             dt_name(t), variant_name(v), n);
                    if (complete(dspark_all_reduce(comm, send, in_place ? send : recv, n, t, op,
                                                   WORK(v)),
                                 &w, v, what))
                        check_buf(what, t, in_place ? send : recv, want, n,
                                  (op == DSPARK_AVG && t == DSPARK_F32) ? 1e-6 : 0, __LINE__);
                    free(send);
                    free(recv);
                    free(want);
                }

    /* count 0 with NULL buffers is a no-op, blocking and not. */
    for (v = 0; v < 2; v++) {
        dspark_work_t *w = NULL;
        complete(dspark_all_reduce(comm, NULL, NULL, 0, DSPARK_F32, DSPARK_SUM, WORK(v)), &w, v,
                 "all_reduce of 0 elements with NULL buffers");
    }
}

static void test_broadcast(dspark_comm_t *comm)
{
    static const dspark_dtype_t types[] = {DSPARK_F64, DSPARK_U8, DSPARK_BF16};
    int roots[2];
    size_t d, c, i;
    int ri, v;
    char what[160];
    roots[0] = g_size - 1;
    roots[1] = 1 % g_size;
    for (ri = 0; ri < 2; ri++)
        for (d = 0; d < 3; d++)
            for (c = 1; c < N_COUNTS; c++)
                for (v = 0; v < 3; v++) {
                    int root = roots[ri];
                    dspark_dtype_t t = types[d];
                    size_t n = COUNTS[c];
                    int in_place = v == 1;
                    void *send = alloc(t, n), *recv = alloc(t, n);
                    double *want = calloc(n, sizeof(double));
                    dspark_work_t *w = NULL;
                    const void *sendbuf;
                    for (i = 0; i < n; i++) {
                        put(t, send, i, in_sum(g_rank, i) + 3);
                        want[i] = in_sum(root, i) + 3;
                    }
                    fill_sentinel(t, recv, n);
                    if (in_place)
                        memcpy(recv, send, n * esz(t));
                    /* Away from the root the send buffer is never read: pass NULL there. */
                    sendbuf = in_place ? recv : (g_rank == root ? send : NULL);
                    snprintf(what, sizeof what, "broadcast from root %d %s %s %s count %zu",
                             root, dt_name(t), variant_name(v),
                             in_place ? "in place" : "out of place", n);
                    if (complete(dspark_broadcast(comm, sendbuf, recv, n, t, root, WORK(v)), &w, v,
                                 what))
                        CHECK_BUF(what, t, recv, want, n);
                    free(send);
                    free(recv);
                    free(want);
                }
}

static void test_reduce(dspark_comm_t *comm)
{
    static const dspark_dtype_t types[] = {DSPARK_I64, DSPARK_F32};
    static const dspark_op_t ops[] = {DSPARK_SUM, DSPARK_MAX};
    int roots[2];
    size_t d, k, c, i;
    int ri, v;
    char what[160];
    roots[0] = 1 % g_size;
    roots[1] = g_size - 1;
    for (ri = 0; ri < 2; ri++)
        for (d = 0; d < 2; d++)
            for (k = 0; k < 2; k++)
                for (c = 1; c < N_COUNTS; c++)
                    for (v = 0; v < 3; v++) {
                        int root = roots[ri];
                        dspark_dtype_t t = types[d];
                        dspark_op_t op = ops[k];
                        size_t n = COUNTS[c];
                        int in_place = v == 1;
                        double (*in)(int, size_t) = input_of(op);
                        void *send = alloc(t, n), *recv = alloc(t, n);
                        double *want = calloc(n, sizeof(double)), *sent = calloc(n, sizeof(double));
                        void *recvbuf;
                        dspark_work_t *w = NULL;
                        for (i = 0; i < n; i++) {
                            put(t, send, i, in(g_rank, i));
                            want[i] = reduced(op, t, i, 0);
                            sent[i] = SENTINEL;
                        }
                        fill_sentinel(t, recv, n);
                        /* Out of place, variant 2 passes NULL recvbuf away from the root. */
                        recvbuf = in_place ? send : ((v == 2 && g_rank != root) ? NULL : recv);
                        snprintf(what, sizeof what, "reduce %s to root %d %s %s %s count %zu",
                                 op_name(op), root, dt_name(t), variant_name(v),
                                 in_place ? "in place" : "out of place", n);
                        if (complete(dspark_reduce(comm, send, recvbuf, n, t, op, root, WORK(v)),
                                     &w, v, what)) {
                            if (g_rank == root)
                                CHECK_BUF(what, t, in_place ? send : recv, want, n);
                            else if (!in_place)
                                CHECK_BUF("reduce leaves a non-root recvbuf alone", t, recv, sent,
                                          n);
                        }
                        free(send);
                        free(recv);
                        free(want);
                        free(sent);
                    }
}

static void test_all_gather(dspark_comm_t *comm)
{
    static const dspark_dtype_t types[] = {DSPARK_I32, DSPARK_F16};
    size_t d, c, i;
    int v, q;
    char what[160];
    for (d = 0; d < 2; d++)
        for (c = 0; c < N_COUNTS; c++)
            for (v = 0; v < 3; v++) {
                dspark_dtype_t t = types[d];
                size_t n = COUNTS[c], total = n * (size_t)g_size;
                int in_place = v == 1;
                void *send = alloc(t, n), *recv = alloc(t, total);
                double *want = calloc(total, sizeof(double));
                char *mine = (char *)recv + (size_t)g_rank * n * esz(t);
                dspark_work_t *w = NULL;
                fill_sentinel(t, recv, total);
                for (i = 0; i < n; i++) {
                    put(t, send, i, in_sum(g_rank, i) * 2 + 1);
                    if (in_place) put(t, mine, i, in_sum(g_rank, i) * 2 + 1);
                }
                for (q = 0; q < g_size; q++)
                    for (i = 0; i < n; i++) want[(size_t)q * n + i] = in_sum(q, i) * 2 + 1;
                snprintf(what, sizeof what, "all_gather %s %s %s sendcount %zu", dt_name(t),
                         variant_name(v), in_place ? "in place" : "out of place", n);
                if (complete(dspark_all_gather(comm, in_place ? (const void *)mine : send, recv,
                                               n, t, WORK(v)),
                             &w, v, what))
                    CHECK_BUF(what, t, recv, want, total);
                free(send);
                free(recv);
                free(want);
            }
}

static void test_reduce_scatter(dspark_comm_t *comm)
{
    static const dspark_dtype_t types[] = {DSPARK_I32, DSPARK_F64};
    static const dspark_op_t ops[] = {DSPARK_SUM, DSPARK_MIN};
    size_t d, k, c, i;
    int v;
    char what[160];
    for (d = 0; d < 2; d++)
        for (k = 0; k < 2; k++)
            for (c = 0; c < N_COUNTS; c++)
                for (v = 0; v < 3; v++) {
                    dspark_dtype_t t = types[d];
                    dspark_op_t op = ops[k];
                    size_t n = COUNTS[c], total = n * (size_t)g_size;
                    int in_place = v == 1;
                    double (*in)(int, size_t) = input_of(op);
                    void *send = alloc(t, total), *recv = alloc(t, n);
                    double *want = calloc(n, sizeof(double));
                    char *mine = (char *)send + (size_t)g_rank * n * esz(t);
                    dspark_work_t *w = NULL;
                    for (i = 0; i < total; i++) put(t, send, i, in(g_rank, i));
                    for (i = 0; i < n; i++) want[i] = reduced(op, t, i, (size_t)g_rank * n);
                    fill_sentinel(t, recv, n);
                    snprintf(what, sizeof what, "reduce_scatter %s %s %s %s recvcount %zu",
                             op_name(op), dt_name(t), variant_name(v),
                             in_place ? "in place" : "out of place", n);
                    if (complete(dspark_reduce_scatter(comm, send, in_place ? (void *)mine : recv,
                                                       n, t, op, WORK(v)),
                                 &w, v, what))
                        CHECK_BUF(what, t, in_place ? (void *)mine : recv, want, n);
                    free(send);
                    free(recv);
                    free(want);
                }
}

/* Element i of the block that rank `from` sends to rank `to`. */
static double a2a_value(int from, int to, size_t i)
{
    return (double)(from * 1000 + to * 100) + (double)(i % 97);
}

static void test_all_to_all(dspark_comm_t *comm)
{
    static const dspark_dtype_t types[] = {DSPARK_U32, DSPARK_F64};
    size_t d, c, i;
    int v, j;
    char what[160];
    for (d = 0; d < 2; d++)
        for (c = 0; c < N_COUNTS; c++)
            for (v = 0; v < 3; v++) {
                dspark_dtype_t t = types[d];
                size_t n = COUNTS[c], total = n * (size_t)g_size;
                int in_place = v == 1;
                void *send = alloc(t, total), *recv = alloc(t, total);
                double *want = calloc(total, sizeof(double));
                dspark_work_t *w = NULL;
                for (j = 0; j < g_size; j++)
                    for (i = 0; i < n; i++) {
                        put(t, send, (size_t)j * n + i, a2a_value(g_rank, j, i));
                        want[(size_t)j * n + i] = a2a_value(j, g_rank, i);
                    }
                fill_sentinel(t, recv, total);
                snprintf(what, sizeof what, "all_to_all %s %s %s count_per_rank %zu", dt_name(t),
                         variant_name(v), in_place ? "in place" : "out of place", n);
                if (complete(dspark_all_to_all(comm, send, in_place ? send : recv, n, t, WORK(v)),
                             &w, v, what))
                    CHECK_BUF(what, t, in_place ? send : recv, want, total);
                free(send);
                free(recv);
                free(want);
            }
}

/* Elements rank `from` sends rank `to` in all_to_all_v's case `c`: 0 to 4 blocks' worth. */
static size_t a2av_count(int from, int to, size_t c)
{
    return (size_t)((from + 2 * to + (int)c) % 5) * (c * 7 + 1);
}

static void test_all_to_all_v(dspark_comm_t *comm)
{
    static const dspark_dtype_t types[] = {DSPARK_U32, DSPARK_F64};
    size_t d, c, i, *sc = calloc((size_t)g_size, sizeof(size_t)),
                    *rc = calloc((size_t)g_size, sizeof(size_t));
    int v, j;
    char what[160];
    for (d = 0; d < 2; d++)
        for (c = 0; c < 3; c++)
            for (v = 0; v < 3; v++) {
                dspark_dtype_t t = types[d];
                size_t ns = 0, nr = 0, at;
                for (j = 0; j < g_size; j++) {
                    sc[j] = a2av_count(g_rank, j, c);
                    rc[j] = a2av_count(j, g_rank, c);
                    ns += sc[j];
                    nr += rc[j];
                }
                void *send = alloc(t, ns + 1), *recv = alloc(t, nr + 1);
                double *want = calloc(nr + 1, sizeof(double));
                dspark_work_t *w = NULL;
                for (j = 0, at = 0; j < g_size; j++)
                    for (i = 0; i < sc[j]; i++) put(t, send, at++, a2a_value(g_rank, j, i));
                for (j = 0, at = 0; j < g_size; j++)
                    for (i = 0; i < rc[j]; i++) want[at++] = a2a_value(j, g_rank, i);
                fill_sentinel(t, recv, nr);
                snprintf(what, sizeof what, "all_to_all_v %s %s case %zu", dt_name(t),
                         variant_name(v), c);
                if (complete(dspark_all_to_all_v(comm, send, sc, recv, rc, t, WORK(v)), &w, v,
                             what))
                    CHECK_BUF(what, t, recv, want, nr);
                free(send);
                free(recv);
                free(want);
            }
    free(sc);
    free(rc);
}

/* A ring: each rank sends to the next and receives from the previous. Operations of a
 * communicator run in issue order, so with dspark_send and dspark_recv even ranks send first
 * and odd ranks receive first; with dspark_send_recv (`exchange`) every rank makes the same
 * call (its send and receive progress together). */
static void ring(dspark_comm_t *comm, int exchange)
{
    static const dspark_dtype_t types[] = {DSPARK_I64, DSPARK_F32};
    int next = (g_rank + 1) % g_size, prev = (g_rank + g_size - 1) % g_size;
    size_t d, c, i;
    int v;
    char what[160];
    if (g_size < 2) return;
    for (d = 0; d < 2; d++)
        for (c = 0; c < N_COUNTS; c++)
            for (v = 0; v < 3; v++) {
                dspark_dtype_t t = types[d];
                size_t n = COUNTS[c];
                void *send = alloc(t, n), *recv = alloc(t, n);
                double *want = calloc(n, sizeof(double));
                dspark_work_t *ws = NULL, *wr = NULL, *w = NULL;
                int ok;
                for (i = 0; i < n; i++) {
                    put(t, send, i, in_sum(g_rank, i) * 10);
                    want[i] = in_sum(prev, i) * 10;
                }
                fill_sentinel(t, recv, n);
                snprintf(what, sizeof what, "%s ring %s %s count %zu",
                         exchange ? "send_recv" : "send/recv", dt_name(t), variant_name(v), n);
                if (exchange) {
                    ok = complete(dspark_send_recv(comm, send, n, next, recv, n, prev, t, WORK(v)),
                                  &w, v, what);
                } else {
                    dspark_result_t rs, rr;
                    if (g_rank % 2 == 0) {
                        rs = dspark_send(comm, send, n, t, next, v ? &ws : NULL);
                        rr = dspark_recv(comm, recv, n, t, prev, v ? &wr : NULL);
                    } else {
                        rr = dspark_recv(comm, recv, n, t, prev, v ? &wr : NULL);
                        rs = dspark_send(comm, send, n, t, next, v ? &ws : NULL);
                    }
                    ok = complete(rs, &ws, v, what) & complete(rr, &wr, v, what);
                }
                if (ok) CHECK_BUF(what, t, recv, want, n);
                free(send);
                free(recv);
                free(want);
            }
}

static void test_barrier(dspark_comm_t *comm)
{
    int v;
    for (v = 0; v < 3; v++) {
        dspark_work_t *w = NULL;
        char what[64];
        snprintf(what, sizeof what, "barrier %s", variant_name(v));
        complete(dspark_barrier(comm, WORK(v)), &w, v, what);
    }
}

static void test_split(dspark_comm_t *comm)
{
    dspark_comm_t *sub = NULL;
    int color = g_rank % 2, q, want_size = 0, want_rank = 0, want_sum = 0, want_top = -1;
    int rank = -1, size = -1;
    int32_t x, top;
    /* Two colours (even and odd ranks), ranked by key = -rank: the highest old rank first. */
    for (q = 0; q < g_size; q++)
        if (q % 2 == color) {
            want_size++;
            want_sum += q;
            if (q > g_rank) want_rank++;
            if (q > want_top) want_top = q;
        }
    if (OK(dspark_comm_split(comm, color, -g_rank, &sub), "split into 2 colours")) {
        CHECK(sub != NULL, "split: a rank with a colour got no communicator");
        if (sub) {
            OK(dspark_comm_rank(sub, &rank), "rank of a split communicator");
            OK(dspark_comm_size(sub, &size), "size of a split communicator");
            CHECK(rank == want_rank && size == want_size,
                  "split colour %d: rank %d of %d, want %d of %d", color, rank, size, want_rank,
                  want_size);
            x = g_rank;
            if (OK(dspark_all_reduce(sub, &x, &x, 1, DSPARK_I32, DSPARK_SUM, NULL),
                   "all_reduce in a split communicator"))
                CHECK(x == want_sum, "split colour %d: sum of old ranks %d, want %d", color,
                      (int)x, want_sum);
            top = g_rank;
            if (OK(dspark_broadcast(sub, &top, &top, 1, DSPARK_I32, 0, NULL),
                   "broadcast in a split communicator"))
                CHECK(top == want_top, "split colour %d: new rank 0 is old rank %d, want %d",
                      color, (int)top, want_top);
            OK(dspark_comm_destroy(sub), "destroying a split communicator");
        }
    }

    /* The last rank opts out (negative colour) and gets NULL; the others carry on. */
    sub = (dspark_comm_t *)&sub; /* not NULL: the call must set it */
    if (OK(dspark_comm_split(comm, g_rank == g_size - 1 ? -1 : 5, g_rank, &sub),
           "split with an opt-out")) {
        if (g_rank == g_size - 1) {
            CHECK(sub == NULL, "split: the rank that opted out got a communicator");
        } else {
            CHECK(sub != NULL, "split: a rank with a colour got no communicator");
            if (sub) {
                OK(dspark_comm_rank(sub, &rank), "rank after opt-out split");
                OK(dspark_comm_size(sub, &size), "size after opt-out split");
                CHECK(rank == g_rank && size == g_size - 1, "opt-out split: rank %d of %d", rank,
                      size);
                x = g_rank + 1;
                if (OK(dspark_all_reduce(sub, &x, &x, 1, DSPARK_I32, DSPARK_SUM, NULL),
                       "all_reduce after opt-out split"))
                    CHECK(x == (g_size - 1) * g_size / 2, "opt-out split: sum %d", (int)x);
                OK(dspark_comm_destroy(sub), "destroying the opt-out split communicator");
            }
        }
    }
}

static void test_errors(dspark_comm_t *comm)
{
    float a[16], b[16 * 8];
    int i, done = 7, peer = (g_rank + 1) % g_size;
    dspark_work_t *w;
    dspark_comm_t *sp = NULL;
    const dspark_dtype_t bad_dtype = (dspark_dtype_t)99;
    const dspark_op_t bad_op = (dspark_op_t)42;
    memset(a, 0, sizeof a);
    memset(b, 0, sizeof b);

    /* An unknown element type, at every entry point that takes one. */
    FAILS(dspark_all_reduce(comm, a, b, 4, bad_dtype, DSPARK_SUM, NULL),
          DSPARK_ERR_INVALID_ARGUMENT, "99", "all_reduce with dtype 99");
    CHECK(strstr(dspark_last_error(), "dtype") != NULL, "bad dtype message names dtype: %s",
          dspark_last_error());
    w = (dspark_work_t *)&w;
    FAILS(dspark_all_reduce(comm, a, b, 4, bad_dtype, DSPARK_SUM, &w),
          DSPARK_ERR_INVALID_ARGUMENT, "dtype", "non-blocking all_reduce with dtype 99");
    CHECK(w == NULL, "a failed non-blocking call leaves *work NULL");
    FAILS(dspark_all_gather(comm, a, b, 4, bad_dtype, NULL), DSPARK_ERR_INVALID_ARGUMENT, "99",
          "all_gather with dtype 99");
    FAILS(dspark_reduce_scatter(comm, b, a, 4, bad_dtype, DSPARK_SUM, NULL),
          DSPARK_ERR_INVALID_ARGUMENT, "99", "reduce_scatter with dtype 99");
    FAILS(dspark_broadcast(comm, a, a, 4, bad_dtype, 0, NULL), DSPARK_ERR_INVALID_ARGUMENT, "99",
          "broadcast with dtype 99");
    FAILS(dspark_reduce(comm, a, b, 4, bad_dtype, DSPARK_SUM, 0, NULL),
          DSPARK_ERR_INVALID_ARGUMENT, "99", "reduce with dtype 99");
    FAILS(dspark_all_to_all(comm, b, b, 1, bad_dtype, NULL), DSPARK_ERR_INVALID_ARGUMENT, "99",
          "all_to_all with dtype 99");
    FAILS(dspark_send(comm, a, 4, bad_dtype, 0, NULL), DSPARK_ERR_INVALID_ARGUMENT, "99",
          "send with dtype 99");
    FAILS(dspark_recv(comm, a, 4, bad_dtype, 0, NULL), DSPARK_ERR_INVALID_ARGUMENT, "99",
          "recv with dtype 99");
    FAILS(dspark_all_reduce(comm, a, b, 4, (dspark_dtype_t)-1, DSPARK_SUM, NULL),
          DSPARK_ERR_INVALID_ARGUMENT, "4294967295", "all_reduce with dtype (uint32_t)-1");

    /* An unknown operator. */
    FAILS(dspark_all_reduce(comm, a, b, 4, DSPARK_F32, bad_op, NULL), DSPARK_ERR_INVALID_ARGUMENT,
          "42", "all_reduce with op 42");
    CHECK(strstr(dspark_last_error(), "op") != NULL, "bad op message names op: %s",
          dspark_last_error());
    FAILS(dspark_reduce_scatter(comm, b, a, 4, DSPARK_F32, bad_op, NULL),
          DSPARK_ERR_INVALID_ARGUMENT, "42", "reduce_scatter with op 42");
    FAILS(dspark_reduce(comm, a, b, 4, DSPARK_F32, bad_op, 0, NULL), DSPARK_ERR_INVALID_ARGUMENT,
          "42", "reduce with op 42");

    /* NULL buffers with elements to move. */
    FAILS(dspark_all_reduce(comm, NULL, b, 13, DSPARK_F32, DSPARK_SUM, NULL),
          DSPARK_ERR_INVALID_ARGUMENT, "NULL", "all_reduce with a NULL sendbuf");
    FAILS(dspark_all_reduce(comm, a, NULL, 13, DSPARK_F32, DSPARK_SUM, NULL),
          DSPARK_ERR_INVALID_ARGUMENT, "NULL", "all_reduce with a NULL recvbuf");
    FAILS(dspark_all_gather(comm, a, NULL, 2, DSPARK_F32, NULL), DSPARK_ERR_INVALID_ARGUMENT,
          "NULL", "all_gather with a NULL recvbuf");
    FAILS(dspark_reduce_scatter(comm, NULL, a, 2, DSPARK_F32, DSPARK_SUM, NULL),
          DSPARK_ERR_INVALID_ARGUMENT, "NULL", "reduce_scatter with a NULL sendbuf");
    FAILS(dspark_all_to_all(comm, NULL, b, 2, DSPARK_F32, NULL), DSPARK_ERR_INVALID_ARGUMENT,
          "NULL", "all_to_all with a NULL sendbuf");
    FAILS(dspark_broadcast(comm, a, NULL, 2, DSPARK_F32, 0, NULL), DSPARK_ERR_INVALID_ARGUMENT,
          "NULL", "broadcast with a NULL recvbuf");
    FAILS(dspark_reduce(comm, NULL, b, 2, DSPARK_F32, DSPARK_SUM, 0, NULL),
          DSPARK_ERR_INVALID_ARGUMENT, "NULL", "reduce with a NULL sendbuf");
    if (g_size > 1) { /* (with one rank, the only peer is this rank itself: refused first) */
        FAILS(dspark_send(comm, NULL, 5, DSPARK_F32, peer, NULL), DSPARK_ERR_INVALID_ARGUMENT,
              "NULL", "send of a NULL buffer");
        FAILS(dspark_recv(comm, NULL, 5, DSPARK_F32, peer, NULL), DSPARK_ERR_INVALID_ARGUMENT,
              "NULL", "recv into a NULL buffer");
    }

    /* Roots and peers out of range. */
    FAILS(dspark_broadcast(comm, a, a, 4, DSPARK_F32, g_size, NULL), DSPARK_ERR_INVALID_ARGUMENT,
          "root", "broadcast from root == size");
    FAILS(dspark_broadcast(comm, a, a, 4, DSPARK_F32, -1, NULL), DSPARK_ERR_INVALID_ARGUMENT,
          "-1", "broadcast from root -1");
    FAILS(dspark_reduce(comm, a, b, 4, DSPARK_F32, DSPARK_SUM, g_size + 5, NULL),
          DSPARK_ERR_INVALID_ARGUMENT, "root", "reduce to root size + 5");
    FAILS(dspark_reduce(comm, a, b, 4, DSPARK_F32, DSPARK_SUM, -3, NULL),
          DSPARK_ERR_INVALID_ARGUMENT, "root", "reduce to root -3");
    FAILS(dspark_send(comm, a, 4, DSPARK_F32, g_size, NULL), DSPARK_ERR_INVALID_ARGUMENT, "peer",
          "send to peer == size");
    FAILS(dspark_send(comm, a, 4, DSPARK_F32, -1, NULL), DSPARK_ERR_INVALID_ARGUMENT, "peer",
          "send to peer -1");
    FAILS(dspark_recv(comm, a, 4, DSPARK_F32, g_size, NULL), DSPARK_ERR_INVALID_ARGUMENT, "peer",
          "recv from peer == size");
    FAILS(dspark_recv(comm, a, 4, DSPARK_F32, -7, NULL), DSPARK_ERR_INVALID_ARGUMENT, "peer",
          "recv from peer -7");
    FAILS(dspark_send_recv(comm, a, 4, g_size, a + 4, 4, 0, DSPARK_F32, NULL),
          DSPARK_ERR_INVALID_ARGUMENT, "peer", "send_recv to a rank >= size");
    FAILS(dspark_send_recv(comm, a, 4, 0, a + 4, 4, -1, DSPARK_F32, NULL),
          DSPARK_ERR_INVALID_ARGUMENT, "source", "send_recv from a negative rank");

    /* A NULL communicator, everywhere. */
    FAILS(dspark_comm_rank(NULL, &i), DSPARK_ERR_INVALID_ARGUMENT, "NULL", "rank of NULL");
    FAILS(dspark_comm_size(NULL, &i), DSPARK_ERR_INVALID_ARGUMENT, "NULL", "size of NULL");
    sp = (dspark_comm_t *)&sp; /* not NULL: a failure must set it */
    FAILS(dspark_comm_split(NULL, 0, 0, &sp), DSPARK_ERR_INVALID_ARGUMENT, "NULL",
          "split of NULL");
    CHECK(sp == NULL, "a failed split left *out as it was");
    sp = (dspark_comm_t *)&sp;
    FAILS(dspark_comm_shrink(NULL, NULL, 0, &sp, DSPARK_SHRINK_DEFAULT),
          DSPARK_ERR_INVALID_ARGUMENT, "NULL", "shrink of NULL");
    CHECK(sp == NULL, "a failed shrink left *out as it was");
    FAILS(dspark_send(comm, a, 4, DSPARK_F32, g_rank, NULL), DSPARK_ERR_INVALID_ARGUMENT,
          "invalid argument to send", "a send to this rank");
    FAILS(dspark_recv(comm, a, 4, DSPARK_F32, g_rank, NULL), DSPARK_ERR_INVALID_ARGUMENT,
          "invalid argument to recv", "a receive from this rank");
    FAILS(dspark_comm_abort(NULL), DSPARK_ERR_INVALID_ARGUMENT, "NULL", "abort of NULL");
    FAILS(dspark_comm_destroy(NULL), DSPARK_ERR_INVALID_ARGUMENT, "NULL", "destroy of NULL");
    FAILS(dspark_all_reduce(NULL, a, b, 4, DSPARK_F32, DSPARK_SUM, NULL),
          DSPARK_ERR_INVALID_ARGUMENT, "NULL", "all_reduce on NULL");
    w = (dspark_work_t *)&w;
    FAILS(dspark_all_reduce(NULL, a, b, 4, DSPARK_F32, DSPARK_SUM, &w),
          DSPARK_ERR_INVALID_ARGUMENT, "NULL", "non-blocking all_reduce on NULL");
    CHECK(w == NULL, "a failed non-blocking call on NULL leaves *work NULL");
    FAILS(dspark_all_gather(NULL, a, b, 4, DSPARK_F32, NULL), DSPARK_ERR_INVALID_ARGUMENT, "NULL",
          "all_gather on NULL");
    FAILS(dspark_reduce_scatter(NULL, b, a, 4, DSPARK_F32, DSPARK_SUM, NULL),
          DSPARK_ERR_INVALID_ARGUMENT, "NULL", "reduce_scatter on NULL");
    FAILS(dspark_broadcast(NULL, a, a, 4, DSPARK_F32, 0, NULL), DSPARK_ERR_INVALID_ARGUMENT,
          "NULL", "broadcast on NULL");
    FAILS(dspark_reduce(NULL, a, b, 4, DSPARK_F32, DSPARK_SUM, 0, NULL),
          DSPARK_ERR_INVALID_ARGUMENT, "NULL", "reduce on NULL");
    FAILS(dspark_all_to_all(NULL, b, b, 1, DSPARK_F32, NULL), DSPARK_ERR_INVALID_ARGUMENT, "NULL",
          "all_to_all on NULL");
    FAILS(dspark_send(NULL, a, 4, DSPARK_F32, 0, NULL), DSPARK_ERR_INVALID_ARGUMENT, "NULL",
          "send on NULL");
    FAILS(dspark_recv(NULL, a, 4, DSPARK_F32, 0, NULL), DSPARK_ERR_INVALID_ARGUMENT, "NULL",
          "recv on NULL");
    FAILS(dspark_barrier(NULL, NULL), DSPARK_ERR_INVALID_ARGUMENT, "NULL", "barrier on NULL");

    /* NULL out-pointers. */
    FAILS(dspark_comm_init_from_env(NULL), DSPARK_ERR_INVALID_ARGUMENT, "NULL",
          "init with a NULL out");
    FAILS(dspark_comm_rank(comm, NULL), DSPARK_ERR_INVALID_ARGUMENT, "NULL", "rank into NULL");
    FAILS(dspark_comm_size(comm, NULL), DSPARK_ERR_INVALID_ARGUMENT, "NULL", "size into NULL");
    FAILS(dspark_comm_split(comm, 0, 0, NULL), DSPARK_ERR_INVALID_ARGUMENT, "NULL",
          "split into NULL");

    /* Work handles. */
    FAILS(dspark_work_wait(NULL), DSPARK_ERR_INVALID_ARGUMENT, "NULL", "wait on NULL");
    FAILS(dspark_work_test(NULL, &done), DSPARK_ERR_INVALID_ARGUMENT, "NULL", "test on NULL");
    dspark_work_free(NULL);
    CHECK(1, "dspark_work_free(NULL)");
    w = NULL;
    if (OK(dspark_barrier(comm, &w), "non-blocking barrier")) {
        FAILS(dspark_work_test(w, NULL), DSPARK_ERR_INVALID_ARGUMENT, "NULL", "test into NULL");
        finish(w, 0, "non-blocking barrier");
    }

    /* Argument errors are local: the communicator is still usable, and a success leaves an
     * empty message. */
    for (i = 0; i < 4; i++) a[i] = (float)(g_rank + i);
    if (OK(dspark_all_reduce(comm, a, a, 4, DSPARK_F32, DSPARK_SUM, NULL),
           "all_reduce after argument errors")) {
        CHECK(dspark_last_error() != NULL && dspark_last_error()[0] == '\0',
              "dspark_last_error() after a success is \"%s\"", dspark_last_error());
        for (i = 0; i < 4; i++)
            CHECK(a[i] == (float)(g_size * (g_size - 1) / 2 + g_size * i),
                  "all_reduce after argument errors: a[%d] = %g", i, a[i]);
    }
}

struct aborter {
    dspark_comm_t *comm;
    dspark_result_t result;
};

static void *abort_later(void *arg)
{
    struct aborter *ab = (struct aborter *)arg;
    sleep_ms(300);
    ab->result = dspark_comm_abort(ab->comm);
    return NULL;
}

/* dspark_comm_abort from another thread ends a blocked receive; the peers hear of it. */
static void test_abort_from_another_thread(dspark_comm_t *comm)
{
    dspark_comm_t *ac = NULL;
    float buf[1000];
    double t0, took;
    dspark_result_t r;
    if (g_size < 2) return;
    if (!OK(dspark_comm_split(comm, 0, g_rank, &ac), "split for the abort test") || !ac) return;
    t0 = now_s();
    if (g_rank == 0) {
        pthread_t th;
        struct aborter ab;
        ab.comm = ac;
        ab.result = DSPARK_ERR_INTERNAL;
        CHECK(pthread_create(&th, NULL, abort_later, &ab) == 0, "pthread_create");
        /* Rank 1 never sends: only the abort ends this. */
        r = dspark_recv(ac, buf, 1000, DSPARK_F32, 1, NULL);
        took = now_s() - t0;
        FAILS(r, DSPARK_ERR_ABORTED, "abort", "recv on a communicator aborted by another thread");
        CHECK(took < 10, "abort took %.1f s to end the receive", took);
        pthread_join(th, NULL);
        CHECK(ab.result == DSPARK_SUCCESS, "dspark_comm_abort from another thread: %s",
              code_name(ab.result));
        FAILS(dspark_barrier(ac, NULL), DSPARK_ERR_ABORTED, "abort", "barrier after abort");
    } else {
        /* Rank 0 never sends either: its abort must end this long before the deadline. */
        r = dspark_recv(ac, buf, 1000, DSPARK_F32, 0, NULL);
        took = now_s() - t0;
        CHECK(r != DSPARK_SUCCESS && r != DSPARK_ERR_TIMEOUT,
              "recv from a rank that aborted: %s (%s)", code_name(r), dspark_last_error());
        CHECK(strstr(dspark_last_error(), "rank 0") != NULL,
              "the error of a peer of the aborted rank names it: %s", dspark_last_error());
        CHECK(took < 20, "the peers of an aborted rank heard of it after %.1f s", took);
    }
    OK(dspark_comm_destroy(ac), "destroying an aborted communicator");
}

/* Each rank aborts its own communicator: every later call fails with DSPARK_ERR_ABORTED. */
static void test_abort(dspark_comm_t *comm)
{
    dspark_comm_t *ab = NULL;
    dspark_work_t *w = NULL;
    float x = 1;
    dspark_result_t r;
    if (!OK(dspark_comm_split(comm, 0, g_rank, &ab), "split for the abort test") || !ab) return;
    OK(dspark_barrier(ab, NULL), "barrier before abort");
    /* Everybody is done with `ab` before anybody aborts it. */
    OK(dspark_barrier(comm, NULL), "barrier before abort");
    OK(dspark_comm_abort(ab), "dspark_comm_abort");
    FAILS(dspark_all_reduce(ab, &x, &x, 1, DSPARK_F32, DSPARK_SUM, NULL), DSPARK_ERR_ABORTED,
          "abort", "all_reduce after abort");
    {
        /* Out of place: refused before the send buffer is copied into the receive buffer. */
        float s4[4] = {1, 2, 3, 4}, r4[4] = {-1, -1, -1, -1};
        FAILS(dspark_all_reduce(ab, s4, r4, 4, DSPARK_F32, DSPARK_SUM, NULL), DSPARK_ERR_ABORTED,
              "abort", "out-of-place all_reduce after abort");
        CHECK(r4[0] == -1 && r4[3] == -1, "an all_reduce refused after abort wrote its output");
    }
    r = dspark_all_reduce(ab, &x, &x, 1, DSPARK_F32, DSPARK_SUM, &w);
    if (r == DSPARK_SUCCESS) {
        CHECK(w != NULL, "non-blocking call after abort returned no handle");
        if (w) {
            FAILS(dspark_work_wait(w), DSPARK_ERR_ABORTED, "abort",
                  "waiting for an all_reduce issued after abort");
            {
                int done = 0;
                FAILS(dspark_work_test(w, &done), DSPARK_ERR_ABORTED, "abort",
                      "testing an all_reduce issued after abort");
                CHECK(done == 1, "a failed operation is done");
            }
            dspark_work_free(w);
            CHECK(strstr(dspark_last_error(), "abort") != NULL,
                  "dspark_work_free cleared the wait's error: [%s]", dspark_last_error());
        }
    } else {
        FAILS(r, DSPARK_ERR_ABORTED, "abort", "non-blocking all_reduce after abort");
    }
    FAILS(dspark_barrier(ab, NULL), DSPARK_ERR_ABORTED, "abort", "barrier after abort");
    OK(dspark_comm_destroy(ab), "destroying an aborted communicator");
}

/* An in-place all_gather reads its part from a copy: where that copy's memory cannot be had
 * (8 TiB here, in a reserved but unbacked mapping), the call fails on every rank with
 * DSPARK_ERR_UNAVAILABLE (the process aborted before). On a split communicator, which the
 * failure leaves unusable. Only where the kernel refuses such an allocation
 * (vm.overcommit_memory 0); skipped, saying why, elsewhere. */
static void test_in_place_copy_unavailable(dspark_comm_t *comm)
{
    const size_t count = (size_t)1 << 41; /* floats: 8 TiB per rank */
    dspark_comm_t *sub = NULL;
    char *big;
    int mode = -1;
    FILE *f = fopen("/proc/sys/vm/overcommit_memory", "r");
    if (f) {
        if (fscanf(f, "%d", &mode) != 1) mode = -1;
        fclose(f);
    }
    if (!OK(dspark_comm_split(comm, 0, g_rank, &sub), "split for the copy test") || !sub) return;
    big = mode == 0 ? mmap(NULL, count * 4 * (size_t)g_size, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
                    : MAP_FAILED;
    /* Every rank skips or runs together: the split communicator agrees first. */
    {
        int32_t can = big != MAP_FAILED;
        OK(dspark_all_reduce(sub, &can, &can, 1, DSPARK_I32, DSPARK_MIN, NULL),
           "agreeing on the copy test");
        if (!can) {
            if (g_rank == 0)
                printf("skipped: the in-place copy's allocation failure (vm.overcommit_memory "
                       "%d, or no %zu TiB mapping)\n", mode, (count * 4 * g_size) >> 40);
        } else {
            FAILS(dspark_all_gather(sub, big + count * 4 * (size_t)g_rank, big, count,
                                    DSPARK_F32, NULL),
                  DSPARK_ERR_UNAVAILABLE, "memory", "an in-place all_gather of 8 TiB per rank");
        }
    }
    if (big != MAP_FAILED) munmap(big, count * 4 * (size_t)g_size);
    dspark_comm_destroy(sub);
}

/* A text copied out as dspark_comm_flight_record and dspark_comm_describe do: sized with
 * len 0 (refused, *needed set to at least `least`), a NULL needed or comm refused, a buffer
 * one byte short refused where the text cannot grow (`slack` 0), then copied with `slack`
 * bytes of room more: the NUL-terminated text (malloc'd; NULL after a failure). */
typedef dspark_result_t (*copy_out_fn)(const dspark_comm_t *, char *, size_t, size_t *);
static char *copied_out(dspark_comm_t *comm, copy_out_fn f, const char *what, size_t least,
                        size_t slack)
{
    size_t need = 0, again = 0;
    char *buf;
    FAILS(f(comm, NULL, 0, &need), DSPARK_ERR_INVALID_ARGUMENT, "bytes", what);
    CHECK(need > least, "%s: size %zu", what, need);
    FAILS(f(comm, NULL, 0, NULL), DSPARK_ERR_INVALID_ARGUMENT, "NULL", what);
    /* Room enough but no buffer: said as such (it read as a success). */
    FAILS(f(comm, NULL, need + 4096, &again), DSPARK_ERR_INVALID_ARGUMENT, "buf is NULL", what);
    FAILS(f(NULL, NULL, 0, &need), DSPARK_ERR_INVALID_ARGUMENT, "NULL", what);
    buf = malloc(need + slack);
    CHECK(buf != NULL, "malloc");
    if (!buf) return NULL;
    if (slack == 0)
        FAILS(f(comm, buf, need - 1, &again), DSPARK_ERR_INVALID_ARGUMENT, "bytes", what);
    if (!OK(f(comm, buf, need + slack, &again), what)) {
        free(buf);
        return NULL;
    }
    CHECK(again <= need + slack && strlen(buf) + 1 == again && (slack > 0 || again == need),
          "%s: length %zu, needed %zu", what, strlen(buf), again);
    return buf;
}

/* The flight record: the last calls are in it (4096 bytes of room for it to grow between
 * the calls). */
static void test_flight_record(dspark_comm_t *comm)
{
    char *buf = copied_out(comm, dspark_comm_flight_record, "flight record", 100, 4096);
    if (!buf) return;
    CHECK(strstr(buf, "\"format\":\"dspark-flight-record\",\"version\":1") != NULL,
          "flight record header: %.120s", buf);
    CHECK(strstr(buf, "\"collective\":\"barrier\"") != NULL &&
              strstr(buf, "\"state\":\"completed\"") != NULL,
          "the barriers just run are in the flight record");
    free(buf);
}

/* The description: its facts are those of this job (every rank on one host: shm unless
 * DSPARK_TRANSPORT says otherwise; no GPU, so device memory is host-staged on every
 * connection, with why; the deadline DSPARK_TIMEOUT=60). */
static void test_describe(dspark_comm_t *comm)
{
    size_t peers = 0;
    char want[128];
    const char *p, *t = getenv("DSPARK_TRANSPORT");
    char *buf = copied_out(comm, dspark_comm_describe, "description", 200, 0);

    if (!buf) return;
    if (!t || !*t || !strcmp(t, "auto")) t = "shm";
    CHECK(strstr(buf, "{\"format\":\"dspark-comm-info\",\"version\":1,") == buf,
          "description header: %.120s", buf);
    snprintf(want, sizeof want, "\"rank\":%d,\"world_size\":%d,\"transport\":\"%s\",",
             g_rank, g_size, t);
    CHECK(strstr(buf, want) != NULL, "description lacks %s: %.300s", want, buf);
    snprintf(want, sizeof want, "\"device_path\":\"%s/staged\",", t);
    CHECK(g_size == 1 || strstr(buf, want) != NULL, "description lacks %s", want);
    CHECK(strstr(buf, "\"timeout\":60.0,") != NULL, "description's timeout");
    for (p = buf; (p = strstr(p, "\"peer\":")) != NULL; p++) peers++;
    CHECK(peers == (size_t)(g_size - 1), "%zu device paths for %d ranks", peers, g_size);
    CHECK(strstr(buf, "\"memory\":\"staged\",\"reason\":\"") != NULL || g_size == 1,
          "a device path with its reason");
    free(buf);
}

int main(void)
{
    dspark_comm_t *comm = NULL;
    const char *env_rank = getenv("DSPARK_RANK"), *env_size = getenv("DSPARK_WORLD_SIZE");
    double t0 = now_s();

    if (!OK(dspark_comm_init_from_env(&comm), "dspark_comm_init_from_env") || !comm) {
        printf("%d passed, %d failed\n", g_pass, g_fail ? g_fail : 1);
        return 1;
    }
    OK(dspark_comm_rank(comm, &g_rank), "dspark_comm_rank");
    OK(dspark_comm_size(comm, &g_size), "dspark_comm_size");
    CHECK(env_rank == NULL || g_rank == atoi(env_rank), "rank %d, DSPARK_RANK=%s", g_rank,
          env_rank ? env_rank : "");
    CHECK(env_size == NULL || g_size == atoi(env_size), "size %d, DSPARK_WORLD_SIZE=%s", g_size,
          env_size ? env_size : "");
    CHECK(dspark_last_error()[0] == '\0', "no error message after successful calls");

    test_all_reduce(comm);
    test_broadcast(comm);
    test_reduce(comm);
    test_all_gather(comm);
    test_reduce_scatter(comm);
    test_all_to_all(comm);
    test_all_to_all_v(comm);
    ring(comm, 0);
    ring(comm, 1);
    test_barrier(comm);
    test_flight_record(comm);
    test_describe(comm);
    test_split(comm);
    test_errors(comm);
    OK(dspark_barrier(comm, NULL), "barrier before the abort tests");
    test_abort_from_another_thread(comm);
    test_abort(comm);
    test_in_place_copy_unavailable(comm);
    OK(dspark_barrier(comm, NULL), "the world communicator after the aborts of others");
    OK(dspark_comm_destroy(comm), "dspark_comm_destroy");

    fprintf(stderr, "rank %d: %.2f s\n", g_rank, now_s() - t0);
    printf("%d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}
