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

#include "sync.h"

static uint64_t sync_start_time(uint32_t pid)
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

ident sync_me(void)
{
    ident i = {(uint32_t)getpid(), 0, 0};
    struct stat st;
    if (stat("/proc/self/ns/pid", &st) == 0)
        i.ns = st.st_ino;
    i.start = sync_start_time(i.pid);
    return i;
}

static bool sync_same(const ident *a, const ident *b)
{
    return a->pid == b->pid && a->ns == b->ns && a->start == b->start;
}

/* ---------------------------------------------------------------- the page */


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

volatile uint32_t *pg_word(page *p, int offset)
{
    return (volatile uint32_t *)(p->addr + offset);
}

static void pg_wake(page *p)
{
    syscall(SYS_futex, p->addr, FUTEX_WAKE, 0x7FFFFFFF, NULL, NULL, 0);
}

/* Change word 0 (under the lock) and wake every waiter. */
void pg_set(page *p, uint32_t v)
{
    __atomic_store_n(pg_word(p, 0), v, __ATOMIC_SEQ_CST);
    pg_wake(p);
}

uint32_t pg_get(page *p)
{
    return __atomic_load_n(pg_word(p, 0), __ATOMIC_SEQ_CST);
}

void pg_lock(page *p)
{
    pthread_mutex_lock(p->lock);
    if (p->fd >= 0) {
        struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
        while (fcntl(p->fd, F_SETLKW, &fl) != 0 && errno == EINTR)
            ;
    }
}

void pg_unlock(page *p)
{
    if (p->fd >= 0) {
        struct flock fl = {.l_type = F_UNLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
        fcntl(p->fd, F_SETLK, &fl);
    }
    pthread_mutex_unlock(p->lock);
}

/* A page over `addr` (mapped) and `fd` (-1: private), registered for the watcher. */
static page *pg_new(uint8_t *addr, int fd)
{
    page *p = calloc(1, sizeof *p);
    if (p == NULL)
        return NULL;
    p->addr = addr;
    p->fd = fd;
    struct stat st;
    if (fd >= 0 && fstat(fd, &st) != 0) {
        free(p);
        return NULL;
    }
    pthread_mutex_lock(&registry);
    file_lock *found = NULL;
    if (fd >= 0)
        for (size_t i = 0; i < file_locks.count && found == NULL; i++) {
            file_lock *f = &VS_AT(file_locks, file_lock, i);
            if (f->dev == st.st_dev && f->ino == st.st_ino)
                found = f;
        }
    if (found == NULL) {
        pthread_mutex_t *m = malloc(sizeof *m);
        if (m == NULL) {
            pthread_mutex_unlock(&registry);
            free(p);
            return NULL;
        }
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
static void pg_finish(page *p)
{
    pthread_mutex_lock(p->lock); /* (never while holding the registry: a peer may hold the page's record lock) */
    munmap(p->addr, PAGE);
    if (p->fd >= 0)
        close(p->fd);
    pthread_mutex_unlock(p->lock);
    pthread_mutex_lock(&registry);
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

/* Off the registry; gone now, or once the watcher no longer uses it. */
void pg_close(page *p)
{
    pthread_mutex_lock(&registry);
    for (size_t i = 0; i < pages.count; i++)
        if (VS_AT(pages, page *, i) == p) {
            vs_vec_remove(&pages, i);
            break;
        }
    bool now = p->pins == 0;
    p->closing = !now;
    pthread_mutex_unlock(&registry);
    if (now)
        pg_finish(p);
}

void vs_sync_kick(void *pg)
{
    page *p = pg;
    pg_lock(p);
    pg_set(p, pg_get(p) ^ KICK);
    pg_unlock(p);
}

/* The producers' list (under the lock). */
int pg_holders(page *p, ident *out)
{
    uint32_t count = *pg_word(p, W_COUNT);
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

void pg_set_holders(page *p, const ident *list, int n)
{
    int old = (int)*pg_word(p, W_COUNT);
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
    *pg_word(p, W_COUNT) = (uint32_t)n;
}

void pg_add_holder(page *p, ident id)
{
    ident have[MAX_HOLDERS + 1];
    int n = pg_holders(p, have);
    for (int i = 0; i < n; i++)
        if (sync_same(&have[i], &id))
            return;
    have[n++] = id;
    pg_set_holders(p, have, n);
}

bool pg_remove_holder(page *p, ident id)
{
    ident have[MAX_HOLDERS];
    int n = pg_holders(p, have), k = 0;
    bool found = false;
    for (int i = 0; i < n; i++) {
        if (sync_same(&have[i], &id))
            found = true;
        else
            have[k++] = have[i];
    }
    if (found)
        pg_set_holders(p, have, k);
    return found;
}

bool sync_newer(uint32_t a, uint32_t b)
{
    uint32_t d = (a - b) & STATE;
    return d > 0 && d < HALF;
}

/* Whether a waiter still needs a producer: an event's last record not completed; a notify not set. */
static bool pg_pending(page *p)
{
    uint32_t w = pg_get(p);
    if (p->magic == MAGIC_NOTIFY)
        return !(w & 1);
    return sync_newer(*pg_word(p, W_ISSUED), w & STATE);
}

/* `id` exited: off the list; if no producer is left while a waiter needs one, DEAD. */
static void pg_producer_died(page *p, ident id)
{
    pg_lock(p);
    if (pg_remove_holder(p, id)) {
        ident rest[MAX_HOLDERS];
        uint32_t w = pg_get(p);
        if (pg_holders(p, rest) == 0 && !(w & DEAD) && pg_pending(p))
            pg_set(p, w | DEAD);
    }
    pg_unlock(p);
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

/* The pages `id` was a producer of are pinned under the registry's lock and updated after it (a page's lock may be
 * held by a peer process for as long as it likes: that must not stall the registry, every page's creation). */
static void died(const ident *id, const vs_vec *ids)
{
    vs_vec hit = {NULL, 0, 0, sizeof(page *)};
    pthread_mutex_lock(&registry);
    for (size_t k = 0; k < ids->count; k++)
        for (size_t i = 0; i < pages.count; i++) {
            page *p = VS_AT(pages, page *, i);
            if (p->id == VS_AT(*ids, uint64_t, k)) {
                p->pins++;
                *(page **)vs_vec_push(&hit, sizeof(page *)) = p;
            }
        }
    pthread_mutex_unlock(&registry);
    for (size_t i = 0; i < hit.count; i++)
        pg_producer_died(VS_AT(hit, page *, i), *id);
    for (size_t i = 0; i < hit.count; i++) {
        page *p = VS_AT(hit, page *, i);
        pthread_mutex_lock(&registry);
        bool last = --p->pins == 0 && p->closing;
        pthread_mutex_unlock(&registry);
        if (last)
            pg_finish(p);
    }
    free(hit.items);
}

static void *watch_run(void *unused)
{
    (void)unused;
    for (;;) {
        struct pollfd fds[MAX_PIDFDS + 1];
        ident polled[MAX_PIDFDS + 1]; /* (an fd evicted meanwhile may be reused for another process) */
        pthread_mutex_lock(&watch_lock);
        fds[0].fd = watch_efd;
        fds[0].events = POLLIN;
        int n = 1;
        for (size_t i = 0; i < watching.count; i++) {
            fds[n].fd = VS_AT(watching, watched, i).pidfd;
            fds[n].events = POLLIN;
            polled[n] = VS_AT(watching, watched, i).id;
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
                if (VS_AT(watching, watched, i).pidfd == fds[k].fd &&
                    sync_same(&VS_AT(watching, watched, i).id, &polled[k])) {
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
    ident mine = sync_me();
    ident gone[MAX_HOLDERS];
    int ngone = 0;
    bool changed = false;
    pthread_mutex_lock(&watch_lock);
    if (watch_efd < 0)
        watch_efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    for (int k = 0; k < n; k++) {
        if (sync_same(&ids[k], &mine) || ids[k].ns != mine.ns)
            continue;
        watched *w = NULL;
        for (size_t i = 0; i < watching.count && w == NULL; i++)
            if (sync_same(&VS_AT(watching, watched, i).id, &ids[k]))
                w = &VS_AT(watching, watched, i);
        if (w == NULL) {
            int fd = (int)syscall(SYS_pidfd_open, ids[k].pid, 0);
            if (fd < 0) {
                if (errno == ESRCH)
                    gone[ngone++] = ids[k];
                continue; /* (no pidfd_open here: its waiters wait as the runtime's do) */
            }
            if (sync_start_time(ids[k].pid) != ids[k].start) { /* the pid names another process now */
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
        for (int k = 0; k < ngone; k++) /* (p is in its waiter's use) */
            pg_producer_died(p, gone[k]);
    }
}

/* ---------------------------------------------------------------- waiting */


bool sync_event_ready(uint32_t w, uint32_t target)
{
    return !sync_newer(target, w & STATE);
}

bool sync_notify_ready(uint32_t w, uint32_t target)
{
    (void)target;
    return (w & 1) != 0;
}

/* Wait until ready(word): READY, GONE (DEAD set first), TIMEOUT or CANCELLED (the stream destroyed by force). */
int pg_wait(page *p, ready_fn ready, uint32_t target, double timeout, vs_stream *stream)
{
    struct timespec start;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        uint32_t w = pg_get(p);
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
            pg_lock(p); /* (the list, and what this process last watched of it, under the page's lock) */
            int n = pg_holders(p, now);
            bool changed = n != p->nwatched;
            for (int i = 0; i < n && !changed; i++)
                changed = !sync_same(&now[i], &p->watched[i]);
            if (changed) {
                memcpy(p->watched, now, sizeof(ident) * (size_t)n);
                p->nwatched = n;
            }
            pg_unlock(p);
            if (changed) {
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
aclError pg_create(vs_err *err, uint32_t magic, page **out)
{
    uint64_t token;
    if (vs_node_charge(err, -1, PAGE, &token))
        return err->code;
    int fd = memfd_create("vmmshare:sync", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    void *addr = MAP_FAILED;
    if (fd >= 0 && ftruncate(fd, PAGE) == 0 &&
        fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) == 0)
        addr = mmap(NULL, PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    page *p = addr != MAP_FAILED ? pg_new(addr, fd) : NULL;
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
    *pg_word(p, W_MAGIC) = magic;
    *out = p;
    return ACL_SUCCESS;
}

aclError pg_private(vs_err *err, page **out)
{
    void *addr = mmap(NULL, PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    page *p = addr != MAP_FAILED ? pg_new(addr, -1) : NULL;
    if (p == NULL) {
        if (addr != MAP_FAILED)
            munmap(addr, PAGE);
        return vs_set(err, ACL_ERROR_RT_MEMORY_ALLOCATION, "cannot make a page: %s", strerror(errno));
    }
    p->magic = MAGIC_EVENT;
    *out = p;
    return ACL_SUCCESS;
}

aclError pg_export(vs_err *err, page *p, bool pid_validation)
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
aclError pg_open(vs_err *err, uint64_t value, uint32_t magic, page **out)
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
    page *p = pg_new(addr, fd);
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

/* In a forked child: the parent's events and notifies, pages and watcher are not its own. */
void vs_sync_after_fork(void)
{
    pthread_mutex_init(&registry, NULL);
    pthread_mutex_init(&watch_lock, NULL);
    so_after_fork();
    for (size_t i = 0; i < pages.count; i++) { /* (their node holds are the parent's: not released here) */
        page *p = VS_AT(pages, page *, i);
        munmap(p->addr, PAGE);
        if (p->fd >= 0)
            close(p->fd);
        free(p);
    }
    for (size_t i = 0; i < file_locks.count; i++)
        free(VS_AT(file_locks, file_lock, i).m);
    for (size_t i = 0; i < watching.count; i++) {
        close(VS_AT(watching, watched, i).pidfd);
        free(VS_AT(watching, watched, i).pages.items);
    }
    if (watch_efd >= 0)
        close(watch_efd);
    pages.count = file_locks.count = watching.count = 0;
    watch_thread = false;
    watch_efd = -1;
}
