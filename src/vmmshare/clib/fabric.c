/*
 * Copies to and from memory of another server (SPEC §8), on the transfer engine's own TCP transport.
 *
 * The exporting node's broker serves each remote import through its transfer engine, at a registration of its own
 * (docs/fabric.md). An importing Python process's engine reaches it over the engine's TCP data protocol; so does
 * the C library, speaking that protocol itself (the engine ships no C interface, and the library starts no
 * interpreter): a C and a Python importer's copies of one handle take the same path to the same engine, one-sided,
 * and the exporting process does nothing per transfer (docs/architecture.md, "One data plane").
 *
 * A request on a connection to the engine's data port: a 24-byte header (size and address, u64 little-endian; an
 * opcode byte, read 0 or write 1, with the acknowledged-framing flag 0x80; 7 bytes of padding). A read is answered
 * by an 8-byte status and the bytes; a write's bytes follow its header, and its status comes once they are in the
 * memory. A status is "MCTV" in its high 32 bits and 0 (done) or 1 (the address is outside what the engine serves,
 * and it closes the connection). A connection carries one request at a time; idle ones are kept for the next copy.
 * Every step waits at most VMMSHARE_FABRIC_TIMEOUT for progress, and a request at most one such timeout per MiB it
 * moves and one more; any failure closes the connection and fails the copy with 507022 naming the engine. The range is checked against the import first: an address outside what the
 * engine serves costs the connection.
 */
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "vs.h"
#include "wire.h"

#define HEADER 24
#define OP_READ 0
#define OP_WRITE 1
#define OP_ACKED 0x80
#define STATUS_MAGIC 0x4D435456u /* "MCTV" */
#define STATUS_REJECTED 1
#define CHUNK ((size_t)64 << 20) /* bytes per request: a long copy is many, each within the engine's deadlines */
#define IDLE 8                   /* connections kept open between copies, over all engines */

typedef struct idle_conn {
    int fd;
    int family;
    uint8_t addr[16];
    uint16_t port;
} idle_conn;

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static idle_conn pool[IDLE];
static int pooled;
/* Connections a copy has in flight (as many as there is room for): a forked child closes its copies of them, as of
 * the idle ones. Taken off before they are closed, so that the child never closes an fd the number was reused for. */
#define BUSY 64
static int busy[BUSY];
static int nbusy;

static void track_locked(int fd)
{
    if (nbusy < BUSY)
        busy[nbusy++] = fd;
}

static void untrack_locked(int fd)
{
    for (int i = 0; i < nbusy; i++)
        if (busy[i] == fd) {
            busy[i] = busy[--nbusy];
            return;
        }
}

static void track(int fd)
{
    pthread_mutex_lock(&pool_lock);
    track_locked(fd);
    pthread_mutex_unlock(&pool_lock);
}

/* Close a connection of a copy in flight. */
static void drop(int fd)
{
    pthread_mutex_lock(&pool_lock);
    untrack_locked(fd);
    pthread_mutex_unlock(&pool_lock);
    close(fd);
}

static bool same_engine(const idle_conn *c, const vs_remote *r)
{
    return c->family == r->family && c->port == r->port && memcmp(c->addr, r->addr, 16) == 0;
}

/* An idle connection to the engine serving `r`, or -1. */
static int take(const vs_remote *r)
{
    int fd = -1;
    pthread_mutex_lock(&pool_lock);
    for (int i = pooled - 1; i >= 0; i--)
        if (same_engine(&pool[i], r)) {
            fd = pool[i].fd;
            pool[i] = pool[--pooled];
            track_locked(fd);
            break;
        }
    pthread_mutex_unlock(&pool_lock);
    return fd;
}

/* Keep a connection that finished its request cleanly for the next copy (closed when the pool is full). */
static void give_back(const vs_remote *r, int fd)
{
    pthread_mutex_lock(&pool_lock);
    untrack_locked(fd);
    if (pooled < IDLE) {
        idle_conn *c = &pool[pooled++];
        c->fd = fd;
        c->family = r->family;
        memcpy(c->addr, r->addr, 16);
        c->port = r->port;
        fd = -1;
    }
    pthread_mutex_unlock(&pool_lock);
    if (fd >= 0)
        close(fd);
}

/* The last import of the memory an engine serves here was freed: its idle connections go (a copy still running
 * on one closes it when done, as the engine refuses the memory by then). */
void vs_fabric_forget(const vs_remote *r)
{
    int fds[IDLE], n = 0;
    pthread_mutex_lock(&pool_lock);
    for (int i = pooled - 1; i >= 0; i--)
        if (same_engine(&pool[i], r)) {
            fds[n++] = pool[i].fd;
            pool[i] = pool[--pooled];
        }
    pthread_mutex_unlock(&pool_lock);
    while (n > 0)
        close(fds[--n]);
}

/* In a forked child: the parent's connections are the parent's (closing our copies leaves them open there). */
void vs_fabric_after_fork(void)
{
    pthread_mutex_init(&pool_lock, NULL);
    for (int i = 0; i < pooled; i++)
        close(pool[i].fd);
    pooled = 0;
    for (int i = 0; i < nbusy; i++) /* the parent's copies in flight: their threads are not here */
        close(busy[i]);
    nbusy = 0;
}

/* When the request this thread runs must be done by (vs_now()): each step waits at most the fabric timeout for
 * progress, and a request as a whole at most one fabric timeout per MiB it moves, and one more, so that an engine
 * that trickles its bytes cannot hold a copy much longer than a slow link would. */
static _Thread_local double deadline;

static void set_deadline(size_t n)
{
    deadline = vs_now() + vs_rt.config.fabric_timeout * (1.0 + (double)n / (double)(1 << 20));
}

/* How long the next step may wait: the fabric timeout, or what is left of the request's time. */
static int timeout_ms(void)
{
    double left = deadline - vs_now(), step = vs_rt.config.fabric_timeout;
    if (left < step)
        step = left > 0 ? left : 0;
    return (int)(step * 1000.0 + 0.5);
}

/* Wait until `fd` can be read (or written): 0, or -1 with errno (ETIMEDOUT after the fabric timeout). */
static int wait_for(int fd, short events)
{
    struct pollfd p = {fd, events, 0};
    for (;;) {
        int n = poll(&p, 1, timeout_ms());
        if (n > 0)
            return 0;
        if (n == 0) {
            errno = ETIMEDOUT;
            return -1;
        }
        if (errno != EINTR)
            return -1;
    }
}

/* A fresh connection to the engine's data port, within the fabric timeout: fd, or -1 with errno. */
static int dial(const vs_remote *r)
{
    struct sockaddr_storage sa;
    socklen_t len;
    memset(&sa, 0, sizeof sa);
    if (r->family == AF_INET) {
        struct sockaddr_in *in = (struct sockaddr_in *)&sa;
        in->sin_family = AF_INET;
        in->sin_port = htons(r->port);
        memcpy(&in->sin_addr, r->addr, 4);
        len = sizeof *in;
    } else {
        struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)&sa;
        in6->sin6_family = AF_INET6;
        in6->sin6_port = htons(r->port);
        memcpy(&in6->sin6_addr, r->addr, 16);
        len = sizeof *in6;
    }
    int fd = socket(r->family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        return -1;
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); /* a header and a small body go out at once */
    if (connect(fd, (struct sockaddr *)&sa, len) != 0) {
        int e = errno;
        if (e != EINPROGRESS) {
            close(fd);
            errno = e;
            return -1;
        }
        int soerr = 0;
        socklen_t sl = sizeof soerr;
        if (wait_for(fd, POLLOUT) != 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) != 0 || soerr != 0) {
            e = soerr ? soerr : errno;
            close(fd);
            errno = e;
            return -1;
        }
    }
    return fd;
}

/* Send all of `iov` (changed as it goes): 0, or -1 with errno (EPIPE never raises SIGPIPE here). */
static int send_all(int fd, struct iovec *iov, int n)
{
    while (n > 0) {
        struct msghdr m = {0};
        m.msg_iov = iov;
        m.msg_iovlen = (size_t)n;
        ssize_t sent = sendmsg(fd, &m, MSG_NOSIGNAL);
        if (sent < 0) {
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                return -1;
            if (wait_for(fd, POLLOUT) != 0)
                return -1;
            continue;
        }
        while (n > 0 && (size_t)sent >= iov->iov_len) {
            sent -= (ssize_t)iov->iov_len;
            iov++;
            n--;
        }
        if (n > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + sent;
            iov->iov_len -= (size_t)sent;
        }
    }
    return 0;
}

/* Read exactly `n` bytes into `p`: 0, or -1 with errno (ECONNRESET when the engine closed the connection). */
static int recv_all(int fd, void *p, size_t n)
{
    uint8_t *at = p;
    while (n > 0) {
        ssize_t got = recv(fd, at, n, 0);
        if (got > 0) {
            at += got;
            n -= (size_t)got;
        } else if (got == 0) {
            errno = ECONNRESET;
            return -1;
        } else if (errno == EINTR) {
            continue;
        } else if (errno != EAGAIN && errno != EWOULDBLOCK) {
            return -1;
        } else if (wait_for(fd, POLLIN) != 0) {
            return -1;
        }
    }
    return 0;
}

enum { MOVED = 0, FAILED = -1, REJECTED = -2, GARBLED = -3 };

/* Read the engine's status frame: MOVED, REJECTED (it does not serve that range), GARBLED, or FAILED (errno). */
static int status(int fd)
{
    uint8_t raw[8];
    if (recv_all(fd, raw, sizeof raw) != 0)
        return FAILED;
    uint64_t s = vs_wire_get_le(raw, 8);
    if ((s >> 32) != STATUS_MAGIC)
        return GARBLED;
    return (s & 0xFFFFFFFFu) == 0 ? MOVED : (s & 0xFFFFFFFFu) == STATUS_REJECTED ? REJECTED : GARBLED;
}

/* One request of at most CHUNK bytes on `fd`. */
static int request(int fd, uint64_t address, uint8_t *local, size_t n, bool write)
{
    set_deadline(n);
    uint8_t header[HEADER] = {0};
    for (int b = 0; b < 8; b++) {
        header[b] = (uint8_t)((uint64_t)n >> (8 * b));
        header[8 + b] = (uint8_t)(address >> (8 * b));
    }
    header[16] = (uint8_t)((write ? OP_WRITE : OP_READ) | OP_ACKED);
    struct iovec iov[2] = {{header, HEADER}, {local, write ? n : 0}};
    if (send_all(fd, iov, write ? 2 : 1) != 0)
        return FAILED;
    if (write)
        return status(fd);
    int s = status(fd);
    if (s != MOVED)
        return s;
    return recv_all(fd, local, n) == 0 ? MOVED : FAILED;
}

aclError vs_fabric_move(vs_err *err, const vs_remote *r, uint64_t offset, void *local, size_t count, bool write)
{
    if (offset > r->size || count > r->size - offset) /* never sent: it would cost the connection */
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "%zu bytes at offset %llu run past the memory of another "
                      "server (%llu bytes)", count, (unsigned long long)offset, (unsigned long long)r->size);
    int fd = take(r);
    bool fresh = fd < 0;
    int outcome = MOVED;
    size_t done = 0;
    while (done < count) {
        if (fd < 0) {
            set_deadline(0); /* a connection within one fabric timeout */
            if ((fd = dial(r)) < 0) {
                outcome = FAILED;
                break;
            }
            track(fd);
        }
        size_t n = count - done < CHUNK ? count - done : CHUNK;
        outcome = request(fd, r->address + offset + done, (uint8_t *)local + done, n, write);
        if (outcome == FAILED && !fresh && done == 0 && errno != ETIMEDOUT && errno != EFAULT) {
            /* a kept connection the engine closed while it idled: once more on a fresh one */
            drop(fd);
            fd = -1;
            fresh = true;
            continue;
        }
        if (outcome != MOVED)
            break;
        done += n;
    }
    if (outcome == MOVED) {
        /* kept only while an import names the engine: one freed while this copy ran forgot the engine's idle
         * connections (vs_fabric_forget, under the lock), and nothing would close this one after it */
        vs_lock();
        bool keep = fd >= 0 && vs_engine_in_use(r);
        if (keep)
            give_back(r, fd);
        vs_unlock();
        if (!keep && fd >= 0)
            drop(fd);
        return ACL_SUCCESS;
    }
    int e = errno;
    if (fd >= 0)
        drop(fd);
    const char *what = write ? "write" : "read";
    if (outcome == FAILED && e == EFAULT)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "the local memory of a %zu-byte %s across servers went away "
                      "while it ran (unmapped or freed meanwhile)", count, what);
    if (outcome == REJECTED)
        return vs_set(err, ACL_ERROR_RT_IPC_ERROR, "the transfer engine at %s no longer serves this memory (%s of %zu "
                      "bytes refused): its import was released there, or that node's broker restarted", r->where,
                      what, count);
    if (outcome == GARBLED)
        return vs_set(err, ACL_ERROR_RT_IPC_ERROR, "the transfer engine at %s answered a %s of %zu bytes with "
                      "something that is not its status: not a transfer engine, or another version", r->where, what,
                      count);
    if (e == ETIMEDOUT && vs_now() >= deadline)
        return vs_set(err, ACL_ERROR_RT_IPC_ERROR, "the transfer engine at %s did not finish a %s of %zu bytes in its "
                      "time (%g s a MiB, VMMSHARE_FABRIC_TIMEOUT, and %g s more): that node or its link is overloaded, "
                      "or it trickles its bytes", r->where, what, count, vs_rt.config.fabric_timeout,
                      vs_rt.config.fabric_timeout);
    if (e == ETIMEDOUT)
        return vs_set(err, ACL_ERROR_RT_IPC_ERROR, "the transfer engine at %s made no progress on a %s of %zu bytes "
                      "within %g s (VMMSHARE_FABRIC_TIMEOUT): that node is frozen, overloaded or unreachable", r->where,
                      what, count, vs_rt.config.fabric_timeout);
    return vs_set(err, ACL_ERROR_RT_IPC_ERROR, "the transfer engine could not %s %zu bytes of the memory served at "
                  "%s (%s): that node's broker is down or unreachable, or no longer serves the memory", what, count,
                  r->where, strerror(e));
}
