/* The least a request and its reply with an fd can cost (vmmshare bench's floor): both ends in C, one sendmsg and
 * one recvmsg each way, the fd mapped and unmapped on the receiving side. Part of the _fastpackets module. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "_fastpackets.h"

const char floor_serve_doc[] = ("floor_serve(fd, memfd) -> None\n\n"
             "Answer each packet on fd with the same bytes and memfd attached, until the peer closes: the least a "
             "broker can do for an import. Blocking, GIL released.");

PyObject *fast_floor_serve(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "floor_serve takes (fd, memfd)");
        return NULL;
    }
    int fd = vs_as_int(args[0]);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    int memfd = vs_as_int(args[1]);
    if (memfd == -1 && PyErr_Occurred())
        return NULL;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    char buf[256];
    union {
        struct cmsghdr align;
        char bytes[CMSG_SPACE(sizeof(int))];
    } control;
    for (;;) {
        ssize_t got = recv(fd, buf, sizeof buf, 0);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0) {
            err = got < 0 ? errno : 0;
            break;
        }
        struct iovec iov = {buf, (size_t)got};
        struct msghdr msg;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.bytes;
        msg.msg_controllen = sizeof control.bytes;
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &memfd, sizeof(int));
        ssize_t sent;
        do
            sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
        while (sent < 0 && errno == EINTR);  /* a reply is never dropped: the peer would wait for it forever */
        if (sent < 0) {
            err = errno == EPIPE || errno == ECONNRESET ? 0 : errno;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

/* The first fd of a packet's SCM_RIGHTS data, every other fd it brought closed; -1 (all closed) if it brought none
   or its control data was cut. */
static int first_right_closing_the_rest(struct msghdr *msg)
{
    int first = -1;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(msg); c != NULL; c = CMSG_NXTHDR(msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS || c->cmsg_len < CMSG_LEN(0))
            continue;
        size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < n; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
            if (first < 0)
                first = fd;
            else
                close(fd);
        }
    }
    if (first >= 0 && (msg->msg_flags & MSG_CTRUNC)) {
        close(first);
        return -1;
    }
    return first;
}

const char floor_trips_doc[] = ("floor_trips(fd, reps, size) -> (round_trip_ns, round_trip_mmap_ns)\n\n"
             "reps blocking request/replies on fd, each reply's fd mapped (size bytes, shared) and unmapped: two "
             "lists of nanoseconds, to the reply and to the mapping. Blocking, GIL released.");

PyObject *fast_floor_trips(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "floor_trips takes (fd, reps, size)");
        return NULL;
    }
    int fd = vs_as_int(args[0]);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t reps = PyLong_AsSsize_t(args[1]);
    if (reps == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t size = PyLong_AsSsize_t(args[2]);
    if (size == -1 && PyErr_Occurred())
        return NULL;
    if (reps < 0 || reps > 10000000 || size <= 0) {
        PyErr_SetString(PyExc_ValueError, "reps or size out of range");
        return NULL;
    }
    long long *times = PyMem_Malloc(sizeof(long long) * 2 * (size_t)(reps ? reps : 1));
    if (times == NULL)
        return PyErr_NoMemory();
    int err = 0;
    Py_ssize_t done = 0;
    Py_BEGIN_ALLOW_THREADS
    char request[24] = {0}, reply[256];
    union {
        struct cmsghdr align;
        char bytes[CMSG_SPACE(sizeof(int) * 4)];
    } control;
    for (; done < reps; done++) {
        long long t0 = vs_now_ns();
        ssize_t sent;
        do
            sent = send(fd, request, sizeof request, MSG_NOSIGNAL);
        while (sent < 0 && errno == EINTR);
        if (sent < 0) {
            err = errno;
            break;
        }
        struct iovec iov = {reply, sizeof reply};
        struct msghdr msg;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.bytes;
        msg.msg_controllen = sizeof control.bytes;
        ssize_t got;
        do
            got = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
        while (got < 0 && errno == EINTR);
        if (got <= 0) {
            err = got < 0 ? errno : ECONNRESET;
            break;
        }
        int memfd = first_right_closing_the_rest(&msg);
        if (memfd < 0) {
            err = EPROTO;
            break;
        }
        long long t1 = vs_now_ns();
        void *at = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
        long long t2 = vs_now_ns();
        if (at == MAP_FAILED) {
            err = errno;
            close(memfd);
            break;
        }
        munmap(at, (size_t)size);
        close(memfd);
        times[2 * done] = t1 - t0;
        times[2 * done + 1] = t2 - t0;
    }
    Py_END_ALLOW_THREADS
    if (err) {
        PyMem_Free(times);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    PyObject *trip = PyList_New(reps), *mapped = PyList_New(reps);
    if (trip == NULL || mapped == NULL) {
        Py_XDECREF(trip);
        Py_XDECREF(mapped);
        PyMem_Free(times);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < reps; i++) {
        PyObject *a = PyLong_FromLongLong(times[2 * i]), *b = PyLong_FromLongLong(times[2 * i + 1]);
        if (a == NULL || b == NULL) {
            Py_XDECREF(a);
            Py_XDECREF(b);
            Py_DECREF(trip);
            Py_DECREF(mapped);
            PyMem_Free(times);
            return NULL;
        }
        PyList_SET_ITEM(trip, i, a);
        PyList_SET_ITEM(mapped, i, b);
    }
    PyMem_Free(times);
    return Py_BuildValue("(NN)", trip, mapped);
}

