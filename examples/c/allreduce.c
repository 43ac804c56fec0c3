/*
 * allreduce.c: a non-blocking all_reduce with dspark's C API, overlapping some compute.
 *
 * Build the library and this example (from the repository root):
 *
 *     cargo build --release
 *     cc examples/c/allreduce.c -Iinclude -Ltarget/release -ldspark -o allreduce
 *
 * (or link statically: cc examples/c/allreduce.c -Iinclude target/release/libdspark.a
 *  -lpthread -ldl -lm -o allreduce)
 *
 * Run it as 3 ranks on this machine (rank 0 listens on DSPARK_ROOT_ADDR for the others):
 *
 *     for r in 0 1 2; do
 *         DSPARK_RANK=$r DSPARK_WORLD_SIZE=3 DSPARK_ROOT_ADDR=127.0.0.1:29555 \
 *             LD_LIBRARY_PATH=target/release ./allreduce &
 *     done; wait
 *
 * Under torchrun, mpirun or Slurm the launcher's variables (RANK/WORLD_SIZE/MASTER_ADDR/
 * MASTER_PORT, OMPI_COMM_WORLD_*, SLURM_*) work as they are.
 */
#include <dspark.h>

#include <stdio.h>
#include <stdlib.h>

/* Prints the failed call and its error, and exits. */
static void check(dspark_result_t r, const char *what)
{
    if (r != DSPARK_SUCCESS) {
        fprintf(stderr, "%s failed (code %d): %s\n", what, (int)r, dspark_last_error());
        exit(1);
    }
}

int main(void)
{
    enum { N = 1 << 20 };
    dspark_comm_t *comm = NULL;
    dspark_work_t *work = NULL;
    int rank, size, done = 0;
    size_t i;
    double busy = 0;
    float *grad = malloc(N * sizeof(float));
    if (!grad) return 1;

    check(dspark_comm_init_from_env(&comm), "dspark_comm_init_from_env");
    check(dspark_comm_rank(comm, &rank), "dspark_comm_rank");
    check(dspark_comm_size(comm, &size), "dspark_comm_size");

    for (i = 0; i < N; i++) grad[i] = (float)(rank + 1);

    /* Start the sum over ranks, in place, and return at once. `grad` belongs to dspark until
     * the operation completes: do not touch it until wait (or test) says so. */
    check(dspark_all_reduce(comm, grad, grad, N, DSPARK_F32, DSPARK_SUM, &work),
          "dspark_all_reduce");

    /* Compute something else meanwhile, asking now and then whether it is done. */
    for (i = 0; i < 50 * 1000 * 1000 && !done; i++) {
        busy += (double)(i % 7) * 0.5;
        if (i % 1000000 == 0) check(dspark_work_test(work, &done), "dspark_work_test");
    }

    check(dspark_work_wait(work), "dspark_work_wait");
    dspark_work_free(work);

    /* Every element is 1 + 2 + ... + size. */
    {
        float want = (float)size * (float)(size + 1) / 2;
        int ok = grad[0] == want && grad[N - 1] == want;
        printf("rank %d of %d: allreduce %s: grad[0] = %g (want %g), computed %g meanwhile\n", rank,
               size, ok ? "ok" : "WRONG", grad[0], want, busy);
        check(dspark_comm_destroy(comm), "dspark_comm_destroy");
        free(grad);
        return ok ? 0 : 1;
    }
}
