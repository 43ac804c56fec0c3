/* The C tests' checks: count passes and failures, print a failure with the rank, the file and
 * line, the message and the library's last error. Included by each test program (one
 * translation unit each, so the statics are the program's own). */
#ifndef DSPARK_TEST_CHECK_H
#define DSPARK_TEST_CHECK_H

#include <dspark.h>

#include <stdarg.h>
#include <stdio.h>

static int g_pass, g_fail;
static int g_rank = -1;

static void check_at(int ok, const char *file, int line, const char *fmt, ...)
{
    va_list ap;
    if (ok) {
        g_pass++;
        return;
    }
    g_fail++;
    printf("rank %d: FAIL (%s:%d): ", g_rank, file, line);
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    printf(" [%s]\n", dspark_last_error() ? dspark_last_error() : "");
    fflush(stdout);
}

#define check_(ok, line, ...) check_at((ok), __FILE__, (line), __VA_ARGS__)
#define CHECK(cond, ...) check_((cond) ? 1 : 0, __LINE__, __VA_ARGS__)

#endif
