/*
 * What the sanitized C test programs of tests/c share: counted checks that print a line only when they fail
 * (EXPECT also fails a non-zero code that left no message), this process's open fds, but for what the waiters'
 * watcher keeps on purpose for later waits (its eventfd and the pidfds of producers it has watched), and hex.
 */
#ifndef VMMSHARE_TESTS_C_CHECKS_H
#define VMMSHARE_TESTS_C_CHECKS_H

#include <dirent.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "acl/acl.h"

static int failures __attribute__((unused)), checks __attribute__((unused));

#define EXPECT(expr, code)                                                                                     \
    do {                                                                                                       \
        aclError got_ = (expr);                                                                                \
        checks++;                                                                                              \
        if (got_ != (code)) {                                                                                  \
            failures++;                                                                                        \
            printf("FAIL %s:%d %s -> %d, expected %d (%s)\n", __FILE__, __LINE__, #expr, got_, (int)(code),    \
                   aclGetRecentErrMsg());                                                                      \
        } else if ((code) != 0 && strstr(aclGetRecentErrMsg(), ": ") == NULL) {                                \
            failures++;                                                                                        \
            printf("FAIL %s:%d %s left no message\n", __FILE__, __LINE__, #expr);                              \
        }                                                                                                      \
    } while (0)

#define TRUE(cond)                                                                                             \
    do {                                                                                                       \
        checks++;                                                                                              \
        if (!(cond)) {                                                                                         \
            failures++;                                                                                        \
            printf("FAIL %s:%d %s\n", __FILE__, __LINE__, #cond);                                              \
        }                                                                                                      \
    } while (0)

#define MIB2 ((size_t)2 << 20)

static inline int fd_count(void)
{
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    struct dirent *e;
    while (d != NULL && (e = readdir(d)) != NULL) {
        char path[300], target[64] = "";
        snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
        ssize_t k = readlink(path, target, sizeof target - 1);
        if (k > 0)
            target[k] = '\0';
        if (strcmp(target, "anon_inode:[pidfd]") != 0 && strcmp(target, "anon_inode:[eventfd]") != 0)
            n++;
    }
    if (d != NULL)
        closedir(d);
    return n;
}

/* The value of one hex digit (lower case), or -1. */
static inline int hex_digit(char c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

#endif /* VMMSHARE_TESTS_C_CHECKS_H */
