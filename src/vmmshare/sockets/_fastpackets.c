/* Packets over an AF_UNIX SOCK_SEQPACKET socket in C: one sendmsg or recvmsg per call, the SCM_RIGHTS and
 * SCM_CREDENTIALS control messages built and parsed here rather than by the interpreter.
 *
 * sockets/packets.py keeps the same functions in pure Python and picks these when this module imports (and
 * VMMSHARE_PURE_PYTHON is not set). Both must behave alike: the same buffer sizes (so the same packets come back
 * truncated), received fds close-on-exec, every fd that arrived handed back to the caller (who closes the ones it
 * did not ask for), the sender's pid from the kernel's credentials, errors as the OSError subclass of errno.
 *
 * The floor_* functions (_fastfloor.c) measure the least a request/reply with an fd can cost (vmmshare bench).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_fastpackets.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#define MAX_ANC_FDS 253 /* SCM_MAX_FD: the kernel passes no more in one message */
#define MAX_DATA (1 << 20)

/* Room for `nfds` descriptors, and the sender's credentials when `creds`: the layout recvmsg fills. */
static size_t control_size(int nfds, int creds)
{
    return CMSG_SPACE(sizeof(int) * (size_t)nfds) + (creds ? CMSG_SPACE(sizeof(struct ucred)) : 0);
}

/* An int argument, with OverflowError as array('i') gives for one out of range. */
int vs_as_int(PyObject *obj)
{
    long value = PyLong_AsLong(obj);
    if (value == -1 && PyErr_Occurred())
        return -1;
    if (value > INT_MAX || value < INT_MIN) {
        PyErr_SetString(PyExc_OverflowError, value > INT_MAX ? "signed integer is greater than maximum"
                                                              : "signed integer is less than minimum");
        return -1;
    }
    return (int)value;
}

static PyObject *fileno_name; /* "fileno", interned at import */

/* The fd of a socket (its fileno(); -1 once closed, which the system call then refuses with EBADF, as Python's
 * socket methods do), or of an int. -1 with an exception set on failure, so a closed socket is told apart by
 * PyErr_Occurred. */
static int sock_fd(PyObject *obj)
{
    PyObject *number = PyLong_Check(obj) ? Py_NewRef(obj) : PyObject_CallMethodNoArgs(obj, fileno_name);
    if (number == NULL)
        return -1;
    int fd = vs_as_int(number);
    Py_DECREF(number);
    return fd;
}

long long vs_now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void close_all(const int *fds, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        close(fds[i]);
}

/* The frame and fd limits of the wire protocol (configure): fixed for the process, so not passed each call. */
static long max_frame = 64 * 1024;
static int anc_fds = 5;

PyDoc_STRVAR(configure_doc, "configure(max_frame, anc_fds) -> None\n\n"
             "Packets longer than max_frame bytes come back truncated; there is room for anc_fds fds.");

static PyObject *fast_configure(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "configure takes (max_frame, anc_fds)");
        return NULL;
    }
    long frame = PyLong_AsLong(args[0]);
    if (frame == -1 && PyErr_Occurred())
        return NULL;
    int fds = vs_as_int(args[1]);
    if (fds == -1 && PyErr_Occurred())
        return NULL;
    if (frame < 0 || frame >= MAX_DATA || fds < 0 || fds > MAX_ANC_FDS) {
        PyErr_SetString(PyExc_ValueError, "max_frame or anc_fds out of range");
        return NULL;
    }
    max_frame = frame;
    anc_fds = fds;
    Py_RETURN_NONE;
}

/* The socket (or fd) and the flags of recv(sock, flags=0). */
static int recv_args(PyObject *const *args, Py_ssize_t nargs, int *fd, int *flags)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "takes (sock, flags=0)");
        return -1;
    }
    *fd = sock_fd(args[0]);
    if (*fd == -1 && PyErr_Occurred())
        return -1;
    *flags = nargs > 1 ? vs_as_int(args[1]) : 0;
    return *flags == -1 && PyErr_Occurred() ? -1 : 0;
}

/* A packet being received: the buffer (on the heap, not the stack: a thread may have as little as 32 KiB of stack,
 * threading.stack_size), and room for the fds and the sender's credentials. */
struct packet {
    char *buf;
    size_t room;
    int creds;
    struct iovec iov;
    struct msghdr msg;
    union {
        struct cmsghdr align;
        char bytes[CMSG_SPACE(sizeof(int) * MAX_ANC_FDS) + CMSG_SPACE(sizeof(struct ucred))];
    } control;
};

/* Room for one packet (max_frame, one byte more: a longer packet shows as longer); -1 with MemoryError set. */
static int packet_open(struct packet *p, int creds)
{
    p->room = (size_t)max_frame + 1;
    p->creds = creds;
    p->buf = PyMem_RawMalloc(p->room);
    if (p->buf == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* One recvmsg into the packet (no Python object touched: callable without the GIL); -1 with errno on failure. */
static ssize_t packet_recv(struct packet *p, int fd, int flags)
{
    memset(&p->msg, 0, sizeof p->msg);
    p->iov.iov_base = p->buf;
    p->iov.iov_len = p->room;
    p->msg.msg_iov = &p->iov;
    p->msg.msg_iovlen = 1;
    p->msg.msg_control = p->control.bytes;
    p->msg.msg_controllen = control_size(anc_fds, p->creds);
    return recvmsg(fd, &p->msg, flags | MSG_CMSG_CLOEXEC);
}

/* The packet received (`got` bytes) as (data, fds, truncated[, extra]), its buffer freed: extra is the sender's pid
 * for a packet received with credentials, else `extra` itself (a new reference, or NULL for none). Every fd
 * received is either in the returned list or, if the result cannot be built (no memory), closed here: none
 * leaks. */
static PyObject *packet_result(struct packet *p, ssize_t got, PyObject *extra)
{
    int fds[MAX_ANC_FDS + 4];
    Py_ssize_t nfds = 0;
    long sender = -1;
    int overflow = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&p->msg); c != NULL; c = CMSG_NXTHDR(&p->msg, c)) {
        size_t at = (size_t)((char *)c - p->control.bytes);
        size_t len = at + c->cmsg_len > p->msg.msg_controllen ? p->msg.msg_controllen - at : c->cmsg_len;
        if (len < CMSG_LEN(0) || c->cmsg_level != SOL_SOCKET)
            continue;
        size_t payload = len - CMSG_LEN(0);
        if (c->cmsg_type == SCM_RIGHTS) {
            size_t n = payload / sizeof(int);
            for (size_t i = 0; i < n; i++) {
                int one;
                memcpy(&one, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
                if (nfds < (Py_ssize_t)(sizeof fds / sizeof fds[0])) {
                    fds[nfds++] = one;
                } else { /* more than one message can carry: never kept, and the packet counts as cut */
                    close(one);
                    overflow = 1;
                }
            }
        } else if (c->cmsg_type == SCM_CREDENTIALS && payload >= sizeof(struct ucred)) {
            struct ucred cred;
            memcpy(&cred, CMSG_DATA(c), sizeof cred);
            sender = cred.pid;
        }
    }
    int truncated = (p->msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0 || got > max_frame || overflow;
    PyObject *data = PyBytes_FromStringAndSize(p->buf, got);
    PyMem_RawFree(p->buf);
    p->buf = NULL;
    PyObject *list = PyList_New(nfds);
    if (p->creds)
        extra = PyLong_FromLong(sender);
    int more = p->creds || extra != NULL;
    PyObject *result = PyTuple_New(more ? 4 : 3);
    if (data == NULL || list == NULL || (more && extra == NULL) || result == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < nfds; i++) {
        PyObject *item = PyLong_FromLong(fds[i]);
        if (item == NULL)
            goto fail;
        PyList_SET_ITEM(list, i, item);
    }
    PyTuple_SET_ITEM(result, 0, data);
    PyTuple_SET_ITEM(result, 1, list);
    PyTuple_SET_ITEM(result, 2, PyBool_FromLong(truncated));
    if (more)
        PyTuple_SET_ITEM(result, 3, extra);
    return result;
fail:
    Py_XDECREF(data);
    Py_XDECREF(list);
    Py_XDECREF(extra);
    Py_XDECREF(result);
    close_all(fds, nfds);
    return NULL;
}

/* One recvmsg: (data, fds, truncated[, sender pid]). */
static PyObject *receive(PyObject *const *args, Py_ssize_t nargs, int creds)
{
    int fd, flags;
    if (recv_args(args, nargs, &fd, &flags) < 0)
        return NULL;
    struct packet p;
    if (packet_open(&p, creds) < 0)
        return NULL;
    ssize_t got;
    for (;;) {
        if (flags & MSG_DONTWAIT) {
            got = packet_recv(&p, fd, flags);
        } else {
            Py_BEGIN_ALLOW_THREADS
            got = packet_recv(&p, fd, flags);
            Py_END_ALLOW_THREADS
        }
        if (got >= 0)
            break;
        int err = errno;
        if (err != EINTR || PyErr_CheckSignals() < 0) { /* EINTR: retry, as Python does (PEP 475) */
            PyMem_RawFree(p.buf);
            errno = err;
            return err == EINTR ? NULL : PyErr_SetFromErrno(PyExc_OSError);
        }
    }
    return packet_result(&p, got, NULL);
}

PyDoc_STRVAR(recv_doc, "recv(sock, flags=0) -> (data, fds, truncated)\n\n"
             "One packet (sock: a socket or an fd), its fds close-on-exec; truncated when longer than max_frame or "
             "its fds did not fit (see configure).");

static PyObject *fast_recv(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    return receive(args, nargs, 0);
}

PyDoc_STRVAR(recv_request_doc, "recv_request(sock, flags=0) -> (data, fds, truncated, sender)\n\n"
             "recv, with room for the sender's credentials: sender is its pid, -1 when none came.");

static PyObject *fast_recv_request(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    return receive(args, nargs, 1);
}

PyDoc_STRVAR(send_doc, "send(sock, data, fds=()) -> None\n\n"
             "One packet with the fds (a sequence of ints) attached by SCM_RIGHTS; OSError as sendmsg fails (a "
             "closed peer: BrokenPipeError, never SIGPIPE).");

/* A packet without fds: send(2), GIL released (a full peer queue blocks a blocking socket). */
static PyObject *send_plain(int fd, PyObject *obj)
{
    Py_buffer data;
    if (PyObject_GetBuffer(obj, &data, PyBUF_SIMPLE) < 0)
        return NULL;
    ssize_t sent;
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        sent = send(fd, data.buf, (size_t)data.len, MSG_NOSIGNAL);
        Py_END_ALLOW_THREADS
        if (sent >= 0)
            break;
        int err = errno;
        if (err != EINTR || PyErr_CheckSignals() < 0) {
            PyBuffer_Release(&data);
            errno = err;
            return err == EINTR ? NULL : PyErr_SetFromErrno(PyExc_OSError);
        }
    }
    PyBuffer_Release(&data);
    Py_RETURN_NONE;
}

static PyObject *fast_send(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs < 2 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "send takes (sock, data, fds=())");
        return NULL;
    }
    int fd = sock_fd(args[0]);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    if (nargs == 2 || (PyTuple_CheckExact(args[2]) && PyTuple_GET_SIZE(args[2]) == 0))
        return send_plain(fd, args[1]);
    /* A tuple of its own: an item's __index__ could empty a list while its items are read. */
    PyObject *seq = PyTuple_CheckExact(args[2]) ? Py_NewRef(args[2]) : PySequence_Tuple(args[2]);
    if (seq == NULL)
        return NULL;
    Py_ssize_t nfds = PyTuple_GET_SIZE(seq);
    if (nfds > MAX_ANC_FDS) {
        Py_DECREF(seq);
        errno = EINVAL; /* what sendmsg says of more than SCM_MAX_FD */
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    union {
        struct cmsghdr align;
        char bytes[CMSG_SPACE(sizeof(int) * MAX_ANC_FDS)];
    } control;
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    if (nfds > 0) {
        msg.msg_control = control.bytes;
        msg.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
        memset(control.bytes, 0, msg.msg_controllen);
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
        for (Py_ssize_t i = 0; i < nfds; i++) {
            int value = vs_as_int(PyTuple_GET_ITEM(seq, i));
            if (value == -1 && PyErr_Occurred()) {
                Py_DECREF(seq);
                return NULL;
            }
            memcpy(CMSG_DATA(c) + (size_t)i * sizeof(int), &value, sizeof(int));
        }
    }
    Py_DECREF(seq);
    Py_buffer data;
    if (PyObject_GetBuffer(args[1], &data, PyBUF_SIMPLE) < 0)
        return NULL;
    struct iovec iov = {data.buf, (size_t)data.len};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    ssize_t sent;
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
        Py_END_ALLOW_THREADS
        if (sent >= 0)
            break;
        int err = errno;
        if (err != EINTR || PyErr_CheckSignals() < 0) {
            PyBuffer_Release(&data);
            errno = err;
            return err == EINTR ? NULL : PyErr_SetFromErrno(PyExc_OSError);
        }
    }
    PyBuffer_Release(&data);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- a request and its reply, for the client */

/* The spin's policy, as sockets/spinning.py has it for the waits made in Python: between polls a spin yields its
 * core, and a yield that ran another task for longer than YIELD_SLICE_NS means the core is wanted; the spin gives
 * up then, and none starts in this process for BACK_OFF_RATIO times the time the yield gave away, at most
 * BACK_OFF_NS. The back-off is this module's own (a process waits either here or in spinning.py, by whether its
 * packets go through C). */
#define YIELD_SLICE_NS 50000LL
#define BACK_OFF_NS 20000000LL
#define BACK_OFF_RATIO 2
static long long calm_after_ns; /* no spin starts before this vs_now_ns(); read and written without the GIL */

/* Where the kernel's count of runnable tasks is read, and how many cores the machine has (watch_load): a spin starts
 * only while no more tasks are runnable than that, read afresh when the reply is not there at once. Set while the
 * GIL is held, read by spins without it (the path is written before the count, and both before any spin). */
static char loadavg_path[PATH_MAX] = "/proc/loadavg";
static long load_cores = 1;

PyDoc_STRVAR(watch_load_doc, "watch_load(path, cores) -> None\n\n"
             "A call spins only while at most `cores` tasks are runnable, as the fourth field of the file at `path` "
             "(/proc/loadavg) says.");

static PyObject *fast_watch_load(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2 || !PyUnicode_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "watch_load takes (path: str, cores: int)");
        return NULL;
    }
    Py_ssize_t len;
    const char *path = PyUnicode_AsUTF8AndSize(args[0], &len);
    if (path == NULL)
        return NULL;
    long cores = PyLong_AsLong(args[1]);
    if (cores == -1 && PyErr_Occurred())
        return NULL;
    if (len <= 0 || len >= (Py_ssize_t)sizeof loadavg_path || (Py_ssize_t)strlen(path) != len || cores < 1) {
        PyErr_SetString(PyExc_ValueError, "watch_load: an empty, overlong or NUL-holding path, or no cores");
        return NULL;
    }
    memcpy(loadavg_path, path, (size_t)len + 1);
    load_cores = cores;
    Py_RETURN_NONE;
}

/* Whether no more tasks are runnable now than the machine has cores (this one included); 1 where the count cannot be
 * read, as spinning.cores_free says (the yield check still stands). Runs without the GIL. */
static int cores_free(void)
{
    int fd = open(loadavg_path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 1;
    char text[128];
    ssize_t n = read(fd, text, sizeof text - 1);
    close(fd);
    if (n <= 0)
        return 1;
    text[n] = '\0';
    char *field = text;
    for (int i = 0; i < 3; i++) { /* the fourth field: runnable/all */
        field = strchr(field, ' ');
        if (field == NULL)
            return 1;
        field++;
    }
    char *end;
    long running = strtol(field, &end, 10);
    if (end == field || *end != '/')
        return 1;
    return running <= load_cores;
}

static int would_block(int err)
{
    return err == EAGAIN || err == EWOULDBLOCK || err == EINTR;
}

/* Poll the socket for its packet by receiving it (one system call a try), yielding the core between tries, for up
 * to `spin_ns`, once the first try found nothing and a core is free (cores_free, read then: the reading costs less
 * than the broker takes to answer, and is of this moment). Returns what the last recvmsg did (bytes, or -1 with
 * *err); *missed when the window ended, or every core was busy, or the core was wanted, or a back-off was on,
 * without the packet. Runs without the GIL. */
static ssize_t spin_for(struct packet *p, int fd, long long spin_ns, int *err, int *missed)
{
    long long start = vs_now_ns();
    *err = EAGAIN;
    if (start < __atomic_load_n(&calm_after_ns, __ATOMIC_RELAXED)) {
        *missed = 1;
        return -1;
    }
    long long deadline = start + spin_ns;
    for (int tries = 0;; tries++) {
        ssize_t got = packet_recv(p, fd, MSG_DONTWAIT);
        if (got >= 0 || !would_block(errno)) {
            *err = got < 0 ? errno : 0;
            return got;
        }
        if (tries == 0 && !cores_free())
            break; /* every core busy: missed, as a window that ran out is, and the next calls wait without a poll */
        long long before = vs_now_ns();
        if (before > deadline)
            break;
        sched_yield(); /* whoever is runnable here (the broker, on a machine with few cores) may have the core */
        long long after = vs_now_ns();
        if (after - before > YIELD_SLICE_NS) { /* someone took it: the core is wanted */
            got = packet_recv(p, fd, MSG_DONTWAIT);
            if (got >= 0 || !would_block(errno)) {
                *err = got < 0 ? errno : 0;
                return got;
            }
            long long away = (after - before) * BACK_OFF_RATIO;
            __atomic_store_n(&calm_after_ns, after + (away < BACK_OFF_NS ? away : BACK_OFF_NS), __ATOMIC_RELAXED);
            break;
        }
    }
    *missed = 1;
    *err = EAGAIN;
    return -1;
}

PyDoc_STRVAR(call_doc, "call(sock, data, spin, timeout) -> (data, fds, truncated, missed)\n\n"
             "Send one packet without fds on a blocking socket and receive the packet that comes back, as recv "
             "does: polled for up to spin seconds first while a core is free for it (the run queue read then, see "
             "watch_load; missed: the poll ran and did not find it, or every core was busy), then waited for in "
             "poll(2), TimeoutError after timeout seconds. GIL released while waiting.");

/* The spin and timeout of call and wait, checked. */
static int wait_args(PyObject *spin_obj, PyObject *timeout_obj, double *spin, double *timeout)
{
    *spin = PyFloat_AsDouble(spin_obj);
    if (*spin == -1.0 && PyErr_Occurred())
        return -1;
    *timeout = PyFloat_AsDouble(timeout_obj);
    if (*timeout == -1.0 && PyErr_Occurred())
        return -1;
    if (!(*spin >= 0.0 && *spin <= 10.0 && *timeout >= 0.0 && *timeout <= 86400.0)) {
        PyErr_SetString(PyExc_ValueError, "spin or timeout out of range");
        return -1;
    }
    return 0;
}

/* The packet that answers a request sent on fd: spun for (spin_for), then waited for in poll(2) up to timeout;
 * recv's three values and missed. */
static PyObject *await_reply(int fd, double spin, double timeout)
{
    struct packet p;
    if (packet_open(&p, 0) < 0)
        return NULL;
    ssize_t got = -1;
    int err = EAGAIN, missed = 0;
    long long spin_ns = (long long)(spin * 1e9);
    if (spin_ns > 0) {
        Py_BEGIN_ALLOW_THREADS
        got = spin_for(&p, fd, spin_ns, &err, &missed);
        Py_END_ALLOW_THREADS
    }
    long long deadline = vs_now_ns() + (long long)(timeout * 1e9);
    while (got < 0) {
        if (!would_block(err))
            goto oserror;
        if (err == EINTR && PyErr_CheckSignals() < 0)
            goto failed;
        long long left = deadline - vs_now_ns();
        struct pollfd pfd = {fd, POLLIN, 0};
        int ready = 0;
        if (left > 0) {
            Py_BEGIN_ALLOW_THREADS
            ready = poll(&pfd, 1, (int)((left + 999999) / 1000000));
            Py_END_ALLOW_THREADS
        }
        if (ready < 0) {
            err = errno;
            continue;
        }
        if (ready == 0) {
            char why[96];
            snprintf(why, sizeof why, "the broker did not answer within %.0f s", timeout);
            PyErr_SetString(PyExc_TimeoutError, why);
            goto failed;
        }
        got = packet_recv(&p, fd, MSG_DONTWAIT);
        err = got < 0 ? errno : 0;
    }
    return packet_result(&p, got, PyBool_FromLong(missed));
oserror:
    errno = err;
    PyErr_SetFromErrno(PyExc_OSError);
failed:
    PyMem_RawFree(p.buf);
    return NULL;
}

/* The socket and the polling window of call (its arguments 0, 2 and 3 of 4) and wait (0, 1 and 2 of 3). */
static int socket_and_window(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *usage, int *fd,
                             double *spin, double *timeout)
{
    if (nargs != want) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    *fd = sock_fd(args[0]);
    if (*fd == -1 && PyErr_Occurred())
        return -1;
    return wait_args(args[want - 2], args[want - 1], spin, timeout);
}

static PyObject *fast_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    int fd;
    double spin, timeout;
    if (socket_and_window(args, nargs, 4, "call takes (sock, data, spin, timeout)", &fd, &spin, &timeout) < 0)
        return NULL;
    PyObject *sent = send_plain(fd, args[1]);
    if (sent == NULL)
        return NULL;
    Py_DECREF(sent);
    return await_reply(fd, spin, timeout);
}

PyDoc_STRVAR(wait_doc, "wait(sock, spin, timeout) -> (data, fds, truncated, missed)\n\n"
             "The second half of call, for a request sent otherwise (with fds, or with work done between): the "
             "packet that comes back on a blocking socket, polled for and waited for as call does.");

static PyObject *fast_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    int fd;
    double spin, timeout;
    if (socket_and_window(args, nargs, 3, "wait takes (sock, spin, timeout)", &fd, &spin, &timeout) < 0)
        return NULL;
    return await_reply(fd, spin, timeout);
}

static PyMethodDef methods[] = {
    {"watch_load", (PyCFunction)(void (*)(void))fast_watch_load, METH_FASTCALL, watch_load_doc},
    {"configure", (PyCFunction)(void (*)(void))fast_configure, METH_FASTCALL, configure_doc},
    {"recv", (PyCFunction)(void (*)(void))fast_recv, METH_FASTCALL, recv_doc},
    {"recv_request", (PyCFunction)(void (*)(void))fast_recv_request, METH_FASTCALL, recv_request_doc},
    {"send", (PyCFunction)(void (*)(void))fast_send, METH_FASTCALL, send_doc},
    {"call", (PyCFunction)(void (*)(void))fast_call, METH_FASTCALL, call_doc},
    {"wait", (PyCFunction)(void (*)(void))fast_wait, METH_FASTCALL, wait_doc},
    {"floor_serve", (PyCFunction)(void (*)(void))fast_floor_serve, METH_FASTCALL, floor_serve_doc},
    {"floor_trips", (PyCFunction)(void (*)(void))fast_floor_trips, METH_FASTCALL, floor_trips_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "vmmshare.sockets._fastpackets",
    "Packets with fds and credentials over SOCK_SEQPACKET in C (the fast path of vmmshare.sockets.packets).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fastpackets(void)
{
    fileno_name = PyUnicode_InternFromString("fileno");
    if (fileno_name == NULL)
        return NULL;
    return PyModule_Create(&module);
}
