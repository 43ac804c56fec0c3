/*
 * dspark_comm_shrink through the C ABI, run as one process per rank on 3 ranks by
 * tests/capi.rs:
 *
 *   DSPARK_RANK=r DSPARK_WORLD_SIZE=3 DSPARK_ROOT_ADDR=127.0.0.1:PORT ./shrink
 *
 * Rank 2 kills itself (SIGKILL) after the first all_reduce; ranks 0 and 1 see the failure,
 * shrink without it (DSPARK_SHRINK_DEFAULT) and check the new communicator's all_reduce
 * against values computed here; then they shrink that one again with DSPARK_SHRINK_ABORT
 * (which aborts it first: its later calls fail with DSPARK_ERR_ABORTED) and check the result.
 * The argument errors are checked first, with and without DSPARK_SHRINK_ABORT (local: the
 * communicator stays usable). Prints each
 * failure and "N passed, M failed" alone on a line; exits non-zero on any failure.
 */
#define _POSIX_C_SOURCE 200809L

#include <dspark.h>

#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "check.h"


/* all_reduce (sum) of 7 doubles, (old rank + 1) * 10 + i on every rank of `olds`. */
static void check_sum(dspark_comm_t *comm, int old, const int *olds, int n, const char *what)
{
    double buf[7], want;
    int i, k, size = -1, rank = -1;
    CHECK(dspark_comm_size(comm, &size) == DSPARK_SUCCESS && size == n, "%s: size %d, want %d",
          what, size, n);
    CHECK(dspark_comm_rank(comm, &rank) == DSPARK_SUCCESS && rank >= 0 && rank < n &&
              olds[rank] == old,
          "%s: rank %d is not old rank %d's place", what, rank, old);
    for (i = 0; i < 7; i++)
        buf[i] = (old + 1) * 10.0 + i;
    CHECK(dspark_all_reduce(comm, buf, buf, 7, DSPARK_F64, DSPARK_SUM, NULL) == DSPARK_SUCCESS,
          "%s: all_reduce", what);
    for (i = 0; i < 7; i++) {
        want = 0;
        for (k = 0; k < n; k++)
            want += (olds[k] + 1) * 10.0 + i;
        CHECK(buf[i] == want, "%s: element %d is %g, want %g", what, i, buf[i], want);
    }
}

int main(void)
{
    dspark_comm_t *comm = NULL, *shrunk = NULL, *again = NULL;
    dspark_result_t r;
    int one = 1, two = 2, self, bad = 7, neg = -1, i;
    const int survivors[2] = {0, 1};
    float f[1024];

    if (dspark_comm_init_from_env(&comm) != DSPARK_SUCCESS) {
        printf("init: %s\n", dspark_last_error());
        return 1;
    }
    dspark_comm_rank(comm, &g_rank);
    self = g_rank;
    check_sum(comm, g_rank, (const int[]){0, 1, 2}, 3, "the whole communicator");

    /* Argument errors are local: every rank makes them, the communicator stays usable. */
    CHECK(dspark_comm_shrink(comm, &two, 1, NULL, DSPARK_SHRINK_DEFAULT) ==
              DSPARK_ERR_INVALID_ARGUMENT, "NULL out");
    CHECK(dspark_comm_shrink(comm, NULL, 1, &shrunk, DSPARK_SHRINK_DEFAULT) ==
              DSPARK_ERR_INVALID_ARGUMENT && shrunk == NULL, "NULL exclude with count 1");
    CHECK(dspark_comm_shrink(comm, &two, 1, &shrunk, 4) == DSPARK_ERR_INVALID_ARGUMENT,
          "unknown flags");
    CHECK(dspark_comm_shrink(comm, &bad, 1, &shrunk, DSPARK_SHRINK_DEFAULT) ==
              DSPARK_ERR_INVALID_ARGUMENT, "rank 7 of 3");
    CHECK(dspark_comm_shrink(comm, &neg, 1, &shrunk, DSPARK_SHRINK_DEFAULT) ==
              DSPARK_ERR_INVALID_ARGUMENT, "rank -1");
    r = dspark_comm_shrink(comm, &self, 1, &shrunk, DSPARK_SHRINK_DEFAULT);
    CHECK(r == DSPARK_ERR_INVALID_ARGUMENT && strstr(dspark_last_error(), "excluded"),
          "excluding itself: %d", (int)r);
    /* With DSPARK_SHRINK_ABORT too: refused before the abort (it aborted first before). */
    CHECK(dspark_comm_shrink(comm, &bad, 1, &shrunk, DSPARK_SHRINK_ABORT) ==
              DSPARK_ERR_INVALID_ARGUMENT, "rank 7 of 3, aborting");
    r = dspark_comm_shrink(comm, &self, 1, &shrunk, DSPARK_SHRINK_ABORT);
    CHECK(r == DSPARK_ERR_INVALID_ARGUMENT && shrunk == NULL, "excluding itself, aborting: %d",
          (int)r);
    check_sum(comm, g_rank, (const int[]){0, 1, 2}, 3, "after the argument errors");

    if (g_rank == 2) {
        fflush(stdout);
        raise(SIGKILL);
        return 1;
    }
    /* The parent fails: a lost peer, or the other survivor's abort. */
    for (i = 0; i < 1024; i++)
        f[i] = 1.0f;
    for (i = 0; i < 100000; i++) {
        r = dspark_all_reduce(comm, f, f, 1024, DSPARK_F32, DSPARK_SUM, NULL);
        if (r != DSPARK_SUCCESS)
            break;
    }
    CHECK(r == DSPARK_ERR_PEER_LOST || r == DSPARK_ERR_ABORTED,
          "the parent failed with %d, want PEER_LOST or ABORTED", (int)r);

    r = dspark_comm_shrink(comm, &two, 1, &shrunk, DSPARK_SHRINK_DEFAULT);
    CHECK(r == DSPARK_SUCCESS && shrunk != NULL, "shrink without rank 2: %d", (int)r);
    if (shrunk != NULL) {
        check_sum(shrunk, g_rank, survivors, 2, "the shrunk communicator");
        /* DSPARK_SHRINK_ABORT on a healthy communicator: aborted, then shrunk (nobody out). */
        r = dspark_comm_shrink(shrunk, NULL, 0, &again, DSPARK_SHRINK_ABORT);
        CHECK(r == DSPARK_SUCCESS && again != NULL, "shrink with DSPARK_SHRINK_ABORT: %d",
              (int)r);
        CHECK(dspark_all_reduce(shrunk, &one, &one, 1, DSPARK_I32, DSPARK_SUM, NULL) ==
                  DSPARK_ERR_ABORTED, "the aborted communicator still runs");
        if (again != NULL) {
            check_sum(again, g_rank, survivors, 2, "the communicator shrunk after an abort");
            dspark_comm_destroy(again);
        }
        dspark_comm_destroy(shrunk);
    }
    dspark_comm_destroy(comm);
    printf("%d passed, %d failed\n", g_pass, g_fail);
    return g_fail == 0 ? 0 : 1;
}
