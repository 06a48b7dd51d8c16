/*
 * Attacks on the C library's copies across servers (tests/test_attacks_c_fabric.py): a lying broker answers the
 * remote import with a fake transfer engine's port, and each mode prints what the library did.
 *
 *   fabric_attack HEX MODE
 *
 *   overlap    a local 2 MiB mapping right before the remote one (rule 7: one range); an overlapping copy from the
 *              local start to 4096 bytes above it, running into the remote range   -> "overlap <rc> <byte>"
 *              (byte: the first byte of the remote range after the copy; memmove semantics give 0xff)
 *   asynclock  an aclrtMemcpyAsync from the remote range on an idle stream, while another thread times a local
 *              aclrtMemcpy (which needs the runtime's lock)          -> "asynclock <rc> <ms the other thread waited>"
 *   synclock   the same with aclrtMemcpy (the control)               -> "synclock <rc> <ms>"
 *   batchlock  the same with aclrtMemcpyBatch (one pair, remote -> host) -> "batchlock <rc> <ms>"
 *   trickle    a 64-byte read from the remote range                  -> "trickle <rc> <ms>"
 *   rw         a read, a write and a read of 64 KiB, and the fds open before and after -> "rw <rc> <rc> <rc> <fds> <fds>"
 *   freeinflight  a read from the remote range on another thread (the engine answers after 1 s) while this one unmaps
 *              and frees the import                        -> "freeinflight <rc> <fds before> <fds after>"
 *   bigoverlap the handle's memory (over 16 MiB) mapped alone; an overlapping remote -> remote copy 4096 bytes up,
 *              through the bounce buffer                   -> "bigoverlap <rc>" (the test checks the engine's bytes)
 *   forkinflight  a read from the remote range on another thread (the engine answers after 1 s) while this one forks:
 *              the child counts its TCP connections        -> "forkinflight <the parent's> <the child's>"
 *   kinds      aclrtMemcpy remote -> host with DEVICE_TO_HOST and with HOST_TO_HOST -> "kinds <rc d2h> <rc h2h>"
 */
#include <dirent.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "acl/acl.h"
#include "checks.h"

#define M2 ((size_t)2 << 20)

static const aclrtPhysicalMemProp PROP = {ACL_MEM_HANDLE_TYPE_NONE, ACL_MEM_ALLOCATION_TYPE_PINNED, ACL_HBM_MEM_HUGE,
                                          {0, ACL_MEM_LOCATION_TYPE_DEVICE}, 0};

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

/* Open fds that are TCP connections (to the engine: the only ones this program makes). */
static int tcp_fds(void)
{
    int n = 0;
    for (int fd = 0; fd < 1024; fd++) {
        struct sockaddr_storage sa;
        socklen_t len = sizeof sa;
        if (getpeername(fd, (struct sockaddr *)&sa, &len) == 0 && sa.ss_family == AF_INET)
            n++;
    }
    return n;
}

static uint8_t *local_buf;
static double waited;

static void *other_thread(void *arg)
{
    (void)arg;
    usleep(300 * 1000);
    uint8_t a[64], *b = local_buf;
    double t0 = now_ms();
    aclrtMemcpy(b, 64, a, 64, ACL_MEMCPY_HOST_TO_HOST); /* takes the runtime's lock */
    waited = now_ms() - t0;
    return NULL;
}

static uint8_t *remote_at;
static aclError read_rc;

static void *reader(void *arg)
{
    (void)arg;
    read_rc = aclrtMemcpy(local_buf, M2, remote_at, 4096, ACL_MEMCPY_DEVICE_TO_HOST);
    return NULL;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IONBF, 0);
    if (argc != 3 || strlen(argv[1]) != 256)
        return 2;
    aclrtMemFabricHandle raw;
    for (size_t i = 0; i < sizeof raw; i++)
        ((uint8_t *)&raw)[i] = (uint8_t)(hex_digit(argv[1][2 * i]) << 4 | hex_digit(argv[1][2 * i + 1]));
    const char *mode = argv[2];
    if (aclInit(NULL) != ACL_SUCCESS || aclrtSetDevice(0) != ACL_SUCCESS)
        return 3;
    aclrtDrvMemHandle rh, lh;
    aclError rc = aclrtMemImportFromShareableHandleV2(&raw, ACL_MEM_SHARE_HANDLE_TYPE_FABRIC, 0, &rh);
    if (rc) {
        printf("import %d\n", rc);
        return 4;
    }
    void *base;
    if (strcmp(mode, "bigoverlap") == 0) {
        uint64_t size;
        memcpy(&size, (uint8_t *)&raw + 24, 8);
        if ((rc = aclrtReserveMemAddress(&base, size, 0, NULL, 0)) || (rc = aclrtMapMem(base, size, 0, rh, 0))) {
            printf("setup %d\n", rc);
            return 5;
        }
        rc = aclrtMemcpy((uint8_t *)base + 4096, size - 4096, base, size - 4096, ACL_MEMCPY_DEVICE_TO_DEVICE);
        printf("bigoverlap %d\n", rc);
        aclrtUnmapMem(base);
        aclrtReleaseMemAddress(base);
        aclrtFreePhysical(rh);
        aclFinalize();
        return 0;
    }
    if ((rc = aclrtReserveMemAddress(&base, 2 * M2, 0, NULL, 0)) || (rc = aclrtMallocPhysical(&lh, M2, &PROP, 0)) ||
        (rc = aclrtMapMem(base, M2, 0, lh, 0)) || (rc = aclrtMapMem((uint8_t *)base + M2, M2, 0, rh, 0)) ||
        (rc = aclrtMallocHost((void **)&local_buf, M2))) {
        printf("setup %d\n", rc);
        return 5;
    }
    uint8_t *l = base, *r = (uint8_t *)base + M2;
    if (strcmp(mode, "overlap") == 0) {
        for (size_t i = 0; i < M2; i++)
            l[i] = (uint8_t)(i / 4096); /* page k holds k & 0xff: the last page 0xff */
        rc = aclrtMemcpy(l + 4096, 2 * M2 - 4096, l, M2, ACL_MEMCPY_DEVICE_TO_DEVICE);
        uint8_t first = 0;
        aclError rc2 = aclrtMemcpy(local_buf, M2, r, 1, ACL_MEMCPY_DEVICE_TO_HOST);
        first = local_buf[0];
        printf("overlap %d %d %#x\n", rc, rc2, first);
    } else if (strcmp(mode, "asynclock") == 0 || strcmp(mode, "synclock") == 0 || strcmp(mode, "batchlock") == 0) {
        aclrtStream s;
        if ((rc = aclrtCreateStream(&s)))
            return 6;
        pthread_t t;
        pthread_create(&t, NULL, other_thread, NULL);
        double t0 = now_ms();
        if (mode[0] == 'b') {
            void *dsts[1] = {local_buf + 4096}, *srcs[1] = {r};
            size_t maxs[1] = {4096}, sizes[1] = {4096}, idx[1] = {0}, fail = 0;
            aclrtMemcpyBatchAttr attr;
            memset(&attr, 0, sizeof attr);
            attr.dstLoc.type = ACL_MEM_LOCATION_TYPE_HOST;
            attr.srcLoc.type = ACL_MEM_LOCATION_TYPE_DEVICE;
            rc = aclrtMemcpyBatch(dsts, maxs, srcs, sizes, 1, &attr, idx, 1, &fail);
        } else if (mode[0] == 'a') {
            rc = aclrtMemcpyAsync(local_buf + 4096, 4096, r, 4096, ACL_MEMCPY_DEVICE_TO_HOST, s);
            aclError sync = aclrtSynchronizeStream(s);
            rc = rc ? rc : sync;
        } else {
            rc = aclrtMemcpy(local_buf + 4096, 4096, r, 4096, ACL_MEMCPY_DEVICE_TO_HOST);
        }
        double took = now_ms() - t0;
        pthread_join(t, NULL);
        aclrtDestroyStream(s);
        printf("%s %d %.0f %.0f\n", mode, rc, waited, took);
    } else if (strcmp(mode, "trickle") == 0) {
        double t0 = now_ms();
        rc = aclrtMemcpy(local_buf, M2, r, 64, ACL_MEMCPY_DEVICE_TO_HOST);
        printf("trickle %d %.0f\n", rc, now_ms() - t0);
    } else if (strcmp(mode, "rw") == 0) {
        int before = fd_count();
        aclError a = aclrtMemcpy(local_buf, M2, r, 65536, ACL_MEMCPY_DEVICE_TO_HOST);
        aclError b = aclrtMemcpy(r, M2, local_buf, 65536, ACL_MEMCPY_HOST_TO_DEVICE);
        aclError c = aclrtMemcpy(local_buf, M2, r + 4096, 65536, ACL_MEMCPY_DEVICE_TO_HOST);
        printf("rw %d %d %d %d %d\n", a, b, c, before, fd_count());
    } else if (strcmp(mode, "freeinflight") == 0) {
        int before = fd_count();
        remote_at = r;
        pthread_t t;
        pthread_create(&t, NULL, reader, NULL);
        usleep(300 * 1000);
        aclError u = aclrtUnmapMem(r), f = aclrtFreePhysical(rh);
        pthread_join(t, NULL);
        printf("freeinflight %d %d %d %d %d\n", u, f, read_rc, before, fd_count());
        aclrtUnmapMem(l);
        aclrtReleaseMemAddress(base);
        aclrtFreePhysical(lh);
        aclrtFreeHost(local_buf);
        aclFinalize();
        return 0;
    } else if (strcmp(mode, "forkinflight") == 0) {
        remote_at = r;
        pthread_t t;
        pthread_create(&t, NULL, reader, NULL);
        usleep(300 * 1000);
        int parent = tcp_fds();
        pid_t child = fork();
        if (child == 0) {
            printf("forkinflight %d %d\n", parent, tcp_fds());
            _exit(0);
        }
        waitpid(child, NULL, 0);
        pthread_join(t, NULL);
    } else if (strcmp(mode, "kinds") == 0) {
        aclError d2h = aclrtMemcpy(local_buf, M2, r, 64, ACL_MEMCPY_DEVICE_TO_HOST);
        aclError h2h = aclrtMemcpy(local_buf, M2, r, 64, ACL_MEMCPY_HOST_TO_HOST);
        printf("kinds %d %d\n", d2h, h2h);
    } else {
        return 7;
    }
    aclrtUnmapMem(r);
    aclrtUnmapMem(l);
    aclrtReleaseMemAddress(base);
    aclrtFreePhysical(lh);
    aclrtFreePhysical(rh);
    aclrtFreeHost(local_buf);
    aclFinalize();
    return 0;
}
