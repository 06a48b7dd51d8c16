/* What the files of the _fastpackets module share: the argument reader, and the floor functions of _fastfloor.c
 * that the module's method table names. */
#ifndef VMMSHARE_FASTPACKETS_H
#define VMMSHARE_FASTPACKETS_H

#include <Python.h>

/* An int argument, with OverflowError as array('i') gives for one out of range (-1 with an error set). */
int vs_as_int(PyObject *obj);
/* Nanoseconds on the monotonic clock. */
long long vs_now_ns(void);

extern const char floor_serve_doc[], floor_trips_doc[];
PyObject *fast_floor_serve(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *fast_floor_trips(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif /* VMMSHARE_FASTPACKETS_H */
