/*
 * The node: this process's connection to the node's broker, the same session the Python client keeps
 * (vmmshare.client.connection), over the same protocol (wire.c).
 *
 * One connection per process, one request at a time (`conn_lock`). Nothing is sent to a broker before it is known
 * to be one this user may trust: its folder belongs to this user, root or VMMSHARE_BROKER_USER and others cannot
 * write to it, and the process listening runs as one of them (SO_PEERCRED). When none answers, one is started (the
 * Python package's `python -m vmmshare.broker --auto`, which exits once idle), under a lock file so that many
 * processes starting at once get one broker. When the broker goes away (a restart, an idle exit), the next request
 * reconnects and charges this process's live allocations again, as the Python client does.
 *
 * Two kinds of id meet here: a token is the runtime's name for an allocation or an import (stable for the
 * process's life); a hold is the broker's id for this connection's claim on it, which a restarted broker gives
 * out anew.
 */
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "vs.h"
#include "wire.h"

#ifndef VS_PYTHON
#define VS_PYTHON "python3"
#endif

#define REPLY_TIMEOUT_MS 60000
#define CONNECT_TIMEOUT_S 10.0
#define START_TIMEOUT_S 20.0
#define RETRIES 4
#define MAX_FDS 5

typedef struct hold {
    uint64_t token;
    uint64_t hold;   /* 0: none on this connection (its broker is gone) */
    bool charge;     /* a charge of this process's memory, charged again on a new broker */
    int32_t device;
    uint64_t size;
} hold;

static pthread_mutex_t conn_lock = PTHREAD_MUTEX_INITIALIZER;
static int conn = -1;
static uint32_t next_req = 1;
static uint64_t next_token = 1;
static vs_vec holds = {NULL, 0, 0, sizeof(hold)};

typedef struct reply {
    uint8_t packet[VS_WIRE_MAX_FRAME + 1];
    size_t n;
    int fds[MAX_FDS];
    int nfds;
    bool truncated;
    unsigned kind;
    vs_fields f;
} reply;

static int spin_skip, spin_misses; /* requests left to wait for without polling; the last miss's count */
static int loadavg_fd = -1;

static reply scratch; /* the reply being read (under conn_lock) */
static reply *scratch_reply = &scratch;
static uint8_t frame_buf[VS_WIRE_MAX_FRAME]; /* the request being sent (under conn_lock) */

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void close_fds(int *fds, int n)
{
    for (int i = 0; i < n; i++)
        close(fds[i]);
}

static hold *hold_of(uint64_t token)
{
    for (size_t i = 0; i < holds.count; i++)
        if (VS_AT(holds, hold, i).token == token)
            return &VS_AT(holds, hold, i);
    return NULL;
}

static void drop_hold(uint64_t token)
{
    for (size_t i = 0; i < holds.count; i++)
        if (VS_AT(holds, hold, i).token == token) {
            vs_vec_remove(&holds, i);
            return;
        }
}

static void reset(void)
{
    if (conn >= 0) {
        close(conn);
        conn = -1;
    }
}

/* ---------------------------------------------------------------- packets */

static int send_packet(int fd, const uint8_t *data, size_t n, const int *fds, int nfds)
{
    struct iovec iov = {(void *)data, n};
    struct msghdr msg = {0};
    union {
        char buf[CMSG_SPACE(sizeof(int) * MAX_FDS)];
        struct cmsghdr align;
    } u;
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (nfds) {
        memset(&u, 0, sizeof u);
        msg.msg_control = u.buf;
        msg.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
        memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)nfds);
    }
    ssize_t sent;
    do
        sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
    while (sent < 0 && errno == EINTR);
    return sent < 0 ? -1 : 0;
}

/* One packet and the fds that came with it (close-on-exec); -1 on error (errno), 0 with n == 0 and no fds when the
 * peer closed the connection. */
static int recv_packet(int fd, reply *r, int flags)
{
    r->nfds = 0;
    r->n = 0;
    for (int i = 0; i < MAX_FDS; i++)
        r->fds[i] = -1;
    struct iovec iov = {r->packet, sizeof r->packet};
    union {
        char buf[CMSG_SPACE(sizeof(int) * MAX_FDS)];
        struct cmsghdr align;
    } u;
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = u.buf;
    msg.msg_controllen = sizeof u.buf;
    ssize_t got;
    do
        got = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC | flags);
    while (got < 0 && errno == EINTR);
    if (got < 0)
        return -1;
    r->n = (size_t)got;
    r->nfds = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c != NULL; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < count; i++) {
            int got_fd;
            memcpy(&got_fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
            if (r->nfds < MAX_FDS)
                r->fds[r->nfds++] = got_fd;
            else
                close(got_fd);
        }
    }
    r->truncated = (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) || r->n > VS_WIRE_MAX_FRAME;
    return 0;
}

/* ---------------------------------------------------------------- waiting for a reply */

/* Whether a core is free to poll on: fewer tasks runnable than cores (the kernel's count in /proc/loadavg). */
static bool core_free(void)
{
    static long cores;
    if (cores == 0)
        cores = sysconf(_SC_NPROCESSORS_ONLN);
    if (cores < 2)
        return false;
    char text[128];
    ssize_t n = loadavg_fd >= 0 ? pread(loadavg_fd, text, sizeof text - 1, 0) : -1;
    if (n <= 0)
        return false;
    text[n] = '\0';
    char *slash = strchr(text, '/'); /* "0.00 0.01 0.05 R/T ...": R runnable, this process among them */
    if (slash == NULL)
        return false;
    char *start = slash;
    while (start > text && start[-1] >= '0' && start[-1] <= '9')
        start--;
    return strtol(start, NULL, 10) <= cores;
}

/* Wait until `fd` has the reply: polled for up to VMMSHARE_SPIN_US while a core is free (a wake-up from sleep
 * costs more than the broker takes to answer), then in poll(2); 1 when readable, 0 at the timeout. After a poll
 * that missed, the next requests wait without polling (1, 3, 7, 15, at most 16 in a row), as the Python client's. */
static int wait_reply(int fd)
{
    long spin = vs_rt.config.spin_us;
    if (spin > 0 && spin_skip > 0) {
        spin_skip--;
    } else if (spin > 0 && core_free()) {
        double deadline = now() + (double)spin / 1e6;
        struct pollfd p = {fd, POLLIN, 0};
        for (;;) {
            if (poll(&p, 1, 0) > 0) {
                spin_misses = 0;
                return 1;
            }
            if (now() >= deadline)
                break;
            sched_yield();
        }
        spin_misses = spin_misses * 2 + 1 > 16 ? 16 : spin_misses * 2 + 1;
        spin_skip = spin_misses;
    }
    struct pollfd p = {fd, POLLIN, 0};
    int ready;
    do
        ready = poll(&p, 1, REPLY_TIMEOUT_MS);
    while (ready < 0 && errno == EINTR);
    return ready > 0;
}

/* ---------------------------------------------------------------- reaching the broker */

static bool trusted(uid_t uid)
{
    return uid == getuid() || uid == 0 || (vs_rt.config.broker_user >= 0 && (long)uid == vs_rt.config.broker_user);
}

static void folder_of(char *out, size_t cap)
{
    snprintf(out, cap, "%s", vs_rt.config.socket);
    char *slash = strrchr(out, '/');
    if (slash == NULL)
        snprintf(out, cap, ".");
    else if (slash == out)
        out[1] = '\0';
    else
        *slash = '\0';
}

/* A connection to a trusted broker at the configured path: 0 and `*fd`; 1 when no broker listens there; an error
 * code otherwise. */
static aclError try_connect(vs_err *err, int *fd)
{
    const char *path = vs_rt.config.socket;
    char folder[128];
    folder_of(folder, sizeof folder);
    struct stat st;
    if (stat(folder, &st) != 0) {
        if (errno == ENOENT)
            return 1;
        return vs_set(err, ACL_ERROR_RT_IPC_ERROR, "cannot reach the broker at %s: %s", path, strerror(errno));
    }
    if (!trusted(st.st_uid))
        return vs_set(err, ACL_ERROR_RT_NO_PERMISSION,
                      "the broker's folder %s belongs to uid %u, not to you, root or VMMSHARE_BROKER_USER: a broker "
                      "there is not to be trusted with your memory (remove the folder, or set VMMSHARE_SOCKET to a "
                      "path of your own)", folder, (unsigned)st.st_uid);
    if ((st.st_mode & 022) && !(st.st_mode & S_ISVTX))
        return vs_set(err, ACL_ERROR_RT_NO_PERMISSION,
                      "others can write to the broker's folder %s (mode %04o) and could replace its socket: make it "
                      "0700, or use a folder of your own", folder, (unsigned)(st.st_mode & 07777));
    struct sockaddr_un addr = {0};
    addr.sun_family = AF_UNIX;
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path);
    double deadline = now() + CONNECT_TIMEOUT_S;
    long pause_us = 500;
    int s;
    for (;;) {
        s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (s < 0)
            return vs_set(err, ACL_ERROR_RT_IPC_ERROR, "cannot make a socket: %s", strerror(errno));
        if (connect(s, (struct sockaddr *)&addr, sizeof addr) == 0)
            break;
        int e = errno;
        close(s);
        if (e == ENOENT || e == ECONNREFUSED)
            return 1;
        if (e != EAGAIN)
            return vs_set(err, ACL_ERROR_RT_IPC_ERROR, "cannot reach the broker at %s: %s", path, strerror(e));
        if (now() >= deadline)
            return vs_set(err, ACL_ERROR_RT_IPC_ERROR,
                          "the broker at %s does not take connections (stopped, or overloaded) within %.0f s", path,
                          CONNECT_TIMEOUT_S);
        struct timespec ts = {0, pause_us * 1000}; /* a full listen queue has no wake-up to wait on */
        nanosleep(&ts, NULL);
        pause_us = pause_us * 2 > 50000 ? 50000 : pause_us * 2;
    }
    int flags = fcntl(s, F_GETFL);
    fcntl(s, F_SETFL, flags & ~O_NONBLOCK);
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
        int e = errno;
        close(s);
        return vs_set(err, ACL_ERROR_RT_IPC_ERROR, "cannot learn who listens at %s: %s", path, strerror(e));
    }
    if (!trusted(cred.uid)) {
        close(s);
        return vs_set(err, ACL_ERROR_RT_NO_PERMISSION,
                      "the process listening at %s (pid %d) runs as uid %u, not as you, root or "
                      "VMMSHARE_BROKER_USER: it is not a broker to trust with your memory; nothing was sent to it",
                      path, (int)cred.pid, (unsigned)cred.uid);
    }
    *fd = s;
    return 0;
}

/* Open (creating, 0600) a file of this user in the broker's folder, not through a link. */
static int open_private(vs_err *err, const char *path, int flags)
{
    int fd = open(path, flags | O_CREAT | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK, 0600); /* (a FIFO would block) */
    if (fd < 0) {
        vs_set(err, ACL_ERROR_RT_NO_PERMISSION, "cannot open %s: %s", path,
               errno == ELOOP ? "it is a symbolic link" : strerror(errno));
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != getuid()) {
        close(fd);
        vs_set(err, ACL_ERROR_RT_NO_PERMISSION,
               "%s is not a regular file of yours: another user may be squatting the broker's folder; remove the "
               "file, or use a folder of your own", path);
        return -1;
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    return fd;
}

/* The interpreter that starts the broker: VMMSHARE_PYTHON; else the one whose installation holds this library
 * (<prefix>/lib/pythonX.Y/site-packages/vmmshare/sdk/lib64/ -> <prefix>/bin/python3); else the one the library was
 * built with; else python3 on PATH. */
static const char *broker_python(char *buf, size_t cap)
{
    const char *env = getenv("VMMSHARE_PYTHON");
    if (env != NULL && *env != '\0')
        return env;
    Dl_info info;
    if (dladdr((void *)broker_python, &info) != 0 && info.dli_fname != NULL && strlen(info.dli_fname) < cap) {
        snprintf(buf, cap, "%s", info.dli_fname);
        for (int up = 0; up < 7; up++) { /* the library, lib64, sdk, vmmshare, site-packages, pythonX.Y, lib */
            char *slash = strrchr(buf, '/');
            if (slash == NULL || slash == buf)
                break;
            *slash = '\0';
            if (up == 4 && strcmp(slash + 1, "site-packages") != 0 && strcmp(slash + 1, "dist-packages") != 0)
                break;
            if (up == 6 && strlen(buf) + sizeof "/bin/python3" <= cap) {
                strcat(buf, "/bin/python3");
                if (access(buf, X_OK) == 0)
                    return buf;
            }
        }
    }
    return access(VS_PYTHON, X_OK) == 0 ? VS_PYTHON : "python3";
}

/* Start the embedded default broker (it exits once idle) and wait until it serves; 0 or an error. */
static aclError spawn_broker(vs_err *err, const char *folder)
{
    char log_path[160], ready[16];
    snprintf(log_path, sizeof log_path, "%s/broker.log", folder);
    int logfd = open_private(err, log_path, O_WRONLY | O_APPEND);
    if (logfd < 0)
        return err->code;
    int pipefd[2];
    if (pipe2(pipefd, O_CLOEXEC) != 0) {
        close(logfd);
        return vs_set(err, ACL_ERROR_RT_IPC_ERROR, "cannot start the broker: %s", strerror(errno));
    }
    char found[PATH_MAX];
    const char *python = broker_python(found, sizeof found);
    snprintf(ready, sizeof ready, "3");
    char *argv[] = {(char *)python, "-m", "vmmshare.broker", "--socket", vs_rt.config.socket, "--auto",
                    "--ready-fd", ready, "--log-file", log_path, NULL};
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pid_t first = fork();
    if (first == 0) {
        /* the child: only async-signal-safe calls until exec; a second fork leaves the broker to init */
        setsid();
        pid_t second = fork();
        if (second != 0)
            _exit(second < 0 ? 1 : 0);
        int lf = fcntl(logfd, F_DUPFD_CLOEXEC, 10), pf = fcntl(pipefd[1], F_DUPFD_CLOEXEC, 10);
        int null = open("/dev/null", O_RDONLY | O_CLOEXEC);
        if (lf < 0 || pf < 0 || null < 0 || dup2(null, 0) < 0 || dup2(lf, 1) < 0 || dup2(lf, 2) < 0 ||
            dup2(pf, 3) < 0)
            _exit(126);
        /* the ready pipe (fd 3) is inherited, nothing else */
        int closed = -1;
#ifdef SYS_close_range
        closed = (int)syscall(SYS_close_range, 4U, ~0U, 0U);
#endif
        if (closed != 0)
            for (int fd = 4; fd < 65536; fd++)
                close(fd);
        struct sigaction dfl; /* the broker starts with every signal's default, whatever this program set */
        memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        for (int sig = 1; sig < NSIG; sig++)
            sigaction(sig, &dfl, NULL);
        sigset_t none;
        sigemptyset(&none);
        pthread_sigmask(SIG_SETMASK, &none, NULL);
        execvp(argv[0], argv);
        _exit(127);
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    close(logfd);
    close(pipefd[1]);
    if (first < 0) {
        close(pipefd[0]);
        return vs_set(err, ACL_ERROR_RT_IPC_ERROR, "cannot start the broker (%s -m vmmshare.broker): %s", python,
                      strerror(errno));
    }
    int status;
    while (waitpid(first, &status, 0) < 0 && errno == EINTR)
        ;
    double deadline = now() + START_TIMEOUT_S;
    char line[64];
    size_t got = 0;
    aclError code = ACL_SUCCESS;
    for (;;) {
        double left = deadline - now();
        struct pollfd p = {pipefd[0], POLLIN, 0};
        int ready = left > 0 ? poll(&p, 1, (int)(left * 1000)) : 0;
        if (ready < 0 && errno == EINTR)
            continue;
        if (ready <= 0) {
            code = vs_set(err, ACL_ERROR_RT_IPC_ERROR, "the broker did not start within %.0f s; see %s",
                          START_TIMEOUT_S, log_path);
            break;
        }
        ssize_t n = read(pipefd[0], line + got, sizeof line - 1 - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            code = vs_set(err, ACL_ERROR_RT_IPC_ERROR,
                          "the broker exited before serving %s (is the vmmshare Python package installed for %s? "
                          "set VMMSHARE_PYTHON to an interpreter that has it); see %s",
                          vs_rt.config.socket, python, log_path);
            break;
        }
        got += (size_t)n;
        if (memchr(line, '\n', got) != NULL || got >= sizeof line - 1)
            break;
    }
    close(pipefd[0]);
    return code;
}

/* A connection to the broker: as it is, or after starting one. */
static aclError reach_broker(vs_err *err, int *fd)
{
    aclError rc = try_connect(err, fd);
    if (rc != 1)
        return rc;
    char folder[128], lock_path[160];
    folder_of(folder, sizeof folder);
    if (mkdir(folder, 0700) != 0 && errno != EEXIST)
        return vs_set(err, ACL_ERROR_RT_IPC_ERROR, "cannot prepare %s for the broker: %s", folder, strerror(errno));
    struct stat st;
    if (lstat(folder, &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != getuid() || (st.st_mode & 022))
        return vs_set(err, ACL_ERROR_RT_NO_PERMISSION,
                      "will not start a broker in %s: it must be a folder of yours that no one else can write to "
                      "(mode 0700 or 0755)", folder);
    snprintf(lock_path, sizeof lock_path, "%s/broker.lock", folder);
    int lock = open_private(err, lock_path, O_RDWR);
    if (lock < 0)
        return err->code;
    double deadline = now() + START_TIMEOUT_S;
    while (flock(lock, LOCK_EX | LOCK_NB) != 0) {
        if (now() > deadline) {
            close(lock);
            return vs_set(err, ACL_ERROR_RT_IPC_ERROR,
                          "%s stayed locked for %.0f s: another process is stuck starting the broker", lock_path,
                          START_TIMEOUT_S);
        }
        struct timespec ts = {0, 5000000};
        nanosleep(&ts, NULL);
    }
    rc = try_connect(err, fd); /* somebody else may have started one while we waited */
    if (rc == 1) {
        rc = spawn_broker(err, folder);
        if (rc == ACL_SUCCESS) {
            rc = try_connect(err, fd);
            if (rc == 1)
                rc = vs_set(err, ACL_ERROR_RT_IPC_ERROR, "the broker started but does not answer at %s",
                            vs_rt.config.socket);
        }
    }
    close(lock); /* (closing it unlocks) */
    return rc;
}

/* ---------------------------------------------------------------- one exchange */

/* The broker's refusal of this connection (an ERROR to request 0), if it left one before closing it. */
static aclError refusal(vs_err *err, int fd)
{
    reply *r = scratch_reply;
    if (recv_packet(fd, r, MSG_DONTWAIT) != 0)
        return 0;
    close_fds(r->fds, r->nfds);
    unsigned kind;
    uint32_t req;
    const char *why;
    char why_buf[160];
    if (vs_wire_decode(r->packet, r->n, r->nfds, &kind, &req, &r->f, &why, why_buf) != 0 || req != 0 ||
        kind != VS_ERROR)
        return 0;
    aclError code = (aclError)r->f.v[0];
    return vs_set(err, code > 0 ? code : ACL_ERROR_RT_IPC_ERROR, "%.*s", (int)r->f.tail_len, (const char *)r->f.tail);
}

enum { ATTEMPT_OK = 0, ATTEMPT_RETRY = -1 };

/* One attempt: send `frame` (with `fds`) and read the reply into `r`, checked to be of type `expect`. Returns
 * ATTEMPT_OK, ATTEMPT_RETRY (the connection failed: reset, try again on a fresh one) or an error code. */
static int attempt(vs_err *err, int fd, const uint8_t *frame, size_t n, const int *fds, int nfds, uint32_t req,
                   unsigned expect, reply *r)
{
    if (send_packet(fd, frame, n, fds, nfds) != 0) {
        int e = errno;
        aclError refused = refusal(err, fd);
        if (refused) {
            reset();
            return refused;
        }
        vs_set(err, ACL_ERROR_RT_IPC_ERROR, "lost the broker at %s: %s", vs_rt.config.socket, strerror(e));
        return ATTEMPT_RETRY;
    }
    if (!wait_reply(fd)) {
        reset();
        return vs_set(err, ACL_ERROR_RT_IPC_ERROR, "no reply from the broker at %s within %d s", vs_rt.config.socket,
                      REPLY_TIMEOUT_MS / 1000);
    }
    if (recv_packet(fd, r, MSG_DONTWAIT) != 0 || (r->n == 0 && r->nfds == 0)) {
        int e = r->n == 0 ? ECONNRESET : errno;
        vs_set(err, ACL_ERROR_RT_IPC_ERROR, "lost the broker at %s: %s", vs_rt.config.socket, strerror(e));
        return ATTEMPT_RETRY;
    }
    const char *why = NULL;
    char why_buf[160];
    uint32_t got_req;
    if (r->truncated)
        why = "reply too large";
    else if (vs_wire_decode(r->packet, r->n, r->nfds, &r->kind, &got_req, &r->f, &why, why_buf) == 0) {
        if (got_req == 0 && r->kind == VS_ERROR) { /* the broker will not serve this connection */
            close_fds(r->fds, r->nfds);
            r->nfds = 0;
            reset();
            aclError code = (aclError)r->f.v[0];
            return vs_set(err, code > 0 ? code : ACL_ERROR_RT_IPC_ERROR, "%.*s", (int)r->f.tail_len,
                          (const char *)r->f.tail);
        }
        if (got_req != req) {
            snprintf(why_buf, sizeof why_buf, "reply to request %u, expected %u", got_req, req);
            why = why_buf;
        } else if (r->kind == VS_ERROR) {
            close_fds(r->fds, r->nfds);
            r->nfds = 0;
            aclError code = (aclError)r->f.v[0];
            if (code <= 0)
                code = ACL_ERROR_RT_INTERNAL_ERROR;
            return vs_set(err, code, "%.*s", (int)r->f.tail_len, (const char *)r->f.tail);
        } else if (r->kind != expect) {
            snprintf(why_buf, sizeof why_buf, "%s in reply to %s", vs_wire_layout(r->kind)->name,
                     vs_wire_layout(expect == VS_EXPORTED ? VS_EXPORT : expect)->name);
            why = why_buf;
        } else {
            return ATTEMPT_OK;
        }
    }
    close_fds(r->fds, r->nfds);
    r->nfds = 0;
    reset();
    return vs_set(err, ACL_ERROR_RT_IPC_ERROR, "bad reply from the broker: %s", why);
}

static aclError connect_fresh(vs_err *err);

/* A request and its reply (of type `expect`), reconnecting when the broker went away. `hold_slot` names the field
 * (if any, else -1) that carries the hold of `token`, read on each attempt: a new broker knows it by another. The
 * caller holds conn_lock. */
static aclError request(vs_err *err, unsigned kind, vs_fields *f, int hold_slot, uint64_t token, const int *fds,
                        int nfds, unsigned expect, reply *r)
{
    uint8_t *frame = frame_buf;
    for (int tries = 0; tries < RETRIES; tries++) {
        if (conn < 0) {
            aclError rc = connect_fresh(err);
            if (rc)
                return rc;
        }
        if (hold_slot >= 0) {
            hold *h = hold_of(token);
            f->v[hold_slot] = h != NULL ? h->hold : 0;
        }
        uint32_t req = next_req++;
        if (req == 0) /* 0 addresses the broker's refusal of a connection */
            req = next_req++;
        const char *why;
        size_t n = vs_wire_encode(kind, req, f, frame, &why);
        if (n == 0)
            return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "%s: %s", vs_wire_layout(kind)->name, why);
        int rc = attempt(err, conn, frame, n, fds, nfds, req, expect, r);
        if (rc != ATTEMPT_RETRY)
            return rc;
        reset();
    }
    return err->code;
}

/* Connect (again); after a broker restart, charge every live allocation of ours anew. */
static aclError connect_fresh(vs_err *err)
{
    reset();
    for (size_t i = 0; i < holds.count; i++)
        VS_AT(holds, hold, i).hold = 0; /* hold ids of a broker that is gone */
    int fd;
    aclError rc = reach_broker(err, &fd);
    if (rc)
        return rc;
    conn = fd;
    reply *r = scratch_reply;
    for (size_t i = 0; i < holds.count; i++) {
        hold *h = &VS_AT(holds, hold, i);
        if (!h->charge)
            continue;
        vs_fields f = {0};
        f.v[0] = (uint64_t)(int64_t)h->device;
        f.v[1] = h->size;
        uint8_t frame[64];
        const char *why;
        uint32_t req = next_req++;
        if (req == 0) /* 0 addresses the broker's refusal of a connection */
            req = next_req++;
        size_t n = vs_wire_encode(VS_CHARGE, req, &f, frame, &why);
        vs_err ignored;
        int got = attempt(&ignored, conn, frame, n, NULL, 0, req, VS_TOKEN, r);
        if (got == ATTEMPT_RETRY || conn < 0)
            return vs_set(err, ACL_ERROR_RT_IPC_ERROR, "lost the broker at %s while charging again",
                          vs_rt.config.socket);
        if (got == ATTEMPT_OK)
            h->hold = r->f.v[0]; /* else (less capacity now, say): keep serving, uncharged */
    }
    return ACL_SUCCESS;
}

/* Take the connection for one request (and the reply buffer of this thread). */
static reply *begin(void)
{
    pthread_mutex_lock(&conn_lock);
    return scratch_reply;
}

static void end(void)
{
    pthread_mutex_unlock(&conn_lock);
}

static uint64_t new_token(uint64_t hold_id, bool charge, int32_t device, uint64_t size)
{
    hold *h = vs_vec_push(&holds, sizeof(hold));
    h->token = next_token++;
    h->hold = hold_id;
    h->charge = charge;
    h->device = device;
    h->size = size;
    return h->token;
}

/* ---------------------------------------------------------------- the node's calls */

#define BEGIN_OR_FAIL(r)                                                                   \
    reply *r = begin();                                                                    \
    if (r == NULL) {                                                                       \
        end();                                                                             \
        return vs_set(err, ACL_ERROR_RT_MEMORY_ALLOCATION, "out of memory for a reply");   \
    }

aclError vs_node_charge(vs_err *err, int device, uint64_t size, uint64_t *token)
{
    BEGIN_OR_FAIL(r);
    vs_fields f = {0};
    f.v[0] = (uint64_t)(int64_t)device;
    f.v[1] = size;
    aclError rc = request(err, VS_CHARGE, &f, -1, 0, NULL, 0, VS_TOKEN, r);
    if (rc == ACL_SUCCESS)
        *token = new_token(r->f.v[0], true, device, size);
    end();
    return rc;
}

void vs_node_release(uint64_t token)
{
    reply *r = begin();
    hold *h = hold_of(token);
    if (h != NULL && r != NULL && h->hold != 0) {
        vs_fields f = {0};
        vs_err ignored;
        request(&ignored, VS_RELEASE, &f, 0, token, NULL, 0, VS_OK, r);
    }
    drop_hold(token);
    end();
}

aclError vs_node_mem_info(vs_err *err, int device, uint64_t *free_bytes, uint64_t *total)
{
    BEGIN_OR_FAIL(r);
    vs_fields f = {0};
    f.v[0] = (uint32_t)device;
    aclError rc = request(err, VS_MEM_INFO, &f, -1, 0, NULL, 0, VS_MEM, r);
    if (rc == ACL_SUCCESS) {
        *free_bytes = r->f.v[0];
        *total = r->f.v[1];
    }
    end();
    return rc;
}

aclError vs_node_export(vs_err *err, uint64_t token, int fd, const vs_prop *prop, uint64_t size, uint32_t flags,
                        uint32_t share_type, uint8_t *out, size_t *outlen)
{
    BEGIN_OR_FAIL(r);
    vs_fields f = {0};
    f.v[1] = size;
    f.v[2] = flags;
    f.v[3] = share_type;
    f.v[4] = vs_rt.config.server_id;
    f.v[5] = 0; /* host memfd */
    f.v[6] = prop->handle_type;
    f.v[7] = prop->allocation_type;
    f.v[8] = prop->mem_attr;
    f.v[9] = prop->loc_type;
    f.v[10] = (uint64_t)prop->loc_id;
    aclError rc = request(err, VS_EXPORT, &f, 0, token, &fd, 1, VS_EXPORTED, r);
    if (rc == ACL_SUCCESS) {
        size_t n = r->f.tail_len;
        if (n != 8 && n != VS_FABRIC_SIZE) {
            reset();
            rc = vs_set(err, ACL_ERROR_RT_IPC_ERROR, "bad reply from the broker: a handle of %zu bytes", n);
        } else {
            memcpy(out, r->f.tail, n);
            *outlen = n;
        }
    }
    end();
    return rc;
}

aclError vs_node_revoke(vs_err *err, uint64_t token)
{
    BEGIN_OR_FAIL(r);
    aclError rc = ACL_SUCCESS;
    if (hold_of(token) != NULL) {
        vs_fields f = {0};
        rc = request(err, VS_REVOKE, &f, 0, token, NULL, 0, VS_OK, r);
    }
    end();
    return rc;
}

/* The trustlist's pids as a u32 tail, little-endian (at most 4096: the call's own check comes first). */
static const uint8_t *pids_tail(const uint32_t *pids, size_t n)
{
    static _Thread_local uint8_t tail[VS_WIRE_MAX_PIDS * 4];
    for (size_t i = 0; i < n; i++)
        for (int b = 0; b < 4; b++)
            tail[4 * i + (size_t)b] = (uint8_t)(pids[i] >> (8 * b));
    return tail;
}

aclError vs_node_set_pids(vs_err *err, uint64_t shareable, uint32_t share_type, const uint32_t *pids, size_t n)
{
    if (n > VS_WIRE_MAX_PIDS)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "%zu pids: at most %d per call", n, VS_WIRE_MAX_PIDS);
    const uint8_t *tail = pids_tail(pids, n);
    BEGIN_OR_FAIL(r);
    vs_fields f = {0};
    f.v[0] = shareable;
    f.v[1] = share_type;
    f.tail = tail;
    f.tail_len = 4 * n;
    aclError rc = request(err, VS_SET_PIDS, &f, -1, 0, NULL, 0, VS_OK, r);
    end();
    return rc;
}

aclError vs_node_import(vs_err *err, uint64_t shareable, uint32_t share_type, const uint8_t *secret, int *fd,
                        uint64_t *token, uint64_t *size, vs_prop *prop, bool *gpu)
{
    static const uint8_t none[VS_SECRET_SIZE];
    BEGIN_OR_FAIL(r);
    vs_fields f = {0};
    f.v[0] = shareable;
    f.v[1] = share_type;
    f.bytes[0] = secret != NULL ? secret : none;
    aclError rc = request(err, VS_IMPORT, &f, -1, 0, NULL, 0, VS_IMPORTED, r);
    if (rc == ACL_SUCCESS && (r->kind != VS_IMPORTED || r->nfds != 1 || r->fds[0] < 0)) {
        close_fds(r->fds, r->nfds);
        reset();
        end();
        return vs_set(err, ACL_ERROR_RT_IPC_ERROR, "bad reply from the broker: not an import's memory");
    }
    struct stat st;
    if (rc == ACL_SUCCESS && r->f.v[2] == 0 &&
        (fstat(r->fds[0], &st) != 0 || !S_ISREG(st.st_mode) || (uint64_t)st.st_size != r->f.v[1])) {
        /* host memory comes as a memfd of its size: anything else is not the memory asked for */
        close(r->fds[0]);
        uint64_t wrong = new_token(r->f.v[0], false, 0, 0);
        rc = vs_set(err, ACL_ERROR_RT_IPC_ERROR,
                    "bad reply from the broker: the memory it sent is not a shared-memory file of %llu bytes",
                    (unsigned long long)r->f.v[1]);
        end();
        vs_node_release(wrong); /* the hold it took goes again */
        return rc;
    }
    if (rc == ACL_SUCCESS) {
        *fd = r->fds[0];
        *size = r->f.v[1];
        *gpu = r->f.v[2] != 0;
        memset(prop, 0, sizeof *prop);
        prop->handle_type = (uint32_t)r->f.v[3];
        prop->allocation_type = (uint32_t)r->f.v[4];
        prop->mem_attr = (uint32_t)r->f.v[5];
        prop->loc_type = (uint32_t)r->f.v[6];
        prop->loc_id = (int64_t)r->f.v[7];
        *token = new_token(r->f.v[0], false, 0, 0);
    }
    end();
    return rc;
}

aclError vs_node_bare_tgid(vs_err *err, uint32_t *pid)
{
    BEGIN_OR_FAIL(r);
    vs_fields f = {0};
    aclError rc = request(err, VS_BARE_TGID, &f, -1, 0, NULL, 0, VS_PID, r);
    if (rc == ACL_SUCCESS)
        *pid = (uint32_t)r->f.v[0];
    end();
    return rc;
}

/* Open what a request's wait reads (the run queue's count), once, when the runtime starts: a process's first
 * request then opens nothing of its own but the connection. */
void vs_node_prepare(void)
{
    if (vs_rt.config.spin_us > 0 && loadavg_fd < 0)
        loadavg_fd = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
}

/* In a forked child: the parent's connection and holds are not ours. */
void vs_node_after_fork(void)
{
    pthread_mutex_init(&conn_lock, NULL);
    if (conn >= 0) {
        close(conn);
        conn = -1;
    }
    holds.count = 0;
    spin_skip = spin_misses = 0;
}

aclError vs_node_set_remote_pids(vs_err *err, uint64_t shareable, uint32_t share_type, uint32_t server,
                                 const uint32_t *pids, size_t n)
{
    if (n > VS_WIRE_MAX_PIDS)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "%zu pids: at most %d per call", n, VS_WIRE_MAX_PIDS);
    const uint8_t *tail = pids_tail(pids, n);
    BEGIN_OR_FAIL(r);
    vs_fields f = {0};
    f.v[0] = shareable;
    f.v[1] = share_type;
    f.v[2] = server;
    f.tail = tail;
    f.tail_len = 4 * n;
    aclError rc = request(err, VS_SET_REMOTE_PIDS, &f, -1, 0, NULL, 0, VS_OK, r);
    end();
    return rc;
}
