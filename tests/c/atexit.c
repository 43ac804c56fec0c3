/*
 * The C ABI called from an atexit handler, run as one process per rank on 2 ranks by
 * tests/capi.rs:
 *
 *   DSPARK_RANK=r DSPARK_WORLD_SIZE=2 DSPARK_ROOT_ADDR=127.0.0.1:PORT ./atexit
 *
 * glibc's exit destroys the calling thread's thread-locals before it runs atexit handlers,
 * and the library's last-error text is one: every entry point once aborted the process there
 * (a panic out of an extern "C" function), and so did a warning printed there by a log that
 * kept its buffer in one. The handler waits for and frees a non-blocking all_reduce issued in
 * main, checks its values, reads the last error, runs a blocking broadcast from rank 1 and
 * checks it, and destroys the communicator; it prints "N passed, M failed" and leaves with
 * _exit(1) on a failure (the process's own status is main's 0 otherwise).
 */
#define _POSIX_C_SOURCE 200809L

#include <dspark.h>

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "check.h"

static dspark_comm_t *g_comm;
static dspark_work_t *g_work;
static float g_buf[7];
static int g_size;

static void cleanup(void)
{
    int i;
    int32_t b[5];
    const char *e;
    CHECK(dspark_work_wait(g_work) == DSPARK_SUCCESS, "wait in the exit handler");
    for (i = 0; i < 7; i++)
        CHECK(g_buf[i] == (float)(i * g_size + g_size * (g_size - 1) / 2),
              "element %d is %g", i, (double)g_buf[i]);
    dspark_work_free(g_work);
    /* Here the thread's locals are gone: the text is not kept, and "" comes back. */
    e = dspark_last_error();
    CHECK(e != NULL, "last_error is NULL");
    /* A blocking call on this thread: with DSPARK_ALGO=pairwise its first broadcast warns
     * from here (tests/capi.rs looks for it), when the thread's locals are gone. */
    for (i = 0; i < 5; i++)
        b[i] = g_rank == 1 ? 100 + i : -1;
    CHECK(dspark_broadcast(g_comm, b, b, 5, DSPARK_I32, 1, NULL) == DSPARK_SUCCESS,
          "broadcast in the exit handler");
    for (i = 0; i < 5; i++)
        CHECK(b[i] == 100 + i, "broadcast element %d is %d", i, b[i]);
    CHECK(dspark_comm_destroy(g_comm) == DSPARK_SUCCESS, "destroy in the exit handler");
    printf("%d passed, %d failed\n", g_pass, g_fail);
    fflush(stdout);
    if (g_fail)
        _exit(1);
}

int main(void)
{
    int i;
    if (dspark_comm_init_from_env(&g_comm) != DSPARK_SUCCESS) {
        printf("init: %s\n", dspark_last_error());
        return 1;
    }
    dspark_comm_rank(g_comm, &g_rank);
    dspark_comm_size(g_comm, &g_size);
    for (i = 0; i < 7; i++)
        g_buf[i] = (float)(i + g_rank);
    CHECK(dspark_all_reduce(g_comm, g_buf, g_buf, 7, DSPARK_F32, DSPARK_SUM, &g_work) ==
              DSPARK_SUCCESS,
          "all_reduce");
    if (atexit(cleanup) != 0) {
        printf("atexit failed\n");
        return 1;
    }
    return 0;
}
