/*
 * Events and IPC events, notifies and IPC notifies: cross-process wake-ups on a page of shared memory, following
 * docs/synchronisation.md word for word, so a C and a Python process wait on and record the same event or notify.
 *
 * A page's word 0 is the futex word (bits 0-29 the state, bit 30 KICK, bit 31 DEAD); every change of it is made
 * under the page's lock (a lock per file in this process, then a POSIX record lock on byte 0 of the memfd) and
 * followed by a FUTEX_WAKE of every waiter. A waiter reads the word and sleeps in FUTEX_WAIT on what it read, so it
 * misses no change; nothing polls. The producers a waiter needs are watched by one thread per process, in poll(2)
 * on their pidfds: when the last one exits while a waiter still needs it, DEAD is set and waiters fail with 507057.
 */
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

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

static uint64_t start_time(uint32_t pid)
{
    char path[64], text[1024];
    snprintf(path, sizeof path, "/proc/%u/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, text, sizeof text - 1);
    close(fd);
    if (n <= 0)
        return 0;
    text[n] = '\0';
    char *p = strrchr(text, ')');
    if (p == NULL)
        return 0;
    p += 2; /* field 3 onwards: the start time is field 22 */
    for (int field = 3; field < 22 && p != NULL; field++) {
        p = strchr(p, ' ');
        if (p != NULL)
            p++;
    }
    return p != NULL ? strtoull(p, NULL, 10) : 0;
}

static ident me(void)
{
    ident i = {(uint32_t)getpid(), 0, 0};
    struct stat st;
    if (stat("/proc/self/ns/pid", &st) == 0)
        i.ns = st.st_ino;
    i.start = start_time(i.pid);
    return i;
}

static bool same(const ident *a, const ident *b)
{
    return a->pid == b->pid && a->ns == b->ns && a->start == b->start;
}

/* ---------------------------------------------------------------- the page */

typedef struct page {
    uint8_t *addr;
    int fd;                  /* its memfd (-1: a page of this process only) */
    uint64_t token;          /* the node's hold for it (0: none) */
    uint64_t value;          /* the broker's handle value, once exported or imported */
    bool exported, pid_validation;
    pthread_mutex_t *lock;   /* this process's lock of the file (shared by the pages of one file) */
    uint64_t id;             /* in the registry the watcher looks pages up in */
    uint32_t magic;
    ident watched[MAX_HOLDERS];
    int nwatched;
} page;

typedef struct file_lock {
    dev_t dev;
    ino_t ino;
    int users;
    pthread_mutex_t *m;
} file_lock;

static pthread_mutex_t registry = PTHREAD_MUTEX_INITIALIZER; /* the pages, the file locks */
static vs_vec pages = {NULL, 0, 0, sizeof(page *)};
static vs_vec file_locks = {NULL, 0, 0, sizeof(file_lock)};
static uint64_t next_page_id = 1;

static volatile uint32_t *word(page *p, int offset)
{
    return (volatile uint32_t *)(p->addr + offset);
}

static void wake(page *p)
{
    syscall(SYS_futex, p->addr, FUTEX_WAKE, 0x7FFFFFFF, NULL, NULL, 0);
}

/* Change word 0 (under the lock) and wake every waiter. */
static void set_word(page *p, uint32_t v)
{
    __atomic_store_n(word(p, 0), v, __ATOMIC_SEQ_CST);
    wake(p);
}

static uint32_t get_word(page *p)
{
    return __atomic_load_n(word(p, 0), __ATOMIC_SEQ_CST);
}

static void lock_page(page *p)
{
    pthread_mutex_lock(p->lock);
    if (p->fd >= 0) {
        struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
        while (fcntl(p->fd, F_SETLKW, &fl) != 0 && errno == EINTR)
            ;
    }
}

static void unlock_page(page *p)
{
    if (p->fd >= 0) {
        struct flock fl = {.l_type = F_UNLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
        fcntl(p->fd, F_SETLK, &fl);
    }
    pthread_mutex_unlock(p->lock);
}

/* A page over `addr` (mapped) and `fd` (-1: private), registered for the watcher. */
static page *page_new(uint8_t *addr, int fd)
{
    page *p = calloc(1, sizeof *p);
    if (p == NULL)
        return NULL;
    p->addr = addr;
    p->fd = fd;
    pthread_mutex_lock(&registry);
    struct stat st;
    file_lock *found = NULL;
    if (fd >= 0 && fstat(fd, &st) == 0)
        for (size_t i = 0; i < file_locks.count && found == NULL; i++) {
            file_lock *f = &VS_AT(file_locks, file_lock, i);
            if (f->dev == st.st_dev && f->ino == st.st_ino)
                found = f;
        }
    if (found == NULL) {
        pthread_mutex_t *m = malloc(sizeof *m);
        pthread_mutex_init(m, NULL);
        found = vs_vec_push(&file_locks, sizeof(file_lock));
        found->dev = fd >= 0 ? st.st_dev : 0;
        found->ino = fd >= 0 ? st.st_ino : (ino_t)(uintptr_t)p; /* a private page: a lock of its own */
        found->m = m;
    }
    found->users++;
    p->lock = found->m;
    p->id = next_page_id++;
    *(page **)vs_vec_push(&pages, sizeof(page *)) = p;
    pthread_mutex_unlock(&registry);
    return p;
}

/* Unmap and close a page and let the node's hold go (an exporter's release revokes its export). The fd is closed
 * under the file's lock: closing any fd of the file drops this process's record lock on it. */
static void page_close(page *p)
{
    pthread_mutex_lock(&registry);
    for (size_t i = 0; i < pages.count; i++)
        if (VS_AT(pages, page *, i) == p) {
            vs_vec_remove(&pages, i);
            break;
        }
    pthread_mutex_lock(p->lock);
    munmap(p->addr, PAGE);
    if (p->fd >= 0)
        close(p->fd);
    pthread_mutex_unlock(p->lock);
    for (size_t i = 0; i < file_locks.count; i++) {
        file_lock *f = &VS_AT(file_locks, file_lock, i);
        if (f->m == p->lock && --f->users == 0) {
            pthread_mutex_destroy(f->m);
            free(f->m);
            vs_vec_remove(&file_locks, i);
            break;
        }
    }
    pthread_mutex_unlock(&registry);
    if (p->token)
        vs_node_release(p->token);
    free(p);
}

void vs_sync_kick(void *pg)
{
    page *p = pg;
    lock_page(p);
    set_word(p, get_word(p) ^ KICK);
    unlock_page(p);
}

/* The producers' list (under the lock). */
static int holders(page *p, ident *out)
{
    uint32_t count = *word(p, W_COUNT);
    int n = 0;
    for (uint32_t i = 0; i < count && i < MAX_HOLDERS; i++) {
        uint8_t *e = p->addr + HOLDERS + i * HOLDER_SIZE;
        ident id;
        memcpy(&id.pid, e, 4);
        memcpy(&id.ns, e + 8, 8);
        memcpy(&id.start, e + 16, 8);
        if (id.pid)
            out[n++] = id;
    }
    return n;
}

static void set_holders(page *p, const ident *list, int n)
{
    int old = (int)*word(p, W_COUNT);
    if (old > MAX_HOLDERS)
        old = MAX_HOLDERS;
    if (n > MAX_HOLDERS) { /* the last ones kept */
        list += n - MAX_HOLDERS;
        n = MAX_HOLDERS;
    }
    for (int i = 0; i < (n > old ? n : old); i++) {
        uint8_t *e = p->addr + HOLDERS + i * HOLDER_SIZE;
        memset(e, 0, HOLDER_SIZE);
        if (i < n) {
            memcpy(e, &list[i].pid, 4);
            memcpy(e + 8, &list[i].ns, 8);
            memcpy(e + 16, &list[i].start, 8);
        }
    }
    *word(p, W_COUNT) = (uint32_t)n;
}

static void add_holder(page *p, ident id)
{
    ident have[MAX_HOLDERS + 1];
    int n = holders(p, have);
    for (int i = 0; i < n; i++)
        if (same(&have[i], &id))
            return;
    have[n++] = id;
    set_holders(p, have, n);
}

static bool remove_holder(page *p, ident id)
{
    ident have[MAX_HOLDERS];
    int n = holders(p, have), k = 0;
    bool found = false;
    for (int i = 0; i < n; i++) {
        if (same(&have[i], &id))
            found = true;
        else
            have[k++] = have[i];
    }
    if (found)
        set_holders(p, have, k);
    return found;
}

static bool newer(uint32_t a, uint32_t b)
{
    uint32_t d = (a - b) & STATE;
    return d > 0 && d < HALF;
}

/* Whether a waiter still needs a producer: an event's last record not completed; a notify not set. */
static bool pending(page *p)
{
    uint32_t w = get_word(p);
    if (p->magic == MAGIC_NOTIFY)
        return !(w & 1);
    return newer(*word(p, W_ISSUED), w & STATE);
}

/* `id` exited: off the list; if no producer is left while a waiter needs one, DEAD. (The registry lock held.) */
static void producer_died(page *p, ident id)
{
    lock_page(p);
    if (remove_holder(p, id)) {
        ident rest[MAX_HOLDERS];
        uint32_t w = get_word(p);
        if (holders(p, rest) == 0 && !(w & DEAD) && pending(p))
            set_word(p, w | DEAD);
    }
    unlock_page(p);
}

/* ---------------------------------------------------------------- the watcher */

typedef struct watched {
    ident id;
    int pidfd;
    vs_vec pages; /* uint64_t: the ids of the pages it is a producer of */
    uint64_t used;
} watched;

static pthread_mutex_t watch_lock = PTHREAD_MUTEX_INITIALIZER;
static vs_vec watching = {NULL, 0, 0, sizeof(watched)};
static int watch_efd = -1;
static bool watch_thread;
static uint64_t watch_clock;

static void died(const ident *id, const vs_vec *ids)
{
    pthread_mutex_lock(&registry);
    for (size_t k = 0; k < ids->count; k++)
        for (size_t i = 0; i < pages.count; i++) {
            page *p = VS_AT(pages, page *, i);
            if (p->id == VS_AT(*ids, uint64_t, k))
                producer_died(p, *id);
        }
    pthread_mutex_unlock(&registry);
}

static void *watch_run(void *unused)
{
    (void)unused;
    for (;;) {
        struct pollfd fds[MAX_PIDFDS + 1];
        pthread_mutex_lock(&watch_lock);
        fds[0].fd = watch_efd;
        fds[0].events = POLLIN;
        int n = 1;
        for (size_t i = 0; i < watching.count; i++) {
            fds[n].fd = VS_AT(watching, watched, i).pidfd;
            fds[n].events = POLLIN;
            n++;
        }
        pthread_mutex_unlock(&watch_lock);
        if (poll(fds, (nfds_t)n, -1) < 0)
            continue;
        if (fds[0].revents) {
            uint64_t v;
            if (read(watch_efd, &v, sizeof v) < 0)
                (void)0; /* (nothing to read: another wake-up took it) */
        }
        for (int k = 1; k < n; k++) {
            if (!fds[k].revents)
                continue;
            pthread_mutex_lock(&watch_lock);
            watched gone = {0};
            bool found = false;
            for (size_t i = 0; i < watching.count; i++)
                if (VS_AT(watching, watched, i).pidfd == fds[k].fd) {
                    gone = VS_AT(watching, watched, i);
                    vs_vec_remove(&watching, i);
                    found = true;
                    break;
                }
            pthread_mutex_unlock(&watch_lock);
            if (!found)
                continue;
            close(gone.pidfd);
            died(&gone.id, &gone.pages);
            free(gone.pages.items);
        }
    }
    return NULL;
}

/* Watch `ids` as producers of `p` (this process, and processes of another pid namespace, are not watched); one
 * found gone already is reported at once. */
static void watch(page *p, const ident *ids, int n)
{
    ident mine = me();
    ident gone[MAX_HOLDERS];
    int ngone = 0;
    bool changed = false;
    pthread_mutex_lock(&watch_lock);
    if (watch_efd < 0)
        watch_efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    for (int k = 0; k < n; k++) {
        if (same(&ids[k], &mine) || ids[k].ns != mine.ns)
            continue;
        watched *w = NULL;
        for (size_t i = 0; i < watching.count && w == NULL; i++)
            if (same(&VS_AT(watching, watched, i).id, &ids[k]))
                w = &VS_AT(watching, watched, i);
        if (w == NULL) {
            int fd = (int)syscall(SYS_pidfd_open, ids[k].pid, 0);
            if (fd < 0) {
                if (errno == ESRCH)
                    gone[ngone++] = ids[k];
                continue; /* (no pidfd_open here: its waiters wait as the runtime's do) */
            }
            if (start_time(ids[k].pid) != ids[k].start) { /* the pid names another process now */
                close(fd);
                gone[ngone++] = ids[k];
                continue;
            }
            if (watching.count >= MAX_PIDFDS) { /* the least recently asked for goes */
                size_t oldest = 0;
                for (size_t i = 1; i < watching.count; i++)
                    if (VS_AT(watching, watched, i).used < VS_AT(watching, watched, oldest).used)
                        oldest = i;
                close(VS_AT(watching, watched, oldest).pidfd);
                free(VS_AT(watching, watched, oldest).pages.items);
                vs_vec_remove(&watching, oldest);
            }
            w = vs_vec_push(&watching, sizeof(watched));
            w->id = ids[k];
            w->pidfd = fd;
            w->pages.size = sizeof(uint64_t);
            changed = true;
        }
        w->used = ++watch_clock;
        bool has = false;
        for (size_t i = 0; i < w->pages.count; i++)
            has |= VS_AT(w->pages, uint64_t, i) == p->id;
        if (!has)
            *(uint64_t *)vs_vec_push(&w->pages, sizeof(uint64_t)) = p->id;
    }
    if (!watch_thread) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        watch_thread = pthread_create(&t, &attr, watch_run, NULL) == 0;
        pthread_attr_destroy(&attr);
    }
    pthread_mutex_unlock(&watch_lock);
    if (changed && watch_efd >= 0) {
        uint64_t one = 1;
        if (write(watch_efd, &one, sizeof one) < 0)
            (void)0; /* (the counter is full: the thread is awake anyway) */
    }
    if (ngone) {
        pthread_mutex_lock(&registry);
        for (int k = 0; k < ngone; k++)
            producer_died(p, gone[k]);
        pthread_mutex_unlock(&registry);
    }
}

/* ---------------------------------------------------------------- waiting */

enum { READY, GONE, TIMEOUT, CANCELLED };

typedef bool (*ready_fn)(uint32_t w, uint32_t target);

static bool event_ready(uint32_t w, uint32_t target)
{
    return !newer(target, w & STATE);
}

static bool notify_ready(uint32_t w, uint32_t target)
{
    (void)target;
    return (w & 1) != 0;
}

/* Wait until ready(word): READY, GONE (DEAD set first), TIMEOUT or CANCELLED (the stream destroyed by force). */
static int page_wait(page *p, ready_fn ready, uint32_t target, double timeout, vs_stream *stream)
{
    struct timespec start;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        uint32_t w = get_word(p);
        if (ready(w, target))
            return READY;
        if (w & DEAD)
            return GONE;
        if (stream != NULL) {
            pthread_mutex_lock(&stream->m);
            bool aborted = stream->aborted;
            pthread_mutex_unlock(&stream->m);
            if (aborted)
                return CANCELLED;
        }
        if (p->fd >= 0) {
            ident now[MAX_HOLDERS];
            lock_page(p);
            int n = holders(p, now);
            unlock_page(p);
            if (n != p->nwatched || memcmp(now, p->watched, sizeof(ident) * (size_t)n) != 0) {
                memcpy(p->watched, now, sizeof(ident) * (size_t)n);
                p->nwatched = n;
                watch(p, now, n);
                continue; /* a producer found gone already set DEAD: read the word again */
            }
        }
        struct timespec ts, *left = NULL;
        if (timeout >= 0) {
            struct timespec t;
            clock_gettime(CLOCK_MONOTONIC, &t);
            double rest = timeout - ((double)(t.tv_sec - start.tv_sec) + (double)(t.tv_nsec - start.tv_nsec) / 1e9);
            if (rest <= 0)
                return TIMEOUT;
            ts.tv_sec = (time_t)rest;
            ts.tv_nsec = (long)((rest - (double)ts.tv_sec) * 1e9);
            left = &ts;
        }
        syscall(SYS_futex, p->addr, FUTEX_WAIT, w, left, NULL, 0);
    }
}

/* ---------------------------------------------------------------- the shared page and the broker */

static const vs_prop PAGE_PROP = {ACL_MEM_HANDLE_TYPE_NONE, ACL_MEM_ALLOCATION_TYPE_PINNED, ACL_MEM_NORMAL,
                                  ACL_MEM_LOCATION_TYPE_HOST, 0, 0};

/* A fresh shared page, charged to the node's host memory, with `magic` in its kind word. */
static aclError page_create(vs_err *err, uint32_t magic, page **out)
{
    uint64_t token;
    if (vs_node_charge(err, -1, PAGE, &token))
        return err->code;
    int fd = memfd_create("vmmshare:sync", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    void *addr = MAP_FAILED;
    if (fd >= 0 && ftruncate(fd, PAGE) == 0 &&
        fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) == 0)
        addr = mmap(NULL, PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    page *p = addr != MAP_FAILED ? page_new(addr, fd) : NULL;
    if (p == NULL) {
        int e = errno;
        if (addr != MAP_FAILED)
            munmap(addr, PAGE);
        if (fd >= 0)
            close(fd);
        vs_node_release(token);
        return vs_set(err, ACL_ERROR_RT_MEMORY_ALLOCATION, "cannot make a shared page: %s", strerror(e));
    }
    p->token = token;
    p->magic = magic;
    *word(p, W_MAGIC) = magic;
    *out = p;
    return ACL_SUCCESS;
}

static aclError page_private(vs_err *err, page **out)
{
    void *addr = mmap(NULL, PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    page *p = addr != MAP_FAILED ? page_new(addr, -1) : NULL;
    if (p == NULL) {
        if (addr != MAP_FAILED)
            munmap(addr, PAGE);
        return vs_set(err, ACL_ERROR_RT_MEMORY_ALLOCATION, "cannot make a page: %s", strerror(errno));
    }
    p->magic = MAGIC_EVENT;
    *out = p;
    return ACL_SUCCESS;
}

static aclError page_export(vs_err *err, page *p, bool pid_validation)
{
    uint8_t out[VS_FABRIC_SIZE];
    size_t n;
    aclError rc = vs_node_export(err, p->token, p->fd, &PAGE_PROP, PAGE, pid_validation ? 0 : 1,
                                 ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, out, &n);
    if (rc)
        return rc;
    if (n != 8)
        return vs_set(err, ACL_ERROR_RT_IPC_ERROR, "bad reply from the broker: a %zu-byte handle", n);
    memcpy(&p->value, out, 8);
    p->exported = true;
    p->pid_validation = pid_validation;
    return ACL_SUCCESS;
}

/* Import the page the broker knows as `value` (107017 revoked, 207006 untrusted); 107017 for memory that is not a
 * page of `magic`'s kind. */
static aclError page_open(vs_err *err, uint64_t value, uint32_t magic, page **out)
{
    int fd;
    uint64_t token, size;
    vs_prop prop;
    bool gpu;
    aclError rc = vs_node_import(err, value, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, NULL, &fd, &token, &size, &prop, &gpu);
    if (rc)
        return rc;
    const char *kind = magic == MAGIC_EVENT ? "an IPC event" : "an IPC notify";
    void *addr = size == PAGE && !gpu ? mmap(NULL, PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    uint32_t got = addr != MAP_FAILED ? *(volatile uint32_t *)((uint8_t *)addr + W_MAGIC) : 0;
    if (addr == MAP_FAILED || got != magic) {
        if (addr != MAP_FAILED)
            munmap(addr, PAGE);
        close(fd);
        vs_node_release(token);
        return vs_set(err, ACL_ERROR_RT_INVALID_HANDLE, "handle %#llx names %s, not %s", (unsigned long long)value,
                      got == MAGIC_EVENT ? "an IPC event" : got == MAGIC_NOTIFY ? "an IPC notify"
                                                                                : "memory of another kind", kind);
    }
    page *p = page_new(addr, fd);
    if (p == NULL) {
        munmap(addr, PAGE);
        close(fd);
        vs_node_release(token);
        return vs_set(err, ACL_ERROR_RT_MEMORY_ALLOCATION, "out of memory");
    }
    p->token = token;
    p->value = value;
    p->magic = magic;
    *out = p;
    return ACL_SUCCESS;
}

/* ---------------------------------------------------------------- the table of events and notifies */

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

static pthread_mutex_t objs_lock = PTHREAD_MUTEX_INITIALIZER;
static vs_vec objs = {NULL, 0, 0, sizeof(sync_obj *)};
static uint64_t next_event = 1, next_notify = 1;
static vs_vec opens = {NULL, 0, 0, sizeof(uint64_t) * 2}; /* (value, imports here) of notify keys */

static sync_obj *find(uint64_t handle, bool notify)
{
    for (size_t i = 0; i < objs.count; i++) {
        sync_obj *o = VS_AT(objs, sync_obj *, i);
        if (o->handle == handle && o->notify == notify)
            return o;
    }
    return NULL;
}

static aclError not_live(vs_err *err, uint64_t handle, bool notify)
{
    return vs_set(err, ACL_ERROR_RT_INVALID_HANDLE, "%s %#llx is not a live %s of this process (destroyed, or a "
                  "handle of another kind)", notify ? "notify" : "event", (unsigned long long)handle,
                  notify ? "notify" : "event");
}

static sync_obj *add(sync_obj *o)
{
    pthread_mutex_lock(&objs_lock);
    o->handle = o->notify ? 0x4E000000ULL + next_notify++ : 0xE7000000ULL + next_event++;
    *(sync_obj **)vs_vec_push(&objs, sizeof(sync_obj *)) = o;
    pthread_mutex_unlock(&objs_lock);
    return o;
}

static sync_obj *use(vs_err *err, uint64_t handle, bool notify)
{
    pthread_mutex_lock(&objs_lock);
    sync_obj *o = find(handle, notify);
    if (o != NULL)
        o->users++;
    else
        not_live(err, handle, notify);
    pthread_mutex_unlock(&objs_lock);
    return o;
}

static void unuse(void *arg)
{
    sync_obj *o = arg;
    pthread_mutex_lock(&objs_lock);
    bool done = --o->users == 0 && o->destroyed;
    pthread_mutex_unlock(&objs_lock);
    if (done) {
        page_close(o->pg);
        free(o);
    }
}

/* Forget a handle; its page goes once no wait or task uses it. */
static aclError destroy(vs_err *err, uint64_t handle, bool notify)
{
    pthread_mutex_lock(&objs_lock);
    sync_obj *o = find(handle, notify);
    if (o == NULL) {
        pthread_mutex_unlock(&objs_lock);
        return not_live(err, handle, notify);
    }
    for (size_t i = 0; i < objs.count; i++)
        if (VS_AT(objs, sync_obj *, i) == o) {
            vs_vec_remove(&objs, i);
            break;
        }
    o->destroyed = true;
    bool last_open = false;
    if (o->notify && o->opened)
        for (size_t i = 0; i < opens.count; i++) {
            uint64_t *e = (uint64_t *)opens.items + 2 * i;
            if (e[0] == o->pg->value) {
                last_open = --e[1] == 0;
                if (last_open)
                    vs_vec_remove(&opens, i);
                break;
            }
        }
    bool done = o->users == 0;
    pthread_mutex_unlock(&objs_lock);
    if (last_open) { /* no longer one of its producers */
        lock_page(o->pg);
        remove_holder(o->pg, me());
        unlock_page(o->pg);
    }
    if (done) {
        page_close(o->pg);
        free(o);
    }
    return ACL_SUCCESS;
}

/* The stream a record or wait goes on: `stream` (0: the default one) of the current context. */
static vs_stream *stream_here(vs_err *err, aclrtStream stream)
{
    int device;
    if (vs_current_device(err, &device))
        return NULL;
    vs_lock();
    vs_stream *s = vs_stream_of(err, (uintptr_t)stream, true);
    vs_unlock();
    return s;
}

/* ---------------------------------------------------------------- events */

#define EX_FLAGS (ACL_EVENT_SYNC | 0x2u | 0x4u | ACL_EVENT_TIME_LINE | ACL_EVENT_IPC)
#define PLAIN_FLAGS (ACL_EVENT_SYNC | 0x2u | 0x4u | ACL_EVENT_TIME_LINE | 0x10u | 0x20u)
#define DEFAULT_FLAGS 0x0Eu

static aclError create_event(aclrtEvent *event, uint32_t flags, bool ex, const char *call)
{
    START(call);
    ACL_REQUIRE(event != NULL, call, "event is NULL");
    const uint32_t alone[] = {0x10u, 0x20u, ACL_EVENT_IPC};
    for (int i = 0; i < 3; i++)
        if ((flags & alone[i]) && (flags & ~alone[i]))
            return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "flag=%#x: %#x must be used alone", flags, alone[i]);
    uint32_t allowed = ex ? EX_FLAGS : PLAIN_FLAGS;
    if (!(flags & allowed) || flags > allowed)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, ex ? "flag=%#x: use ACL_EVENT_SYNC, CAPTURE_STREAM_PROGRESS "
                       "and TIME_LINE combined, or ACL_EVENT_IPC (0x40) alone" : "flag=%#x: use ACL_EVENT_SYNC, "
                       "CAPTURE_STREAM_PROGRESS and TIME_LINE combined (aclrtCreateEventExWithFlag takes "
                       "ACL_EVENT_IPC)", flags);
    if (flags == 0x10u || flags == 0x20u)
        return vs_fail(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, call, "flag=%#x: vmmshare has no device-only or "
                       "graph-external events (no kernels or ACL graphs run here)", flags);
    int device;
    if (vs_current_device(&err, &device))
        return vs_raise(&err, call);
    sync_obj *o = calloc(1, sizeof *o);
    if (o == NULL)
        return vs_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call, "out of memory");
    aclError rc = flags == ACL_EVENT_IPC ? page_create(&err, MAGIC_EVENT, &o->pg) : page_private(&err, &o->pg);
    if (rc) {
        free(o);
        return vs_raise(&err, call);
    }
    o->flags = flags;
    o->device = device;
    *event = (aclrtEvent)(uintptr_t)add(o)->handle;
    return ACL_SUCCESS;
}

VS_API aclError aclrtCreateEvent(aclrtEvent *event)
{
    return create_event(event, DEFAULT_FLAGS, false, "aclrtCreateEvent");
}

VS_API aclError aclrtCreateEventWithFlag(aclrtEvent *event, uint32_t flag)
{
    return create_event(event, flag, false, "aclrtCreateEventWithFlag");
}

VS_API aclError aclrtCreateEventExWithFlag(aclrtEvent *event, uint32_t flag)
{
    return create_event(event, flag, true, "aclrtCreateEventExWithFlag");
}

VS_API aclError aclrtDestroyEvent(aclrtEvent event)
{
    const char *call = "aclrtDestroyEvent";
    START(call);
    ACL_REQUIRE(event != NULL, call, "event is NULL");
    return destroy(&err, (uintptr_t)event, false) ? vs_raise(&err, call) : ACL_SUCCESS;
}

typedef struct record_arg {
    sync_obj *o;
    uint32_t ticket;
} record_arg;

/* The stream reached the record: the state becomes its ticket, unless a newer one completed first. */
static aclError complete_record(void *arg, vs_err *err)
{
    (void)err;
    record_arg *r = arg;
    page *p = r->o->pg;
    lock_page(p);
    uint32_t w = get_word(p);
    if (newer(r->ticket, w & STATE))
        set_word(p, r->ticket | (w & ~(STATE | DEAD)));
    unlock_page(p);
    return ACL_SUCCESS;
}

static void drop_record(void *arg)
{
    record_arg *r = arg;
    unuse(r->o);
    free(r);
}

VS_API aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream)
{
    const char *call = "aclrtRecordEvent";
    START(call);
    ACL_REQUIRE(event != NULL, call, "event is NULL");
    vs_stream *s = stream_here(&err, stream);
    if (s == NULL)
        return vs_raise(&err, call);
    sync_obj *o = use(&err, (uintptr_t)event, false);
    if (o == NULL)
        return vs_raise(&err, call);
    record_arg *r = malloc(sizeof *r);
    if (r == NULL) {
        unuse(o);
        return vs_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call, "out of memory");
    }
    page *p = o->pg;
    lock_page(p); /* the next ticket, now; this process the producer; a DEAD left by an earlier record cleared */
    uint32_t ticket = (*word(p, W_ISSUED) % STATE) + 1;
    *word(p, W_ISSUED) = ticket;
    if (p->fd >= 0) {
        ident mine = me();
        set_holders(p, &mine, 1);
    }
    uint32_t w = get_word(p);
    if (w & DEAD)
        set_word(p, w & ~DEAD);
    unlock_page(p);
    r->o = o;
    r->ticket = ticket;
    vs_lock(); /* (the stream stays in its table while it is queued to) */
    aclError rc = vs_stream_run_or_submit(&err, s, "aclrtRecordEvent", complete_record, drop_record, r);
    vs_unlock();
    return rc ? vs_raise(&err, call) : ACL_SUCCESS;
}

VS_API aclError aclrtQueryEventStatus(aclrtEvent event, aclrtEventRecordedStatus *status)
{
    const char *call = "aclrtQueryEventStatus";
    START(call);
    ACL_REQUIRE(event != NULL, call, "event is NULL");
    ACL_REQUIRE(status != NULL, call, "status is NULL");
    sync_obj *o = use(&err, (uintptr_t)event, false);
    if (o == NULL)
        return vs_raise(&err, call);
    bool busy = newer(*word(o->pg, W_ISSUED), get_word(o->pg) & STATE);
    unuse(o);
    *status = busy ? ACL_EVENT_RECORDED_STATUS_NOT_READY : ACL_EVENT_RECORDED_STATUS_COMPLETE;
    return ACL_SUCCESS;
}

static aclError wait_failed(vs_err *err, int got, sync_obj *o, const char *what, double timeout)
{
    if (got == TIMEOUT)
        return vs_set(err, ACL_ERROR_RT_EVENT_SYNC_TIMEOUT, "event %#llx did not complete within %g s",
                      (unsigned long long)o->handle, timeout);
    if (got == GONE)
        return vs_set(err, ACL_ERROR_RT_SUSPECT_REMOTE_ERROR, "the process that recorded event %#llx last exited "
                      "before its stream reached the record: it will never complete", (unsigned long long)o->handle);
    if (got == CANCELLED)
        return vs_set(err, ACL_ERROR_RT_STREAM_ABORT, "%s of event %#llx: the stream was destroyed while it waited",
                      what, (unsigned long long)o->handle);
    return ACL_SUCCESS;
}

static aclError synchronize(aclrtEvent event, double timeout, const char *call)
{
    START(call);
    ACL_REQUIRE(event != NULL, call, "event is NULL");
    sync_obj *o = use(&err, (uintptr_t)event, false);
    if (o == NULL)
        return vs_raise(&err, call);
    uint32_t target = *word(o->pg, W_ISSUED);
    int got = page_wait(o->pg, event_ready, target, timeout, NULL);
    aclError rc = wait_failed(&err, got, o, "synchronize", timeout);
    unuse(o);
    return rc ? vs_raise(&err, call) : ACL_SUCCESS;
}

VS_API aclError aclrtSynchronizeEvent(aclrtEvent event)
{
    return synchronize(event, -1, "aclrtSynchronizeEvent");
}

VS_API aclError aclrtSynchronizeEventWithTimeout(aclrtEvent event, int32_t timeout)
{
    const char *call = "aclrtSynchronizeEventWithTimeout";
    if (timeout < -1)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "timeout=%d: must be in [-1, INT_MAX]", timeout);
    if (event == NULL)
        return vs_fail(ACL_ERROR_INVALID_PARAM, call, "event is NULL");
    if (timeout == 0)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                       "timeout=0: must be -1 (no limit) or a positive number of milliseconds");
    return synchronize(event, timeout == -1 ? -1 : timeout / 1000.0, call);
}

typedef struct wait_arg {
    sync_obj *o;
    vs_stream *s;
    uint32_t target;
    double timeout;
    uint32_t seconds;
} wait_arg;

static aclError stream_wait(void *arg, vs_err *err)
{
    wait_arg *a = arg;
    pthread_mutex_lock(&a->s->m);
    a->s->waiting = a->o->pg;
    pthread_mutex_unlock(&a->s->m);
    int got = page_wait(a->o->pg, event_ready, a->target, -1, a->s);
    pthread_mutex_lock(&a->s->m);
    a->s->waiting = NULL;
    pthread_mutex_unlock(&a->s->m);
    return wait_failed(err, got, a->o, "aclrtStreamWaitEvent", -1);
}

static void drop_wait(void *arg)
{
    wait_arg *a = arg;
    unuse(a->o);
    free(a);
}

VS_API aclError aclrtStreamWaitEvent(aclrtStream stream, aclrtEvent event)
{
    const char *call = "aclrtStreamWaitEvent";
    START(call);
    if (event == NULL)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "event is NULL");
    vs_stream *s = stream_here(&err, stream);
    if (s == NULL)
        return vs_raise(&err, call);
    sync_obj *o = use(&err, (uintptr_t)event, false);
    if (o == NULL)
        return vs_raise(&err, call);
    uint32_t target = *word(o->pg, W_ISSUED);
    if (!newer(target, get_word(o->pg) & STATE)) { /* nothing to wait for */
        unuse(o);
        return ACL_SUCCESS;
    }
    wait_arg *a = calloc(1, sizeof *a);
    if (a == NULL) {
        unuse(o);
        return vs_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call, "out of memory");
    }
    a->o = o;
    a->s = s;
    a->target = target;
    vs_lock();
    aclError rc = vs_stream_submit(&err, s, call, stream_wait, drop_wait, a, false);
    vs_unlock();
    return rc ? vs_raise(&err, call) : ACL_SUCCESS;
}

VS_API aclError aclrtIpcGetEventHandle(aclrtEvent event, aclrtIpcEventHandle *handle)
{
    const char *call = "aclrtIpcGetEventHandle";
    START(call);
    ACL_REQUIRE(event != NULL, call, "event is NULL");
    ACL_REQUIRE(handle != NULL, call, "handle is NULL");
    sync_obj *o = use(&err, (uintptr_t)event, false);
    if (o == NULL)
        return vs_raise(&err, call);
    aclError rc = ACL_SUCCESS;
    if (o->flags != ACL_EVENT_IPC)
        rc = vs_set(&err, ACL_ERROR_RT_PARAM_INVALID, "event %#llx was created with flag %#x: only an event of "
                    "aclrtCreateEventExWithFlag(ACL_EVENT_IPC) has an IPC handle", (unsigned long long)o->handle,
                    o->flags);
    pthread_mutex_lock(&objs_lock);
    if (rc == ACL_SUCCESS && !o->pg->exported)
        rc = page_export(&err, o->pg, false);
    pthread_mutex_unlock(&objs_lock);
    if (rc == ACL_SUCCESS) {
        memset(handle, 0, sizeof *handle);
        uint32_t server = vs_rt.config.server_id, magic = MAGIC_EVENT;
        memcpy(handle->reserved, &o->pg->value, 8);
        memcpy(handle->reserved + 8, &server, 4);
        memcpy(handle->reserved + 12, &magic, 4);
    }
    unuse(o);
    return rc ? vs_raise(&err, call) : ACL_SUCCESS;
}

VS_API aclError aclrtIpcOpenEventHandle(aclrtIpcEventHandle handle, aclrtEvent *event)
{
    const char *call = "aclrtIpcOpenEventHandle";
    START(call);
    ACL_REQUIRE(event != NULL, call, "event is NULL");
    uint64_t value;
    uint32_t server, magic;
    memcpy(&value, handle.reserved, 8);
    memcpy(&server, handle.reserved + 8, 4);
    memcpy(&magic, handle.reserved + 12, 4);
    bool zeros = true;
    for (size_t i = 16; i < ACL_IPC_EVENT_HANDLE_SIZE; i++)
        zeros &= handle.reserved[i] == 0;
    if (magic != MAGIC_EVENT || value == 0 || !zeros)
        return vs_fail(ACL_ERROR_RT_INVALID_HANDLE, call, "these 64 bytes are not an IPC event handle (pass what "
                       "aclrtIpcGetEventHandle gave)");
    if (server != vs_rt.config.server_id)
        return vs_fail(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, call, "this IPC event handle comes from server %#x: an IPC "
                       "event synchronises processes of one server", server);
    int device = 0;
    vs_current_device(&err, &device);
    sync_obj *o = calloc(1, sizeof *o);
    if (o == NULL)
        return vs_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call, "out of memory");
    if (page_open(&err, value, MAGIC_EVENT, &o->pg)) {
        free(o);
        return vs_raise(&err, call);
    }
    o->flags = ACL_EVENT_IPC;
    o->device = device;
    o->opened = true;
    *event = (aclrtEvent)(uintptr_t)add(o)->handle;
    return ACL_SUCCESS;
}

/* ---------------------------------------------------------------- notifies */

VS_API aclError aclrtCreateNotify(aclrtNotify *notify, uint64_t flag)
{
    const char *call = "aclrtCreateNotify";
    START(call);
    ACL_REQUIRE(notify != NULL, call, "notify is NULL");
    if (flag != ACL_NOTIFY_DEFAULT && flag != 1)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "flag=%#llx: use ACL_NOTIFY_DEFAULT (0) or "
                       "ACL_NOTIFY_DEVICE_USE_ONLY (1)", (unsigned long long)flag);
    int device;
    if (vs_current_device(&err, &device))
        return vs_raise(&err, call);
    sync_obj *o = calloc(1, sizeof *o);
    if (o == NULL)
        return vs_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call, "out of memory");
    if (page_create(&err, MAGIC_NOTIFY, &o->pg)) {
        free(o);
        return vs_raise(&err, call);
    }
    o->notify = true;
    o->device = vs_logical(device);
    *word(o->pg, W_DEVICE) = (uint32_t)o->device;
    o->pid_validation = true;
    *notify = (aclrtNotify)(uintptr_t)add(o)->handle;
    return ACL_SUCCESS;
}

VS_API aclError aclrtDestroyNotify(aclrtNotify notify)
{
    const char *call = "aclrtDestroyNotify";
    START(call);
    ACL_REQUIRE(notify != NULL, call, "notify is NULL");
    return destroy(&err, (uintptr_t)notify, true) ? vs_raise(&err, call) : ACL_SUCCESS;
}

static aclError set_flag(void *arg, vs_err *err)
{
    (void)err;
    sync_obj *o = arg;
    lock_page(o->pg);
    set_word(o->pg, (get_word(o->pg) | 1) & ~DEAD);
    unlock_page(o->pg);
    return ACL_SUCCESS;
}

VS_API aclError aclrtRecordNotify(aclrtNotify notify, aclrtStream stream)
{
    const char *call = "aclrtRecordNotify";
    START(call);
    ACL_REQUIRE(notify != NULL, call, "notify is NULL");
    vs_stream *s = stream_here(&err, stream);
    if (s == NULL)
        return vs_raise(&err, call);
    sync_obj *o = use(&err, (uintptr_t)notify, true);
    if (o == NULL)
        return vs_raise(&err, call);
    vs_lock();
    aclError rc = vs_stream_run_or_submit(&err, s, call, set_flag, unuse, o);
    vs_unlock();
    return rc ? vs_raise(&err, call) : ACL_SUCCESS;
}

static aclError wait_and_reset(void *arg, vs_err *err)
{
    wait_arg *a = arg;
    page *p = a->o->pg;
    pthread_mutex_lock(&a->s->m);
    a->s->waiting = p;
    pthread_mutex_unlock(&a->s->m);
    int got;
    for (;;) {
        got = page_wait(p, notify_ready, 0, a->timeout, a->s);
        if (got != READY)
            break;
        lock_page(p);
        uint32_t w = get_word(p);
        bool mine = (w & 1) != 0; /* this waiter takes the record (another may have taken it first) */
        if (mine)
            set_word(p, w & ~1u);
        unlock_page(p);
        if (mine)
            break;
    }
    pthread_mutex_lock(&a->s->m);
    a->s->waiting = NULL;
    pthread_mutex_unlock(&a->s->m);
    unsigned long long h = a->o->handle;
    if (got == TIMEOUT)
        return vs_set(err, ACL_ERROR_RT_WAIT_TIMEOUT, "notify %#llx was not recorded within %u s", h, a->seconds);
    if (got == GONE)
        return vs_set(err, ACL_ERROR_RT_SUSPECT_REMOTE_ERROR, "every process that imported notify %#llx exited before "
                      "recording it: it will never be recorded", h);
    if (got == CANCELLED)
        return vs_set(err, ACL_ERROR_RT_STREAM_ABORT, "the stream waiting on notify %#llx was destroyed", h);
    return ACL_SUCCESS;
}

VS_API aclError aclrtWaitAndResetNotify(aclrtNotify notify, aclrtStream stream, uint32_t timeout)
{
    const char *call = "aclrtWaitAndResetNotify";
    START(call);
    ACL_REQUIRE(notify != NULL, call, "notify is NULL");
    vs_stream *s = stream_here(&err, stream);
    if (s == NULL)
        return vs_raise(&err, call);
    int device = 0;
    vs_current_device(&err, &device);
    sync_obj *o = use(&err, (uintptr_t)notify, true);
    if (o == NULL)
        return vs_raise(&err, call);
    if (o->opened && vs_logical(device) != o->device) {
        int made = o->device;
        unuse(o);
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "notify %#llx was made on device %d: its wait must be "
                       "delivered there, not on device %d", (unsigned long long)(uintptr_t)notify, made,
                       vs_logical(device));
    }
    wait_arg *a = calloc(1, sizeof *a);
    if (a == NULL) {
        unuse(o);
        return vs_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call, "out of memory");
    }
    a->o = o;
    a->s = s;
    a->seconds = timeout;
    a->timeout = timeout == 0 || timeout == 0xFFFFFFFFu ? -1 : (double)timeout;
    vs_lock();
    aclError rc = vs_stream_submit(&err, s, call, wait_and_reset, drop_wait, a, false);
    vs_unlock();
    return rc ? vs_raise(&err, call) : ACL_SUCCESS;
}

VS_API aclError aclrtNotifyGetExportKey(aclrtNotify notify, char *key, size_t len, uint64_t flags)
{
    const char *call = "aclrtNotifyGetExportKey";
    START(call);
    if (len >= 1024)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "len=%zu: the key buffer is less than 1024 characters", len);
    ACL_REQUIRE(notify != NULL, call, "notify is NULL");
    ACL_REQUIRE(key != NULL, call, "key is NULL");
    sync_obj *o = use(&err, (uintptr_t)notify, true);
    if (o == NULL)
        return vs_raise(&err, call);
    aclError rc = ACL_SUCCESS;
    if (len == 0)
        rc = vs_set(&err, ACL_ERROR_RT_PARAM_INVALID, "len is 0");
    else if (flags != ACL_RT_NOTIFY_EXPORT_FLAG_DEFAULT && flags != ACL_RT_NOTIFY_EXPORT_FLAG_DISABLE_PID_VALIDATION)
        rc = vs_set(&err, ACL_ERROR_RT_PARAM_INVALID, "flags=%llu: use ACL_RT_NOTIFY_EXPORT_FLAG_DEFAULT (0) or "
                    "DISABLE_PID_VALIDATION (0x2)", (unsigned long long)flags);
    else if (o->opened)
        rc = vs_set(&err, ACL_ERROR_RT_PARAM_INVALID, "notify %#llx was imported: only the process that made it "
                    "exports it", (unsigned long long)o->handle);
    else if (len < VS_KEY_BUFFER)
        rc = vs_set(&err, ACL_ERROR_RT_PARAM_INVALID, "len=%zu: the key buffer must hold at least %d characters", len,
                    VS_KEY_BUFFER);
    bool validate = flags == ACL_RT_NOTIFY_EXPORT_FLAG_DEFAULT;
    pthread_mutex_lock(&objs_lock);
    if (rc == ACL_SUCCESS && o->key[0] && o->pid_validation != validate)
        rc = vs_set(&err, ACL_ERROR_RT_PARAM_INVALID, "notify %#llx is exported already with pid validation %s: its "
                    "key is %s", (unsigned long long)o->handle, o->pid_validation ? "on" : "off", o->key);
    if (rc == ACL_SUCCESS && !o->key[0]) {
        rc = page_export(&err, o->pg, validate);
        if (rc == ACL_SUCCESS) {
            o->pid_validation = validate;
            snprintf(o->key, sizeof o->key, "ntf%016llx%08x", (unsigned long long)o->pg->value,
                     vs_rt.config.server_id);
        }
    }
    if (rc == ACL_SUCCESS)
        snprintf(key, len, "%s", o->key);
    pthread_mutex_unlock(&objs_lock);
    unuse(o);
    return rc ? vs_raise(&err, call) : ACL_SUCCESS;
}

/* The notify `handle` this process exported, with a trustlist to set. */
static sync_obj *exported(vs_err *err, uint64_t handle)
{
    sync_obj *o = use(err, handle, true);
    if (o == NULL)
        return NULL;
    aclError rc = ACL_SUCCESS;
    if (o->opened)
        rc = vs_set(err, ACL_ERROR_RT_NO_PERMISSION, "notify %#llx was imported: only its exporter sets its trustlist",
                    (unsigned long long)handle);
    else if (!o->key[0])
        rc = vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "notify %#llx has no key yet: call aclrtNotifyGetExportKey first",
                    (unsigned long long)handle);
    else if (!o->pid_validation)
        rc = vs_set(err, ACL_ERROR_RT_NO_PERMISSION, "notify %#llx was exported with ACL_RT_NOTIFY_EXPORT_FLAG_"
                    "DISABLE_PID_VALIDATION: it has no trustlist to set", (unsigned long long)handle);
    if (rc) {
        unuse(o);
        return NULL;
    }
    return o;
}

VS_API aclError aclrtNotifySetImportPid(aclrtNotify notify, int32_t *pid, size_t num)
{
    const char *call = "aclrtNotifySetImportPid";
    START(call);
    ACL_REQUIRE(notify != NULL, call, "notify is NULL");
    ACL_REQUIRE(pid != NULL, call, "pid is NULL");
    if (num == 0)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "pid_list is empty");
    if (num > VS_MAX_TRUSTLIST)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "pid_list has %zu pids; at most %d per handle", num,
                       VS_MAX_TRUSTLIST);
    uint32_t pids[VS_MAX_TRUSTLIST];
    if (vs_read_pids(&err, pid, num, pids))
        return vs_raise(&err, call);
    sync_obj *o = exported(&err, (uintptr_t)notify);
    if (o == NULL)
        return vs_raise(&err, call);
    aclError rc = num > VS_IPC_MAX_PIDS
        ? vs_set(&err, ACL_ERROR_RT_PARAM_INVALID, "%zu pids in one call: at most %d; call again for more", num,
                 VS_IPC_MAX_PIDS)
        : vs_set_pids(&err, o->pg->value, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, pids, num);
    unuse(o);
    return rc ? vs_raise(&err, call) : ACL_SUCCESS;
}

VS_API aclError aclrtNotifySetImportPidInterServer(aclrtNotify notify, aclrtServerPid *serverPids, size_t num)
{
    const char *call = "aclrtNotifySetImportPidInterServer";
    START(call);
    if (notify == NULL)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "notify is NULL");
    if (serverPids == NULL || num == 0)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "server_pids is %s", serverPids == NULL ? "NULL" : "empty");
    for (size_t i = 0; i < num; i++) {
        if (serverPids[i].pid == NULL)
            return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "server_pids[%zu].pid is NULL", i);
        if (serverPids[i].num != 1)
            return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "server_pids[%zu].num is %zu: each entry names one pid",
                           i, serverPids[i].num);
        if (serverPids[i].pid[0] < 1)
            return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "server_pids[%zu].pid[0]=%d is out of range [1, %d]", i,
                           serverPids[i].pid[0], INT32_MAX);
    }
    sync_obj *o = exported(&err, (uintptr_t)notify);
    if (o == NULL)
        return vs_raise(&err, call);
    aclError rc = ACL_SUCCESS;
    for (size_t i = 0; i < num && rc == ACL_SUCCESS; i++) {
        uint32_t one = (uint32_t)serverPids[i].pid[0];
        if (serverPids[i].sdid != vs_rt.config.server_id)
            rc = vs_node_set_remote_pids(&err, o->pg->value, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, serverPids[i].sdid,
                                         &one, 1);
    }
    for (size_t i = 0; i < num && rc == ACL_SUCCESS; i++) {
        uint32_t one = (uint32_t)serverPids[i].pid[0];
        if (serverPids[i].sdid == vs_rt.config.server_id)
            rc = vs_set_pids(&err, o->pg->value, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, &one, 1);
    }
    unuse(o);
    return rc ? vs_raise(&err, call) : ACL_SUCCESS;
}

VS_API aclError aclrtNotifyImportByKey(aclrtNotify *notify, const char *key, uint64_t flags)
{
    const char *call = "aclrtNotifyImportByKey";
    START(call);
    ACL_REQUIRE(notify != NULL, call, "notify is NULL");
    ACL_REQUIRE(key != NULL, call, "key is NULL");
    if (flags & ~(uint64_t)(1 | ACL_RT_NOTIFY_IMPORT_FLAG_ENABLE_PEER_ACCESS))
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "flags=%#llx: use ACL_RT_NOTIFY_IMPORT_FLAG_DEFAULT (0) or "
                       "ENABLE_PEER_ACCESS (0x2)", (unsigned long long)flags);
    size_t n = strnlen(key, 81);
    bool ok = n == 27 && strncmp(key, "ntf", 3) == 0;
    for (size_t i = 3; ok && i < n; i++)
        ok = (key[i] >= '0' && key[i] <= '9') || (key[i] >= 'a' && key[i] <= 'f');
    uint64_t value = 0;
    uint32_t server = 0;
    if (ok) {
        char head[17];
        memcpy(head, key + 3, 16);
        head[16] = '\0';
        value = strtoull(head, NULL, 16);
        server = (uint32_t)strtoul(key + 19, NULL, 16);
        ok = value != 0;
    }
    if (!ok)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "'%.77s%s' is not a notify key (what "
                       "aclrtNotifyGetExportKey gave)", key, n > 80 ? "..." : "");
    if (server != vs_rt.config.server_id)
        return vs_fail(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, call, "this notify key comes from server %#x, not this one "
                       "(%#x): a notify key names a notify of the server that made it", server,
                       vs_rt.config.server_id);
    sync_obj *o = calloc(1, sizeof *o);
    if (o == NULL)
        return vs_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call, "out of memory");
    if (page_open(&err, value, MAGIC_NOTIFY, &o->pg)) {
        free(o);
        return vs_raise(&err, call);
    }
    lock_page(o->pg); /* one of its producers now */
    add_holder(o->pg, me());
    uint32_t w = get_word(o->pg);
    if (w & DEAD)
        set_word(o->pg, w & ~DEAD);
    unlock_page(o->pg);
    o->notify = true;
    o->opened = true;
    o->device = (int)*word(o->pg, W_DEVICE);
    snprintf(o->key, sizeof o->key, "%s", key);
    pthread_mutex_lock(&objs_lock);
    bool counted = false;
    for (size_t i = 0; i < opens.count && !counted; i++) {
        uint64_t *e = (uint64_t *)opens.items + 2 * i;
        if (e[0] == value) {
            e[1]++;
            counted = true;
        }
    }
    if (!counted) {
        uint64_t *e = vs_vec_push(&opens, sizeof(uint64_t) * 2);
        e[0] = value;
        e[1] = 1;
    }
    pthread_mutex_unlock(&objs_lock);
    *notify = (aclrtNotify)(uintptr_t)add(o)->handle;
    return ACL_SUCCESS;
}

/* In a forked child: the parent's events and notifies, pages and watcher are not its own. */
void vs_sync_after_fork(void)
{
    pthread_mutex_init(&registry, NULL);
    pthread_mutex_init(&watch_lock, NULL);
    pthread_mutex_init(&objs_lock, NULL);
    pages.count = file_locks.count = objs.count = opens.count = watching.count = 0;
    watch_thread = false;
    watch_efd = -1;
}
