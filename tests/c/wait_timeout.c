/*
 * A bounded wait and the whereabouts of an operation in flight, run as one process per rank
 * on 2 ranks by tests/capi.rs:
 *
 *   DSPARK_RANK=r DSPARK_WORLD_SIZE=2 DSPARK_ROOT_ADDR=127.0.0.1:PORT ./wait_timeout
 *
 * Rank 1 joins the all_reduce 1.5 s late. Rank 0 issues it non-blocking, and while it waits
 * for rank 1: dspark_work_wait_timeout(200 ms) fails with DSPARK_ERR_TIMEOUT, its error names
 * the all_reduce and where it is, and the handle stays in flight; dspark_work_whereabouts
 * sizes and fills the same text; a second bounded wait long enough completes it, with the
 * right sums; then the whereabouts are empty and the wait answers again.
 *
 * With WAIT_TIMEOUT_CASE=own_deadline (and DSPARK_TIMEOUT=1), rank 1 joins 3 s late: the
 * operation fails by its own 1 s deadline inside rank 0's 30 s bounded wait, which returns
 * DSPARK_ERR_TIMEOUT too, but complete: dspark_work_test says *done = 1, the whereabouts are
 * empty, and the wait answers the same again. Rank 1's next call after its late one fails.
 *
 * Prints "N passed, M failed"; exits 1 on a failure.
 */
#define _POSIX_C_SOURCE 200809L

#include <dspark.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"

#define N 13

int main(void)
{
    dspark_comm_t *comm = NULL;
    dspark_work_t *w = NULL;
    float buf[N];
    char text[1024];
    size_t needed = 0;
    int i, size = 0, done = 0;
    dspark_result_t r;
    const char *c = getenv("WAIT_TIMEOUT_CASE");
    int own_deadline = c != NULL && strcmp(c, "own_deadline") == 0;
    if (dspark_comm_init_from_env(&comm) != DSPARK_SUCCESS) {
        printf("init: %s\n", dspark_last_error());
        return 1;
    }
    dspark_comm_rank(comm, &g_rank);
    dspark_comm_size(comm, &size);
    for (i = 0; i < N; i++)
        buf[i] = (float)(i * (g_rank + 1));
    if (own_deadline) {
        if (g_rank == 1) {
            struct timespec late = {3, 0};
            nanosleep(&late, NULL);
            /* It may even succeed: rank 0's contribution was sent before its deadline, and
             * a 2-rank all_reduce needs nothing more from it. The next call cannot. */
            (void)dspark_all_reduce(comm, buf, buf, N, DSPARK_F32, DSPARK_SUM, NULL);
            CHECK(dspark_barrier(comm, NULL) != DSPARK_SUCCESS,
                  "a barrier with rank 0 failed and gone succeeded");
        } else {
            CHECK(dspark_all_reduce(comm, buf, buf, N, DSPARK_F32, DSPARK_SUM, &w) ==
                      DSPARK_SUCCESS,
                  "rank 0's non-blocking all_reduce");
            r = dspark_work_wait_timeout(w, 30000);
            CHECK(r == DSPARK_ERR_TIMEOUT, "a 30 s wait for an operation with a 1 s deadline "
                                           "and a peer 3 s late gave %d", (int)r);
            r = dspark_work_test(w, &done);
            CHECK(r == DSPARK_ERR_TIMEOUT && done == 1,
                  "after the operation's own deadline: test gave %d, done %d", (int)r, done);
            r = dspark_work_whereabouts(w, text, sizeof text, &needed);
            CHECK(r == DSPARK_SUCCESS && needed == 1,
                  "a failed operation's whereabouts: %d, needed %zu", (int)r, needed);
            CHECK(dspark_work_wait_timeout(w, 0) == DSPARK_ERR_TIMEOUT, "the wait asked again");
            dspark_work_free(w);
        }
        dspark_comm_destroy(comm);
        printf("%d passed, %d failed\n", g_pass, g_fail);
        fflush(stdout);
        return g_fail ? 1 : 0;
    }
    if (g_rank == 1) {
        struct timespec late = {1, 500000000};
        nanosleep(&late, NULL);
        CHECK(dspark_all_reduce(comm, buf, buf, N, DSPARK_F32, DSPARK_SUM, NULL) ==
                  DSPARK_SUCCESS,
              "rank 1's all_reduce");
    } else {
        CHECK(dspark_all_reduce(comm, buf, buf, N, DSPARK_F32, DSPARK_SUM, &w) ==
                  DSPARK_SUCCESS,
              "rank 0's non-blocking all_reduce");
        r = dspark_work_wait_timeout(w, 200);
        CHECK(r == DSPARK_ERR_TIMEOUT, "a 200 ms wait for a rank 1.5 s late gave %d", (int)r);
        CHECK(strstr(dspark_last_error(), "all_reduce") != NULL,
              "the timeout does not name the all_reduce");
        CHECK(strstr(dspark_last_error(), "it runs as") != NULL ||
                  strstr(dspark_last_error(), "in flight") != NULL,
              "the timeout does not say where the operation is");
        r = dspark_work_whereabouts(w, NULL, 0, &needed);
        CHECK(r == DSPARK_ERR_INVALID_ARGUMENT && needed > 1,
              "sizing the whereabouts: %d, needed %zu", (int)r, needed);
        CHECK(needed <= sizeof text, "the whereabouts take %zu bytes", needed);
        r = dspark_work_whereabouts(w, text, sizeof text, &needed);
        CHECK(r == DSPARK_SUCCESS && strlen(text) + 1 == needed && strlen(text) > 0,
              "the whereabouts: %d, %zu bytes, [%s]", (int)r, needed, text);
        printf("rank 0: whereabouts [%s]\n", text);
        r = dspark_work_wait_timeout(w, 30000);
        CHECK(r == DSPARK_SUCCESS, "a 30 s wait gave %d", (int)r);
        r = dspark_work_whereabouts(w, text, sizeof text, &needed);
        CHECK(r == DSPARK_SUCCESS && needed == 1 && text[0] == '\0',
              "a complete operation's whereabouts: %d, needed %zu, [%s]", (int)r, needed, text);
        CHECK(dspark_work_wait_timeout(w, 0) == DSPARK_SUCCESS, "the wait asked again");
        CHECK(dspark_work_wait(w) == DSPARK_SUCCESS, "dspark_work_wait after it");
        dspark_work_free(w);
        CHECK(dspark_work_wait_timeout(NULL, 10) == DSPARK_ERR_INVALID_ARGUMENT, "NULL");
        CHECK(dspark_work_whereabouts(NULL, text, sizeof text, &needed) ==
                  DSPARK_ERR_INVALID_ARGUMENT,
              "whereabouts of NULL");
    }
    /* (i + 1) i summed over the two ranks: i + 2 i. */
    for (i = 0; i < N; i++)
        CHECK(buf[i] == (float)(3 * i), "element %d is %g", i, (double)buf[i]);
    CHECK(dspark_comm_destroy(comm) == DSPARK_SUCCESS, "destroy");
    printf("%d passed, %d failed\n", g_pass, g_fail);
    fflush(stdout);
    return g_fail ? 1 : 0;
}
