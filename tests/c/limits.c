/* Absurd world sizes through the C ABI (issue 22): dspark_comm_init_from_env returns
 * DSPARK_ERR_CONFIG naming DSPARK_WORLD_SIZE, never aborts the process. Run by tests/capi.rs
 * with DSPARK_RANK / DSPARK_WORLD_SIZE set; prints the code and the message, exits 0 when the
 * code is DSPARK_ERR_CONFIG and the message names the variable. */
#include <dspark.h>
#include <stdio.h>
#include <string.h>

int main(void) {
    dspark_comm_t *comm = NULL;
    dspark_result_t r = dspark_comm_init_from_env(&comm);
    const char *msg = dspark_last_error();
    printf("code %d: %s\n", (int)r, msg ? msg : "(no message)");
    if (comm != NULL) {
        dspark_comm_destroy(comm);
        return 2;
    }
    return r == DSPARK_ERR_CONFIG && msg != NULL && strstr(msg, "DSPARK_WORLD_SIZE") ? 0 : 1;
}
