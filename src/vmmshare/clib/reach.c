/*
 * Reaching the node's broker (vmmshare.client.autostart's rules). Nothing is sent to a broker before it is known to
 * be one this user may trust: its folder belongs to this user, root or VMMSHARE_BROKER_USER and others cannot write
 * to it, and the process listening runs as one of them (SO_PEERCRED). When none answers, one is started (the Python
 * package's `python -m vmmshare.broker --auto`, which exits once idle) under a lock file next to the socket, so that
 * many processes starting at once get one broker; every wait is bounded.
 */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
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

#ifndef VS_PYTHON
#define VS_PYTHON "python3"
#endif

#define CONNECT_TIMEOUT_S 10.0
#define START_TIMEOUT_S 20.0

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
    double deadline = vs_now() + CONNECT_TIMEOUT_S;
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
        if (vs_now() >= deadline)
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
    double deadline = vs_now() + START_TIMEOUT_S;
    char line[64];
    size_t got = 0;
    aclError code = ACL_SUCCESS;
    for (;;) {
        double left = deadline - vs_now();
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
aclError vs_reach_broker(vs_err *err, int *fd)
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
    double deadline = vs_now() + START_TIMEOUT_S;
    while (flock(lock, LOCK_EX | LOCK_NB) != 0) {
        if (vs_now() > deadline) {
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

