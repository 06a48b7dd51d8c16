/*
 * The node: this process's connection to the node's broker, the same session the Python client keeps
 * (vmmshare.client.connection), over the same protocol (wire.c).
 *
 * One connection per process, one request at a time (`conn_lock`), made by reach.c (to a broker this user may trust,
 * started when none answers). When the broker goes away (a restart, an idle exit), the next request reconnects and
 * charges this process's live allocations again, as the Python client does.
 *
 * Two kinds of id meet here: a token is the runtime's name for an allocation or an import (stable for the
 * process's life); a hold is the broker's id for this connection's claim on it, which a restarted broker gives
 * out anew.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "vs.h"
#include "wire.h"


#define REPLY_TIMEOUT_MS 60000
#define RETRIES 4
#define MAX_FDS 5

typedef struct hold {
    uint64_t token;
    uint64_t hold;   /* 0: none on this connection (its broker is gone) */
    bool charge;     /* a charge of this process's memory, charged again on a new broker */
    bool gpu;        /* GPU memory (CHARGE_GPU): its export tells the broker so */
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
static uint8_t frame_buf[VS_WIRE_MAX_FRAME]; /* the request being sent (under conn_lock) */

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
        double deadline = vs_now() + (double)spin / 1e6;
        struct pollfd p = {fd, POLLIN, 0};
        for (;;) {
            if (poll(&p, 1, 0) > 0) {
                spin_misses = 0;
                return 1;
            }
            if (vs_now() >= deadline)
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

/* ---------------------------------------------------------------- one exchange */

/* The broker's refusal of this connection (an ERROR to request 0), if it left one before closing it. */
static aclError refusal(vs_err *err, int fd)
{
    reply *r = &scratch;
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
    aclError rc = vs_reach_broker(err, &fd);
    if (rc)
        return rc;
    conn = fd;
    reply *r = &scratch;
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
        size_t n = vs_wire_encode(h->gpu ? VS_CHARGE_GPU : VS_CHARGE, req, &f, frame, &why);
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
    return &scratch;
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

aclError vs_node_charge(vs_err *err, int device, uint64_t size, uint64_t *token)
{
    reply *r = begin();
    vs_fields f = {0};
    f.v[0] = (uint64_t)(int64_t)device;
    f.v[1] = size;
    aclError rc = request(err, VS_CHARGE, &f, -1, 0, NULL, 0, VS_TOKEN, r);
    if (rc == ACL_SUCCESS)
        *token = new_token(r->f.v[0], true, device, size);
    end();
    return rc;
}

/* Charge GPU memory of node GPU `device` (CHARGE_GPU: recorded, the GPU's own capacity applies): the CUDA backend's
 * allocations (cuda.c), whose exports then tell the broker they are GPU memory. */
aclError vs_node_charge_gpu(vs_err *err, int device, uint64_t size, uint64_t *token)
{
    reply *r = begin();
    vs_fields f = {0};
    f.v[0] = (uint32_t)device;
    f.v[1] = size;
    aclError rc = request(err, VS_CHARGE_GPU, &f, -1, 0, NULL, 0, VS_TOKEN, r);
    if (rc == ACL_SUCCESS) {
        *token = new_token(r->f.v[0], true, device, size);
        hold_of(*token)->gpu = true;
    }
    end();
    return rc;
}

void vs_node_release(uint64_t token)
{
    reply *r = begin();
    hold *h = hold_of(token);
    if (h != NULL && h->hold != 0) {
        vs_fields f = {0};
        vs_err ignored;
        request(&ignored, VS_RELEASE, &f, 0, token, NULL, 0, VS_OK, r);
    }
    drop_hold(token);
    end();
}

aclError vs_node_mem_info(vs_err *err, int device, uint64_t *free_bytes, uint64_t *total)
{
    reply *r = begin();
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
    reply *r = begin();
    vs_fields f = {0};
    f.v[1] = size;
    f.v[2] = flags;
    f.v[3] = share_type;
    f.v[4] = vs_rt.config.server_id;
    hold *h = hold_of(token);
    f.v[5] = h != NULL && h->gpu; /* the memory's kind: 0 a host memfd, 1 a CUDA allocation's fd */
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
    reply *r = begin();
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

/* A trustlist request: `kind` SET_PIDS (this server's pids) or SET_REMOTE_PIDS (those of `server`). */
static aclError pids_request(vs_err *err, int kind, uint64_t shareable, uint32_t share_type, uint32_t server,
                             const uint32_t *pids, size_t n)
{
    if (n > VS_WIRE_MAX_PIDS)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "%zu pids: at most %d per call", n, VS_WIRE_MAX_PIDS);
    const uint8_t *tail = pids_tail(pids, n);
    reply *r = begin();
    vs_fields f = {0};
    f.v[0] = shareable;
    f.v[1] = share_type;
    f.v[2] = server;
    f.tail = tail;
    f.tail_len = 4 * n;
    aclError rc = request(err, kind, &f, -1, 0, NULL, 0, VS_OK, r);
    end();
    return rc;
}

aclError vs_node_set_pids(vs_err *err, uint64_t shareable, uint32_t share_type, const uint32_t *pids, size_t n)
{
    return pids_request(err, VS_SET_PIDS, shareable, share_type, 0, pids, n);
}

/* Ask the broker again for `shareable`, as the driver checks a handle on each import, and let the hold go: 107017
 * once revoked, 207006 once the trustlist no longer admits this process; `size`: what was exported. */
aclError vs_node_still_admitted(vs_err *err, uint64_t shareable, uint32_t share_type, const uint8_t *secret,
                                uint64_t *size)
{
    int fd;
    uint64_t token;
    vs_prop prop;
    bool gpu;
    aclError rc = vs_node_import(err, shareable, share_type, secret, &fd, &token, size, &prop, &gpu);
    if (rc == ACL_SUCCESS) {
        close(fd);
        vs_node_release(token);
    }
    return rc;
}

/* The allocation property of an IMPORTED or REMOTE_IMPORTED reply (fields 3 to 7, framing.PROP's place). */
static void prop_of(const vs_fields *f, vs_prop *prop)
{
    memset(prop, 0, sizeof *prop);
    prop->handle_type = (uint32_t)f->v[3];
    prop->allocation_type = (uint32_t)f->v[4];
    prop->mem_attr = (uint32_t)f->v[5];
    prop->loc_type = (uint32_t)f->v[6];
    prop->loc_id = (int64_t)f->v[7];
}

aclError vs_node_import(vs_err *err, uint64_t shareable, uint32_t share_type, const uint8_t *secret, int *fd,
                        uint64_t *token, uint64_t *size, vs_prop *prop, bool *gpu)
{
    static const uint8_t none[VS_SECRET_SIZE];
    reply *r = begin();
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
        prop_of(&r->f, prop);
        *token = new_token(r->f.v[0], false, 0, 0);
    }
    end();
    return rc;
}

aclError vs_node_bare_tgid(vs_err *err, uint32_t *pid)
{
    reply *r = begin();
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
    return pids_request(err, VS_SET_REMOTE_PIDS, shareable, share_type, server, pids, n);
}

/* Another server's FABRIC memory (the 128 bytes of `handle`), imported through this node's broker, which asks the
 * exporting node's: the hold's token, the memory's size and properties, its address in the exporting node's
 * transfer engine and the port that engine takes transfers on (at the handle's fabric address). No fd comes: the
 * memory stays on its server. */
aclError vs_node_remote_import(vs_err *err, const uint8_t *handle, uint64_t *token, uint64_t *size, vs_prop *prop,
                               uint64_t *address, uint16_t *data_port)
{
    reply *r = begin();
    vs_fields f = {0};
    f.bytes[0] = handle;
    aclError rc = request(err, VS_REMOTE_IMPORT, &f, -1, 0, NULL, 0, VS_REMOTE_IMPORTED, r);
    if (rc == ACL_SUCCESS) {
        *token = new_token(r->f.v[0], false, 0, 0);
        *size = r->f.v[1];
        prop_of(&r->f, prop);
        *address = r->f.v[8];
        *data_port = (uint16_t)r->f.v[11];
    }
    end();
    return rc;
}
