/*
 * vmmshare bench's C row: a 2 MiB DEFAULT share between two C processes through libascendcl.so, measured as users
 * share (each round a fresh export handed to a waiting importer over a pipe, each side's calls timed alone), beside
 * the anchors measured the same way in the same run: POSIX shm_open + mmap of the same size, and the floor of any
 * brokered import, one request and a reply carrying an fd over SOCK_SEQPACKET between the same two processes.
 *
 * Prints one line per measure: its name and the nanoseconds of each round.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "acl/acl.h"

#define SIZE ((size_t)2 << 20)

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void die(const char *what)
{
    fprintf(stderr, "bench_c: %s failed: %s\n", what, aclGetRecentErrMsg());
    exit(1);
}

#define CHECK(call)        \
    do {                   \
        if ((call) != 0)   \
            die(#call);    \
    } while (0)

static void put(int fd, const void *p, size_t n)
{
    if (write(fd, p, n) != (ssize_t)n)
        exit(1);
}

static void get(int fd, void *p, size_t n)
{
    if (read(fd, p, n) != (ssize_t)n)
        exit(1);
}

static void print(const char *name, const long long *t, int n)
{
    printf("%s", name);
    for (int i = 0; i < n; i++)
        printf(" %lld", t[i]);
    printf("\n");
}

/* The importer: rounds of the share, of shm, and of the floor, each timed here, the times sent back. */
static void importer(int in, int out, int sock, int rounds)
{
    long long *t = calloc((size_t)rounds, sizeof *t);
    CHECK(aclrtSetDevice(0));
    for (int r = 0; r < rounds; r++) { /* the share */
        uint64_t shareable;
        get(in, &shareable, sizeof shareable);
        long long start = now_ns();
        aclrtDrvMemHandle h;
        void *p;
        CHECK(aclrtMemImportFromShareableHandleV2(&shareable, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, 0, &h));
        CHECK(aclrtReserveMemAddress(&p, SIZE, 0, NULL, 0));
        CHECK(aclrtMapMem(p, SIZE, 0, h, 0));
        t[r] = now_ns() - start;
        CHECK(aclrtUnmapMem(p));
        CHECK(aclrtReleaseMemAddress(p));
        CHECK(aclrtFreePhysical(h));
        put(out, "k", 1);
    }
    put(out, t, sizeof *t * (size_t)rounds);
    for (int r = 0; r < rounds; r++) { /* shm_open + mmap */
        char name[64];
        get(in, name, sizeof name);
        long long start = now_ns();
        int fd = shm_open(name, O_RDWR, 0600);
        void *p = mmap(NULL, SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        t[r] = now_ns() - start;
        if (fd < 0 || p == MAP_FAILED)
            exit(1);
        munmap(p, SIZE);
        close(fd);
        put(out, "k", 1);
    }
    put(out, t, sizeof *t * (size_t)rounds);
    for (int r = 0; r < rounds; r++) { /* the floor: a request, a reply with an fd */
        char req[12] = "VB", reply[64];
        union {
            char buf[CMSG_SPACE(sizeof(int))];
            struct cmsghdr align;
        } u;
        struct iovec iov = {reply, sizeof reply};
        struct msghdr msg = {0};
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        msg.msg_control = u.buf;
        msg.msg_controllen = sizeof u.buf;
        long long start = now_ns();
        if (send(sock, req, sizeof req, 0) != (ssize_t)sizeof req || recvmsg(sock, &msg, MSG_CMSG_CLOEXEC) <= 0)
            exit(1);
        t[r] = now_ns() - start;
        int fd;
        memcpy(&fd, CMSG_DATA(CMSG_FIRSTHDR(&msg)), sizeof fd);
        close(fd);
    }
    put(out, t, sizeof *t * (size_t)rounds);
    exit(0);
}

int main(int argc, char **argv)
{
    int rounds = argc > 1 ? atoi(argv[1]) : 100, warm = 10;
    int total = rounds + warm;
    int to[2], from[2], pair[2];
    if (pipe(to) || pipe(from) || socketpair(AF_UNIX, SOCK_SEQPACKET, 0, pair))
        return 1;
    CHECK(aclrtSetDevice(0));
    fflush(stdout);
    pid_t child = fork();
    if (child == 0) {
        close(pair[0]);
        importer(to[0], from[1], pair[1], total);
    }
    close(pair[1]);
    int32_t pid = child;
    long long *exporter = calloc((size_t)total, sizeof *exporter), *theirs = calloc((size_t)total, sizeof *theirs);
    long long *create = calloc((size_t)total, sizeof *create);
    aclrtPhysicalMemProp prop;
    memset(&prop, 0, sizeof prop);
    prop.memAttr = ACL_HBM_MEM_HUGE;
    prop.location.type = ACL_MEM_LOCATION_TYPE_DEVICE;
    for (int r = 0; r < total; r++) { /* the share: allocate, map, export, trust the importer */
        long long start = now_ns();
        aclrtDrvMemHandle h;
        void *p;
        uint64_t shareable;
        CHECK(aclrtMallocPhysical(&h, SIZE, &prop, 0));
        CHECK(aclrtReserveMemAddress(&p, SIZE, 0, NULL, 0));
        CHECK(aclrtMapMem(p, SIZE, 0, h, 0));
        CHECK(aclrtMemExportToShareableHandleV2(h, 0, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, &shareable));
        CHECK(aclrtMemSetPidToShareableHandleV2(&shareable, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, &pid, 1));
        exporter[r] = now_ns() - start;
        put(to[1], &shareable, sizeof shareable);
        char k;
        get(from[0], &k, 1);
        CHECK(aclrtUnmapMem(p));
        CHECK(aclrtReleaseMemAddress(p));
        CHECK(aclrtFreePhysical(h));
    }
    get(from[0], theirs, sizeof *theirs * (size_t)total);
    print("c_exporter", exporter + warm, rounds);
    print("c_importer", theirs + warm, rounds);
    for (int r = 0; r < total; r++) { /* shm_open(O_CREAT) + ftruncate + mmap, then attached there */
        char name[64];
        snprintf(name, sizeof name, "/vmmshare-bench-%d-%d", (int)getpid(), r);
        long long start = now_ns();
        int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
        if (fd < 0 || ftruncate(fd, (off_t)SIZE) != 0)
            return 1;
        void *p = mmap(NULL, SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        create[r] = now_ns() - start;
        put(to[1], name, sizeof name);
        char k;
        get(from[0], &k, 1);
        munmap(p, SIZE);
        close(fd);
        shm_unlink(name);
    }
    get(from[0], theirs, sizeof *theirs * (size_t)total);
    print("shm_create", create + warm, rounds);
    print("shm_attach", theirs + warm, rounds);
    int memfd = memfd_create("vmmshare-bench-floor", MFD_CLOEXEC);
    if (memfd < 0 || ftruncate(memfd, (off_t)SIZE) != 0)
        return 1;
    for (int r = 0; r < total; r++) { /* the floor's server: each request answered with the memfd */
        char req[64], reply[25] = "VB";
        if (recv(pair[0], req, sizeof req, 0) <= 0)
            return 1;
        union {
            char buf[CMSG_SPACE(sizeof(int))];
            struct cmsghdr align;
        } u;
        memset(&u, 0, sizeof u);
        struct iovec iov = {reply, sizeof reply};
        struct msghdr msg = {0};
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        msg.msg_control = u.buf;
        msg.msg_controllen = sizeof u.buf;
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &memfd, sizeof memfd);
        if (sendmsg(pair[0], &msg, 0) < 0)
            return 1;
    }
    get(from[0], theirs, sizeof *theirs * (size_t)total);
    print("floor", theirs + warm, rounds);
    int status = 1;
    waitpid(child, &status, 0);
    return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
