/*
 * What the synchronisation files share (syncpage.c: the shared page, the producers' watcher, waits; syncobjs.c:
 * the table of events and notifies; events.c; notifies.c). The page's layout and protocol are those of
 * docs/synchronisation.md.
 */
#ifndef VMMSHARE_CLIB_SYNC_H
#define VMMSHARE_CLIB_SYNC_H

#include "vs.h"

#define PAGE 4096
#define DEAD 0x80000000u
#define KICK 0x40000000u
#define STATE (KICK - 1)
#define HALF (1u << 29)
#define W_ISSUED 4
#define W_MAGIC 8
#define W_DEVICE 12
#define W_COUNT 20
#define HOLDERS 64
#define HOLDER_SIZE 24
#define MAX_HOLDERS 64
#define MAGIC_EVENT 0x45564E54u  /* "EVNT" */
#define MAGIC_NOTIFY 0x4E544659u /* "NTFY" */
#define MAX_PIDFDS 256

/* ---------------------------------------------------------------- who a process is */

typedef struct ident {
    uint32_t pid;
    uint64_t ns, start;
} ident;

typedef struct page {
    uint8_t *addr;
    int fd;                  /* its memfd (-1: a page of this process only) */
    uint64_t token;          /* the node's hold for it (0: none) */
    uint64_t value;          /* the broker's handle value, once exported or imported */
    bool exported, pid_validation;
    pthread_mutex_t *lock;   /* this process's lock of the file (shared by the pages of one file) */
    uint64_t id;             /* in the registry the watcher looks pages up in */
    uint32_t magic;
    ident watched[MAX_HOLDERS]; /* the producers this process last watched (under the lock) */
    int nwatched;
    int pins;                /* the watcher's uses (under the registry's lock) */
    bool closing;            /* closed while pinned: the last unpin finishes it */
} page;

typedef struct sync_obj {
    uint64_t handle;
    bool notify;
    uint32_t flags;          /* an event's creation flag */
    int device;              /* a notify's node device */
    page *pg;
    bool opened;             /* opened or imported from another process's */
    char key[32];            /* a notify's key, once exported */
    bool pid_validation;     /* a notify's export: with its trustlist */
    int users;               /* waits and stream tasks using the page */
    bool destroyed;
} sync_obj;

typedef struct wait_arg {
    sync_obj *o;
    vs_stream *s;
    uint32_t target;
    double timeout;
    uint32_t seconds;
} wait_arg;

enum { READY, GONE, TIMEOUT, CANCELLED };

typedef bool (*ready_fn)(uint32_t w, uint32_t target);

ident sync_me(void);
volatile uint32_t *pg_word(page *p, int offset);
void pg_set(page *p, uint32_t v);      /* word 0, changed (under the lock) with every waiter woken */
uint32_t pg_get(page *p);
void pg_lock(page *p);
void pg_unlock(page *p);
int pg_holders(page *p, ident *out);
void pg_set_holders(page *p, const ident *list, int n);
void pg_add_holder(page *p, ident id);
bool pg_remove_holder(page *p, ident id);
bool sync_newer(uint32_t a, uint32_t b); /* 30-bit serial numbers */
int pg_wait(page *p, ready_fn ready, uint32_t target, double timeout, vs_stream *stream);
bool sync_event_ready(uint32_t w, uint32_t target);
bool sync_notify_ready(uint32_t w, uint32_t target);
aclError pg_create(vs_err *err, uint32_t magic, page **out);
aclError pg_private(vs_err *err, page **out);
aclError pg_export(vs_err *err, page *p, bool pid_validation);
aclError pg_open(vs_err *err, uint64_t value, uint32_t magic, page **out);
void pg_close(page *p);               /* unmaps it and lets the node's hold go */

aclError so_not_live(vs_err *err, uint64_t handle, bool notify);
sync_obj *so_add(sync_obj *o);
sync_obj *so_use(vs_err *err, uint64_t handle, bool notify);
void so_unuse(void *arg);
aclError so_destroy(vs_err *err, uint64_t handle, bool notify);
void so_drop_wait(void *arg);
void so_opened(uint64_t value);
void so_lock(void);
void so_unlock(void);
vs_stream *sync_stream_here(vs_err *err, aclrtStream stream);
void so_after_fork(void);
sync_obj *so_use_on(vs_err *err, uint64_t handle, bool notify, aclrtStream stream, vs_stream **s);
aclError sync_queue(vs_err *err, vs_stream *s, const char *call, aclError (*run)(void *, vs_err *), void (*drop)(void *),
                    void *arg, bool record);

#endif /* VMMSHARE_CLIB_SYNC_H */
