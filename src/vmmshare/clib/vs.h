/*
 * vmmshare's C library: what its files share (the process's runtime state, its tables and helpers).
 *
 * One runtime per process, as in the Python package: the configuration read once from the environment, a
 * connection to the node's broker (broker.c), and tables of this process's allocations, reservations, mappings,
 * blocks, IPC keys, devices, contexts and streams, all under one recursive lock (`vs_lock`). Calls check their
 * arguments in the acl layer's order (100000), then the runtime's (107000 ...), and every failure leaves a message
 * for aclGetRecentErrMsg() in the calling thread (errors.c).
 */
#ifndef VMMSHARE_CLIB_VS_H
#define VMMSHARE_CLIB_VS_H

#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "acl/acl.h"

#define VS_API ACL_FUNC_VISIBILITY

#define VS_MIN_GRANULARITY ((size_t)2 << 20)
#define VS_HUGE1G_GRANULARITY ((size_t)1 << 30)
#define VS_ARENA_START ((uintptr_t)16 << 40)
#define VS_ARENA_END ((uintptr_t)24 << 40)
#define VS_MAX_TRUSTLIST 4096
#define VS_FABRIC_SIZE 128
#define VS_SECRET_SIZE 32
#define VS_KEY_BUFFER 65      /* an IPC key buffer holds at least this many characters */
#define VS_KEY_CHARS 24       /* an IPC key: 16 hex digits of the handle, 8 of the server id */
#define VS_IPC_MAX_PIDS 31    /* pids in one aclrtIpcMemSetImportPid */
#define VS_MAX_DEVICES 1024

/* Who holds an allocation or a range: the VMM calls, an aclrtMalloc block, or an IPC import. */
enum vs_owner { VS_VMM = 0, VS_MALLOC = 1, VS_IPC = 2 };

typedef struct vs_prop {
    uint32_t handle_type, allocation_type, mem_attr, loc_type;
    int64_t loc_id;
    uint64_t reserve;
} vs_prop;

/* Memory of another server (SPEC §8): where its node's transfer engine serves it (fabric.c). */
typedef struct vs_remote {
    int family;              /* AF_INET or AF_INET6 */
    uint8_t addr[16];        /* the engine's address: the FABRIC handle's endpoint address */
    uint16_t port;           /* where that engine takes transfers */
    uint64_t address;        /* the memory's address in that engine */
    uint64_t size;
    char where[64];          /* "address:port", for messages */
} vs_remote;

typedef struct vs_alloc {
    uint64_t handle;         /* the aclrtDrvMemHandle this process names it by */
    int fd;                  /* its memfd (-1 once closed, and for memory of another server) */
    vs_remote *remote;       /* memory of another server (no fd, never mapped: copies only), else NULL */
    size_t size;
    vs_prop prop;
    uint64_t token;          /* the broker connection's name for its hold (broker.c) */
    int refs;                /* handle references: malloc/import + each retain */
    int maps;                /* live mappings in this process */
    int pins;                /* imports of it under way, asking the broker again (it stays while any is) */
    uint64_t imported_from;  /* the shareable value it came from (0: made here) */
    bool exported;           /* exported once (a handle exports once) */
    bool export_live;        /* its export is still open to imports */
    uint64_t exported_value;
    bool in_imports;         /* the import table names it for `imported_from` */
    bool registered;         /* aclrtDrvMemHandle lookups find it (refs > 0, VMM-owned) */
    enum vs_owner owner;
    struct vs_gpu *gpu;      /* GPU memory under the CUDA backend (cuda.c); NULL: host memory (its memfd) */
    struct vs_alloc *next;
} vs_alloc;

typedef struct vs_range {
    uintptr_t base;
    size_t size;
    enum vs_owner owner;
    bool gpu;                /* GPU address space (cuda.c), not the host arena */
} vs_range;

typedef struct vs_access {
    uint32_t loc_type;
    int64_t loc_id;
    uint64_t flags;
} vs_access;

typedef struct vs_mapping {
    uintptr_t ptr;
    size_t size;
    vs_alloc *alloc;
    uint64_t effective;      /* the flags in force */
    vs_access *access;       /* flags set per location (aclrtMemSetAccess) */
    size_t naccess;
} vs_mapping;

typedef struct vs_block {    /* an aclrtMalloc block or an IPC import, by pointer */
    uintptr_t ptr;
    size_t size;             /* what the caller asked for */
    vs_alloc *alloc;
} vs_block;

typedef struct vs_hostblock {
    uintptr_t ptr;
    size_t size;
} vs_hostblock;

typedef struct vs_ipc_export {
    uint64_t value;
    vs_alloc *alloc;
    bool pid_validation;
    int refs;
} vs_ipc_export;

typedef struct vs_ipc_import {
    uint64_t value;
    uintptr_t ptr;
    int count;
} vs_ipc_import;

/* An error a helper returns to its caller, which adds the call's name (vs_raise). */
typedef struct vs_err {
    aclError code;
    char message[640];
} vs_err;

/* Work queued on a stream: run by its worker thread in order (a failure is kept for synchronize). */
typedef struct vs_task {
    aclError (*run)(void *arg, vs_err *err); /* 0 or a code (its message in err) */
    void (*drop)(void *arg);                 /* frees `arg` (after run, or instead of it when dropped) */
    void *arg;
    const char *what;
    bool always;             /* runs even behind a failure (a record: waiters elsewhere wait for it) */
    struct vs_task *next;
} vs_task;

typedef struct vs_stream {
    uint64_t handle;
    uint64_t context;
    int device;
    pthread_mutex_t m;       /* over everything below */
    pthread_cond_t cv;
    vs_task *head, *tail;
    bool running, closed, aborted, has_thread;
    pthread_t thread;
    int failed;              /* the first failure of work queued on it, reported by synchronize */
    int skipped;             /* tasks queued behind it that did not run */
    char message[512];
    void *waiting;           /* the sync page a task of it is blocked on (kicked by a forced destroy) */
} vs_stream;

typedef struct vs_context {
    uint64_t handle;
    int device;
    bool is_default;
    vs_stream *stream;       /* its default stream (stream 0), made on first use */
} vs_context;

/* A growable array of fixed-size records. */
typedef struct vs_vec {
    void *items;
    size_t count, cap, size;
} vs_vec;

typedef struct vs_config {
    int devices;
    uint64_t device_memory;
    char socket[108];
    uint32_t server_id;
    bool prepopulate;
    long spin_us;            /* VMMSHARE_SPIN_US: how long a request polls for its reply before it sleeps */
    bool cuda;               /* VMMSHARE_BACKEND=cuda (or auto, where a GPU is usable: cuda.c decides) */
    bool cuda_auto;          /* VMMSHARE_BACKEND=auto: without a usable GPU, device memory is host memory */
    double fabric_timeout;   /* VMMSHARE_FABRIC_TIMEOUT: seconds a copy across servers may make no progress */
    long broker_user;        /* -1: none */
    int visible[VS_MAX_DEVICES];
    int nvisible;            /* -1: ASCEND_RT_VISIBLE_DEVICES unset */
    char visible_text[160];
    char visible_error[96];
    char error[512];         /* a variable that cannot be used: every call fails with this (107000) */
} vs_config;

typedef struct vs_runtime {
    pthread_mutex_t lock;    /* recursive: over every table */
    vs_config config;
    bool initialized;        /* aclInit called, aclFinalize not yet */
    uint64_t next_handle;
    uint64_t next_id;
    vs_alloc *allocs;        /* every live allocation (with or without a handle) */
    vs_vec reservations;     /* vs_range, by base */
    vs_vec mappings;         /* vs_mapping, by ptr */
    vs_vec blocks;           /* vs_block */
    vs_vec host_blocks;      /* vs_hostblock */
    vs_vec registered;       /* vs_hostblock: host ranges registered for the device (aclrtHostRegister) */
    vs_vec ipc_exports;      /* vs_ipc_export */
    vs_vec ipc_imports;      /* vs_ipc_import */
    vs_vec ipc_attrs;        /* keys (value, server) with an attribute set */
    vs_vec contexts;         /* vs_context * */
    vs_vec streams;          /* vs_stream * */
    int device_refs[VS_MAX_DEVICES];
    pthread_mutex_t import_lock; /* one import of a handle at a time (rule 13's shared import) */
} vs_runtime;

extern vs_runtime vs_rt;

/* ---------------------------------------------------------------- errors.c */

/* Record `code` and a message ("<call>: <text>") for this thread; returns `code`. */
aclError vs_fail(aclError code, const char *call, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
aclError vs_set(vs_err *err, aclError code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
aclError vs_raise(const vs_err *err, const char *call);

/* Every call starts with START (the runtime set up, its configuration usable: else the call fails with its error)
 * and makes the acl layer's checks with ACL_REQUIRE (100000). */
#define START(call)                                  \
    vs_err err;                                      \
    if (vs_start(&err) != ACL_SUCCESS)               \
        return vs_raise(&err, call);

#define ACL_REQUIRE(ok, call, ...)                                        \
    do {                                                                  \
        if (!(ok))                                                        \
            return vs_fail(ACL_ERROR_INVALID_PARAM, call, __VA_ARGS__);   \
    } while (0)

/* ---------------------------------------------------------------- runtime.c */

/* config.c: read the variables into `c`; -1 when one cannot be used (its message in c->error). */
int vs_read_config(vs_config *c);
void vs_read_visible(vs_config *c); /* ASCEND_RT_VISIBLE_DEVICES over c->devices */

/* The runtime, set up on first use (the configuration read); 0 or the configuration's error. */
aclError vs_start(vs_err *err);
double vs_now(void); /* seconds on the monotonic clock */
void vs_lock(void);
void vs_unlock(void);
void *vs_vec_push(vs_vec *v, size_t size);
void vs_vec_remove(vs_vec *v, size_t index);
#define VS_AT(vec, type, i) (((type *)(vec).items)[i])

vs_range *vs_reservation_at(uintptr_t ptr);
vs_range *vs_reservation_exact(uintptr_t ptr);
vs_mapping *vs_mapping_at(uintptr_t ptr);
vs_mapping *vs_mapping_exact(uintptr_t ptr);
bool vs_mappings_overlap(uintptr_t ptr, size_t size);
void vs_add_reservation(uintptr_t base, size_t size, enum vs_owner owner);
void vs_remove_reservation(uintptr_t base);
void vs_add_mapping(uintptr_t ptr, size_t size, vs_alloc *alloc, uint64_t access);
void vs_remove_mapping(uintptr_t ptr);

/* The arena (address space): reserve [size] bytes PROT_NONE, at `want` exactly when non-zero. */
int vs_arena_reserve(size_t size, size_t align, uintptr_t want, int fd, int prot, uintptr_t *out);
int vs_prot_of(uint64_t access);

/* Allocations. */
uint64_t vs_new_handle(void);
vs_alloc *vs_allocation(uint64_t handle);
aclError vs_make_alloc(vs_err *err, size_t size, const vs_prop *prop, enum vs_owner owner, vs_alloc **out);
void vs_register(vs_alloc *a);
void vs_drop(vs_alloc *a);          /* one handle reference fewer */
void vs_maybe_destroy(vs_alloc *a); /* gone when no handle, no mapping and no import under way holds it */
void vs_forget_exports(vs_alloc *a);

/* Properties and their checks (props.c); mappings shared by several calls (memory.c). */
size_t vs_prop_granularity(const vs_prop *p);
aclError vs_check_prop_acl(vs_err *err, const vs_prop *p, bool for_malloc);
aclError vs_check_prop_rt(vs_err *err, const vs_prop *p);
vs_prop vs_prop_from(const aclrtPhysicalMemProp *p);
uint32_t vs_reported_attr(const vs_prop *p); /* the attribute the runtime reports for it */
aclError vs_map_alloc(vs_err *err, uintptr_t ptr, size_t size, vs_alloc *a, uint64_t access);
aclError vs_map_new(vs_err *err, vs_alloc *a, uint64_t access, enum vs_owner owner, uintptr_t *out);
aclError vs_unmap_release(vs_err *err, uintptr_t ptr, enum vs_owner owner);

/* ---------------------------------------------------------------- device.c */

aclError vs_current_device(vs_err *err, int *device);   /* 107002 without a current context */
aclError vs_device_id(vs_err *err, int64_t device);     /* 107001 for a device this process does not see */
int vs_logical(int device);                             /* the node's number for a user device id */
vs_stream *vs_stream_of(vs_err *err, uint64_t stream, bool here);
vs_stream *vs_stream_new(uint64_t handle, uint64_t context, int device);
/* Queue a task (the lock held, so the stream is live); `arg` is the task's (dropped on failure to queue). */
aclError vs_stream_submit(vs_err *err, vs_stream *s, const char *what, aclError (*run)(void *, vs_err *),
                          void (*drop)(void *), void *arg, bool always);
/* Run a short task now if the stream is idle (it has reached this point), else queue it to run even behind a
 * failure: an event's or a notify's record. */
aclError vs_stream_run_or_submit(vs_err *err, vs_stream *s, const char *what, aclError (*run)(void *, vs_err *),
                                 void (*drop)(void *), void *arg);
/* Run ordinary work now if the stream is idle (skipped behind a failure), else queue it. */
aclError vs_stream_do(vs_err *err, vs_stream *s, const char *what, aclError (*run)(void *, vs_err *),
                      void (*drop)(void *), void *arg);
bool vs_stream_idle(vs_stream *s);
void vs_stream_close(vs_stream *s, bool force); /* wait for (or, forced, drop) its work; end its thread; free it */
/* Wait for its queued work (at most timeout_ms, -1: no limit), then report the first failure since the last time. */
aclError vs_stream_report(vs_stream *s, int32_t timeout_ms, const char *call);
void vs_sync_kick(void *page);                  /* sync.c: wake every waiter of a page to look again */
void vs_sync_after_fork(void);
void vs_devices_after_fork(void);

/* ---------------------------------------------------------------- broker.c (the node) */

aclError vs_node_charge(vs_err *err, int device, uint64_t size, uint64_t *token);
aclError vs_node_charge_gpu(vs_err *err, int device, uint64_t size, uint64_t *token); /* its exports say GPU */
void vs_node_release(uint64_t token);
aclError vs_node_mem_info(vs_err *err, int device, uint64_t *free_bytes, uint64_t *total);
aclError vs_node_export(vs_err *err, uint64_t token, int fd, const vs_prop *prop, uint64_t size, uint32_t flags,
                        uint32_t share_type, uint8_t *out, size_t *outlen);
aclError vs_node_revoke(vs_err *err, uint64_t token);
aclError vs_node_set_pids(vs_err *err, uint64_t shareable, uint32_t share_type, const uint32_t *pids, size_t n);
aclError vs_node_import(vs_err *err, uint64_t shareable, uint32_t share_type, const uint8_t *secret, int *fd,
                        uint64_t *token, uint64_t *size, vs_prop *prop, bool *gpu);
aclError vs_node_bare_tgid(vs_err *err, uint32_t *pid);
aclError vs_node_still_admitted(vs_err *err, uint64_t shareable, uint32_t share_type, const uint8_t *secret,
                                uint64_t *size);
aclError vs_node_set_remote_pids(vs_err *err, uint64_t shareable, uint32_t share_type, uint32_t server,
                                 const uint32_t *pids, size_t n);
aclError vs_node_remote_import(vs_err *err, const uint8_t *handle, uint64_t *token, uint64_t *size, vs_prop *prop,
                               uint64_t *address, uint16_t *data_port);
void vs_node_after_fork(void);
/* reach.c: a connection to a trusted broker at the configured socket, started when none answers. */
aclError vs_reach_broker(vs_err *err, int *fd);
void vs_node_prepare(void);

/* ---------------------------------------------------------------- sharing (share.c) and others */

aclError vs_export_alloc(vs_err *err, vs_alloc *a, uint32_t share_type, bool pid_validation, uint8_t *out,
                         size_t *outlen);
aclError vs_import_alloc(vs_err *err, uint64_t value, uint32_t share_type, const uint8_t *secret, int device,
                         enum vs_owner owner, size_t fabric_size, vs_alloc **out);
void vs_revoke_alloc(vs_alloc *a);
/* A trustlist argument: at most 4096 pids, each positive (the caller's checks of count 0 and NULL come first). */
aclError vs_read_pids(vs_err *err, const int32_t *pid, size_t n, uint32_t *out);
void vs_ipc_forget_block(vs_alloc *a);
aclError vs_free_block(vs_err *err, uintptr_t ptr, enum vs_owner owner);
aclError vs_map_block(vs_err *err, vs_alloc *a, size_t size, uintptr_t *out);

/* ranges.c: a copy's or fill's range, checked under the lock, as its parts: local ones (joined) and ones in memory
 * of another server (where it is served, and the offset there). */
enum { VS_SIDE_HOST = 1, VS_SIDE_DEVICE = 2 };
typedef struct vs_piece {
    size_t at, len;          /* where in the range */
    bool remote;
    vs_remote where;         /* (remote) where the memory is served: a copy of the import's record */
    uint64_t offset;         /* (remote) the offset in that memory */
} vs_piece;
typedef struct vs_pieces {
    vs_piece few[2];         /* most ranges need no more */
    vs_piece *p;
    size_t n, cap;
    bool remote;             /* a part is memory of another server */
} vs_pieces;
bool vs_process_range_ok(uintptr_t ptr, size_t size, bool write);
void vs_pieces_init(vs_pieces *ps);
void vs_pieces_free(vs_pieces *ps);
/* Check that [ptr, ptr+size) is memory this process may read (or write); `sides` collects whether host or device
 * memory is in it, `out` its parts. The lock is held. */
aclError vs_check_range(vs_err *err, uintptr_t ptr, size_t size, bool write, const char *what, int *sides,
                        vs_pieces *out);

/* copy.c */
aclError vs_memcpy(vs_err *err, void *dst, size_t destMax, const void *src, size_t count, int kind);

/* fabric.c: `count` bytes between local memory at `local` and `offset` of remote memory (write: local to remote);
 * 507022 naming the serving engine when it cannot be reached, stalls, or no longer serves the memory. */
aclError vs_fabric_move(vs_err *err, const vs_remote *r, uint64_t offset, void *local, size_t count, bool write);
void vs_fabric_forget(const vs_remote *r); /* its engine's idle connections go, when no import names it */
bool vs_engine_in_use(const vs_remote *r);  /* runtime.c: whether a live import names the engine (the lock held) */
void vs_fabric_after_fork(void);

/* sha.c */
void vs_sha256(const void *data, size_t n, uint8_t out[32]);
void vs_sha1(const void *data, size_t n, uint8_t out[20]);

#endif /* VMMSHARE_CLIB_VS_H */
