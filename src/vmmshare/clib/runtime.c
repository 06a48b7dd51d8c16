/*
 * The process's runtime: its configuration (the VMMSHARE_* variables, read once, as vmmshare.config reads them),
 * its tables (allocations, reservations, mappings) and the address-space arena reservations are placed in.
 */
#include <errno.h>
#include <limits.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/utsname.h>
#include <unistd.h>

#include "vs.h"

vs_runtime vs_rt;

static pthread_once_t started = PTHREAD_ONCE_INIT;

void vs_lock(void)
{
    pthread_mutex_lock(&vs_rt.lock);
}

void vs_unlock(void)
{
    pthread_mutex_unlock(&vs_rt.lock);
}

void *vs_vec_push(vs_vec *v, size_t size)
{
    if (v->count == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 16;
        void *items = realloc(v->items, cap * size);
        if (items == NULL)
            abort(); /* a table of a few records each: out of memory here is not survivable */
        v->items = items;
        v->cap = cap;
    }
    v->size = size;
    void *slot = (char *)v->items + v->count * size;
    memset(slot, 0, size);
    v->count++;
    return slot;
}

void vs_vec_remove(vs_vec *v, size_t index)
{
    char *base = v->items;
    memmove(base + index * v->size, base + (index + 1) * v->size, (v->count - index - 1) * v->size);
    v->count--;
}

/* ---------------------------------------------------------------- configuration */

static const char *raw(const char *name)
{
    const char *v = getenv(name);
    if (v == NULL)
        return NULL;
    for (const char *p = v; *p; p++)
        if (*p != ' ' && *p != '\t' && *p != '\n')
            return v;
    return NULL; /* unset or blank */
}

static int bad(vs_config *c, const char *fmt, const char *name, const char *value)
{
    char shown[201];
    snprintf(shown, sizeof shown, "%s", value); /* a value is shown up to 200 bytes */
    snprintf(c->error, sizeof c->error, fmt, name, shown);
    return -1;
}

static int read_devices(vs_config *c)
{
    const char *v = raw("VMMSHARE_DEVICES");
    c->devices = 8;
    if (v == NULL)
        return 0;
    char *end;
    errno = 0;
    long n = strtol(v, &end, 10);
    while (*end == ' ')
        end++;
    if (errno || *end || end == v)
        return bad(c, "%s='%s' is not an integer", "VMMSHARE_DEVICES", v);
    if (n < 1 || n > VS_MAX_DEVICES)
        return bad(c, "%s='%s' is out of range [1, 1024]", "VMMSHARE_DEVICES", v);
    c->devices = (int)n;
    return 0;
}

/* A size such as 65536, 64G or 512MiB (K, M, G, T; an optional "iB" or "B"). */
static int parse_size(const char *text, uint64_t *out)
{
    while (*text == ' ')
        text++;
    char *end;
    errno = 0;
    unsigned long long n = strtoull(text, &end, 10);
    if (errno || end == text || *text == '-')
        return -1;
    uint64_t unit = 1;
    switch (*end) {
    case 'k': case 'K': unit = 1ULL << 10; end++; break;
    case 'm': case 'M': unit = 1ULL << 20; end++; break;
    case 'g': case 'G': unit = 1ULL << 30; end++; break;
    case 't': case 'T': unit = 1ULL << 40; end++; break;
    default: break;
    }
    if (unit > 1 && (strcasecmp(end, "ib") == 0 || strcasecmp(end, "b") == 0))
        end += strlen(end);
    while (*end == ' ')
        end++;
    if (*end)
        return -1;
    if (n > UINT64_MAX / unit)
        return -1;
    *out = n * unit;
    return 0;
}

static int read_memory(vs_config *c)
{
    const char *v = raw("VMMSHARE_DEVICE_MEMORY");
    c->device_memory = 64ULL << 30;
    if (v == NULL)
        return 0;
    uint64_t n;
    if (parse_size(v, &n) != 0)
        return bad(c, "%s='%s' is not a size (use bytes, or a number with K, M, G or T, such as 64G)",
                   "VMMSHARE_DEVICE_MEMORY", v);
    if (n == 0)
        return bad(c, "%s='%s' must be positive", "VMMSHARE_DEVICE_MEMORY", v);
    c->device_memory = n;
    return 0;
}

static int read_socket(vs_config *c)
{
    const char *v = getenv("VMMSHARE_SOCKET");
    char path[512];
    if (v != NULL && *v) {
        snprintf(path, sizeof path, "%s", v);
    } else {
        const char *xdg = getenv("XDG_RUNTIME_DIR");
        if (xdg != NULL && *xdg && access(xdg, F_OK) == 0)
            snprintf(path, sizeof path, "%s/vmmshare/broker.sock", xdg);
        else
            snprintf(path, sizeof path, "/tmp/vmmshare-%u/broker.sock", (unsigned)getuid());
    }
    size_t n = strlen(path);
    if (n > 107)
        return bad(c, "%s: the socket path '%.200s' is longer than 107 bytes: choose a shorter one",
                   v != NULL && *v ? "VMMSHARE_SOCKET" : "XDG_RUNTIME_DIR", path);
    memcpy(c->socket, path, n + 1);
    return 0;
}

/* An integer as Python's int(text, 0) reads it: an optional sign, a 0x / 0o / 0b prefix or decimal digits (no
 * leading zero but in 0 itself), single underscores between digits, spaces around; -1 when it is not one. */
static int parse_py_int(const char *text, long long *out)
{
    while (*text == ' ' || *text == '\t' || *text == '\n')
        text++;
    int sign = 1;
    if (*text == '+' || *text == '-')
        sign = *text++ == '-' ? -1 : 1;
    int base = 10;
    if (text[0] == '0' && (text[1] == 'x' || text[1] == 'X' || text[1] == 'o' || text[1] == 'O' || text[1] == 'b' ||
                           text[1] == 'B')) {
        base = text[1] == 'x' || text[1] == 'X' ? 16 : text[1] == 'o' || text[1] == 'O' ? 8 : 2;
        text += 2;
        if (*text == '_')
            text++;
    }
    unsigned long long v = 0;
    int digits = 0, zero_led = 0, nonzero = 0;
    char prev = 0;
    for (; *text && *text != ' ' && *text != '\t' && *text != '\n'; text++) {
        char ch = *text;
        if (ch == '_') {
            if (prev == '_' || digits == 0)
                return -1;
            prev = ch;
            continue;
        }
        int d = ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10
              : ch >= 'A' && ch <= 'F' ? ch - 'A' + 10 : 99;
        if (d >= base)
            return -1;
        if (digits == 0 && d == 0 && base == 10)
            zero_led = 1;
        nonzero |= d != 0;
        if (v > (ULLONG_MAX - (unsigned)d) / (unsigned)base)
            return -1;
        v = v * (unsigned)base + (unsigned)d;
        digits++;
        prev = ch;
    }
    while (*text == ' ' || *text == '\t' || *text == '\n')
        text++;
    if (*text || digits == 0 || prev == '_' || (zero_led && nonzero) || v > (unsigned long long)LLONG_MAX)
        return -1;
    *out = sign * (long long)v;
    return 0;
}

static int read_server_id(vs_config *c)
{
    const char *v = raw("VMMSHARE_SERVER_ID");
    if (v != NULL) {
        long long n;
        if (parse_py_int(v, &n) != 0)
            return bad(c, "%s='%s' is not an integer (such as 42 or 0x2a)", "VMMSHARE_SERVER_ID", v);
        if (n < 0 || n > 0xFFFFFFFFLL)
            return bad(c, "%s='%s' must fit in 32 bits", "VMMSHARE_SERVER_ID", v);
        c->server_id = (uint32_t)n;
        return 0;
    }
    const char *files[] = {"/etc/machine-id", "/var/lib/dbus/machine-id"};
    char text[256];
    for (size_t i = 0; i < 2; i++) {
        FILE *f = fopen(files[i], "re");
        if (f == NULL)
            continue;
        size_t n = fread(text, 1, sizeof text - 1, f);
        fclose(f);
        while (n && (text[n - 1] == '\n' || text[n - 1] == ' ' || text[n - 1] == '\t' || text[n - 1] == '\r'))
            n--;
        size_t start = 0;
        while (start < n && (text[start] == ' ' || text[start] == '\t' || text[start] == '\n'))
            start++;
        if (n > start) {
            uint8_t digest[32];
            vs_sha256(text + start, n - start, digest);
            c->server_id = (uint32_t)digest[0] | (uint32_t)digest[1] << 8 | (uint32_t)digest[2] << 16 |
                           (uint32_t)digest[3] << 24;
            return 0;
        }
    }
    struct utsname u;
    uname(&u);
    uint8_t digest[32];
    vs_sha256(u.nodename, strlen(u.nodename), digest);
    c->server_id = (uint32_t)digest[0] | (uint32_t)digest[1] << 8 | (uint32_t)digest[2] << 16 |
                   (uint32_t)digest[3] << 24;
    return 0;
}

static int read_flag(const char *name)
{
    const char *v = getenv(name);
    return v != NULL && (strcmp(v, "1") == 0 || strcasecmp(v, "true") == 0 || strcasecmp(v, "yes") == 0 ||
                         strcasecmp(v, "on") == 0);
}

static int read_backend(vs_config *c)
{
    const char *v = getenv("VMMSHARE_BACKEND");
    char text[32] = "";
    if (v != NULL) {
        size_t j = 0;
        for (const char *p = v; *p && j < sizeof text - 1; p++)
            if (*p != ' ')
                text[j++] = (char)(*p >= 'A' && *p <= 'Z' ? *p + 32 : *p);
        text[j] = '\0';
    }
    if (text[0] == '\0' || strcmp(text, "host") == 0 || strcmp(text, "auto") == 0)
        return 0; /* auto: no GPU is driven from C in this release, so host memory */
    if (strcmp(text, "cuda") == 0) {
        c->cuda = true;
        return 0;
    }
    return bad(c, "%s='%s': use 'host', 'cuda' or 'auto'", "VMMSHARE_BACKEND", v);
}

static int read_spin(vs_config *c)
{
    const char *v = raw("VMMSHARE_SPIN_US");
    c->spin_us = 100;
    if (v == NULL)
        return 0;
    char *end;
    double us = strtod(v, &end);
    while (*end == ' ' || *end == '\n')
        end++;
    if (end == v || *end || !(us >= 0) || us > 1e9)
        return bad(c, "%s='%s' is not a number of microseconds (0 or more)", "VMMSHARE_SPIN_US", v);
    c->spin_us = (long)us;
    return 0;
}

static int read_broker_user(vs_config *c)
{
    const char *v = raw("VMMSHARE_BROKER_USER");
    c->broker_user = -1;
    if (v == NULL)
        return 0;
    while (*v == ' ')
        v++;
    char *end;
    long n = strtol(v, &end, 10);
    if (end != v && (*end == '\0' || *end == ' ' || *end == '\n')) {
        c->broker_user = n;
        return 0;
    }
    char name[64];
    snprintf(name, sizeof name, "%s", v);
    name[strcspn(name, " \n")] = '\0';
    FILE *f = fopen("/etc/passwd", "re");
    char line[512];
    while (f != NULL && fgets(line, sizeof line, f) != NULL) {
        char *colon = strchr(line, ':');
        if (colon == NULL || (size_t)(colon - line) != strlen(name) || strncmp(line, name, strlen(name)) != 0)
            continue;
        char *uid = strchr(colon + 1, ':');
        if (uid != NULL) {
            c->broker_user = strtol(uid + 1, NULL, 10);
            fclose(f);
            return 0;
        }
    }
    if (f != NULL)
        fclose(f);
    return bad(c, "%s='%s' is neither a uid nor a user of this machine", "VMMSHARE_BROKER_USER", v);
}

/* ASCEND_RT_VISIBLE_DEVICES, as the runtime reads it: runs of digits separated by single commas, up to the first
 * other character; ids up to the first that is not a device; they must ascend without repeats. */
static void read_visible(vs_config *c)
{
    const char *v = getenv("ASCEND_RT_VISIBLE_DEVICES");
    c->nvisible = -1;
    if (v == NULL)
        return;
    snprintf(c->visible_text, sizeof c->visible_text, "%.128s", v);
    c->nvisible = 0;
    const char *p = c->visible_text;
    if (*p >= '0' && *p <= '9') {
        int commas = 0;
        while (*p) {
            if (*p >= '0' && *p <= '9') {
                long n = 0;
                while (*p >= '0' && *p <= '9') {
                    if (n < 100000000)
                        n = n * 10 + (*p - '0');
                    p++;
                }
                commas = 0;
                if (n > c->devices - 1)
                    break;
                if (c->nvisible && n < c->visible[c->nvisible - 1]) {
                    snprintf(c->visible_error, sizeof c->visible_error, "it must be configured in ascending order");
                    c->nvisible = 0;
                    return;
                }
                for (int i = 0; i < c->nvisible; i++)
                    if (c->visible[i] == n) {
                        snprintf(c->visible_error, sizeof c->visible_error,
                                 "its device ids cannot be duplicated");
                        c->nvisible = 0;
                        return;
                    }
                c->visible[c->nvisible++] = (int)n;
                if (c->nvisible >= c->devices)
                    break;
                continue;
            }
            if (*p != ',' || ++commas > 1)
                break;
            p++;
        }
    }
    if (c->nvisible == 0)
        snprintf(c->visible_error, sizeof c->visible_error, "it names no device in [0, %d)", c->devices);
}

static void after_fork_child(void);

static void start_once(void)
{
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&vs_rt.lock, &attr);
    pthread_mutex_init(&vs_rt.import_lock, &attr);
    vs_rt.next_handle = 0x7A0000000040ULL;
    vs_rt.next_id = 1;
    vs_config *c = &vs_rt.config;
    c->broker_user = -1;
    c->nvisible = -1;
    if (read_devices(c) || read_memory(c) || read_socket(c) || read_server_id(c) || read_backend(c) ||
        read_broker_user(c) || read_spin(c))
        return;
    c->prepopulate = read_flag("VMMSHARE_PREPOPULATE");
    read_visible(c);
    vs_node_prepare();
    pthread_atfork(NULL, NULL, after_fork_child);
}

aclError vs_start(vs_err *err)
{
    pthread_once(&started, start_once);
    if (vs_rt.config.error[0])
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "configuration: %s", vs_rt.config.error);
    return ACL_SUCCESS;
}

/* In a forked child: the parent's memory is let go (its mappings stay), the tables start afresh, and the
 * broker connection and holds are not ours (the Python runtime's after-fork, mirrored). */
static void after_fork_child(void)
{
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&vs_rt.lock, &attr);
    pthread_mutex_init(&vs_rt.import_lock, &attr);
    for (vs_alloc *a = vs_rt.allocs; a != NULL; a = a->next)
        if (a->fd >= 0)
            close(a->fd);
    vs_rt.allocs = NULL; /* (the records are the parent's: left, not freed) */
    vs_rt.reservations.count = vs_rt.mappings.count = vs_rt.blocks.count = vs_rt.host_blocks.count = 0;
    vs_rt.registered.count = 0;
    vs_rt.ipc_exports.count = vs_rt.ipc_imports.count = vs_rt.ipc_attrs.count = 0;
    vs_devices_after_fork();
    vs_sync_after_fork();
    vs_node_after_fork();
}

/* ---------------------------------------------------------------- tables */

vs_range *vs_reservation_at(uintptr_t ptr)
{
    for (size_t i = 0; i < vs_rt.reservations.count; i++) {
        vs_range *r = &VS_AT(vs_rt.reservations, vs_range, i);
        if (r->base <= ptr && ptr - r->base < r->size)
            return r;
    }
    return NULL;
}

vs_range *vs_reservation_exact(uintptr_t ptr)
{
    vs_range *r = vs_reservation_at(ptr);
    return r != NULL && r->base == ptr ? r : NULL;
}

vs_mapping *vs_mapping_at(uintptr_t ptr)
{
    for (size_t i = 0; i < vs_rt.mappings.count; i++) {
        vs_mapping *m = &VS_AT(vs_rt.mappings, vs_mapping, i);
        if (m->ptr <= ptr && ptr - m->ptr < m->size)
            return m;
    }
    return NULL;
}

vs_mapping *vs_mapping_exact(uintptr_t ptr)
{
    vs_mapping *m = vs_mapping_at(ptr);
    return m != NULL && m->ptr == ptr ? m : NULL;
}

bool vs_mappings_overlap(uintptr_t ptr, size_t size)
{
    for (size_t i = 0; i < vs_rt.mappings.count; i++) {
        vs_mapping *m = &VS_AT(vs_rt.mappings, vs_mapping, i);
        if (m->ptr < ptr + size && ptr < m->ptr + m->size)
            return true;
    }
    return false;
}

void vs_add_reservation(uintptr_t base, size_t size, enum vs_owner owner)
{
    vs_range *r = vs_vec_push(&vs_rt.reservations, sizeof(vs_range));
    r->base = base;
    r->size = size;
    r->owner = owner;
}

void vs_remove_reservation(uintptr_t base)
{
    for (size_t i = 0; i < vs_rt.reservations.count; i++)
        if (VS_AT(vs_rt.reservations, vs_range, i).base == base) {
            vs_vec_remove(&vs_rt.reservations, i);
            return;
        }
}

void vs_add_mapping(uintptr_t ptr, size_t size, vs_alloc *alloc, uint64_t access)
{
    vs_mapping *m = vs_vec_push(&vs_rt.mappings, sizeof(vs_mapping));
    m->ptr = ptr;
    m->size = size;
    m->alloc = alloc;
    m->effective = access;
    alloc->maps++;
}

void vs_remove_mapping(uintptr_t ptr)
{
    for (size_t i = 0; i < vs_rt.mappings.count; i++) {
        vs_mapping *m = &VS_AT(vs_rt.mappings, vs_mapping, i);
        if (m->ptr == ptr) {
            m->alloc->maps--;
            free(m->access);
            vs_vec_remove(&vs_rt.mappings, i);
            return;
        }
    }
}

/* ---------------------------------------------------------------- the arena */

int vs_prot_of(uint64_t access)
{
    if (access == ACL_RT_MEM_ACCESS_FLAGS_READWRITE)
        return PROT_READ | PROT_WRITE;
    if (access == ACL_RT_MEM_ACCESS_FLAGS_READ)
        return PROT_READ;
    return PROT_NONE;
}

/* Map `size` bytes at `addr` exactly (the fd shared, or a reservation); 0, 1 when something is there, -1. */
static int try_at(uintptr_t addr, size_t size, int fd, int prot)
{
    int flags = (fd >= 0 ? MAP_SHARED : MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE) | MAP_FIXED_NOREPLACE;
    void *p = mmap((void *)addr, size, fd >= 0 ? prot : PROT_NONE, flags, fd, 0);
    if (p == MAP_FAILED)
        return errno == EEXIST ? 1 : -1;
    if ((uintptr_t)p != addr) { /* a kernel that takes MAP_FIXED_NOREPLACE as a hint */
        munmap(p, size);
        return 1;
    }
    return 0;
}

static uintptr_t align_up(uintptr_t v, size_t a)
{
    return (v + a - 1) / a * a;
}

/* Reserve in [16 TiB, 24 TiB), first fit past this process's own ranges, so the same addresses are usually free in
 * every process (as the runtime places them); at `want` exactly when non-zero (errno EEXIST when taken). */
int vs_arena_reserve(size_t size, size_t align, uintptr_t want, int fd, int prot, uintptr_t *out)
{
    if (want) {
        int rc = try_at(want, size, fd, prot);
        if (rc == 1)
            errno = EEXIST;
        if (rc)
            return -1;
        *out = want;
        return 0;
    }
    uintptr_t addr = VS_ARENA_START;
    int tries = 0;
    while (addr + size <= VS_ARENA_END && tries < 4096) {
        bool moved = false;
        for (size_t i = 0; i < vs_rt.reservations.count; i++) {
            vs_range *r = &VS_AT(vs_rt.reservations, vs_range, i);
            if (r->base < addr + size && addr < r->base + r->size) {
                addr = align_up(r->base + r->size, align);
                moved = true;
            }
        }
        if (moved)
            continue;
        tries++;
        int rc = try_at(addr, size, fd, prot);
        if (rc == 0) {
            *out = addr;
            return 0;
        }
        if (rc < 0)
            return -1;
        addr += align_up(size, align); /* something foreign is there: move on */
    }
    /* the arena is full or foreign: let the kernel choose, aligned by over-reserving */
    void *raw_p = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw_p == MAP_FAILED)
        return -1;
    uintptr_t rawp = (uintptr_t)raw_p, p = align_up(rawp, align);
    if (p > rawp)
        munmap(raw_p, p - rawp);
    if (rawp + size + align > p + size)
        munmap((void *)(p + size), rawp + size + align - (p + size));
    if (fd >= 0 && mmap((void *)p, size, prot, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
        int e = errno;
        munmap((void *)p, size);
        errno = e;
        return -1;
    }
    *out = p;
    return 0;
}

/* ---------------------------------------------------------------- allocations */

uint64_t vs_new_handle(void)
{
    uint64_t h = vs_rt.next_handle;
    vs_rt.next_handle += 0x40;
    return h;
}

vs_alloc *vs_allocation(uint64_t handle)
{
    for (vs_alloc *a = vs_rt.allocs; a != NULL; a = a->next)
        if (a->registered && a->handle == handle)
            return a;
    return NULL;
}

void vs_register(vs_alloc *a)
{
    a->handle = vs_new_handle();
    a->registered = a->owner == VS_VMM;
    a->next = vs_rt.allocs;
    vs_rt.allocs = a;
}

static void destroy(vs_alloc *a)
{
    for (vs_alloc **p = &vs_rt.allocs; *p != NULL; p = &(*p)->next)
        if (*p == a) {
            *p = a->next;
            break;
        }
    if (a->fd >= 0)
        close(a->fd);
    vs_node_release(a->token); /* the node's hold goes with it (an export of it is revoked) */
    free(a);
}

void vs_maybe_destroy(vs_alloc *a)
{
    if (a->refs == 0 && a->maps == 0 && a->pins == 0)
        destroy(a);
}

void vs_drop(vs_alloc *a)
{
    if (--a->refs > 0)
        return;
    a->registered = false;
    vs_forget_exports(a);
    vs_maybe_destroy(a);
}

/* The NUMA binding of a memfd's pages (mbind on a temporary mapping sets the object's shared policy). */
static int bind_numa(int fd, size_t size, int64_t node)
{
#ifdef SYS_mbind
    unsigned long mask[64] = {0};
    if (node < 0 || node >= 64 * 64) {
        errno = EINVAL;
        return -1;
    }
    mask[node / 64] = 1UL << (node % 64);
    void *p = mmap(NULL, size, PROT_NONE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
        return -1;
    long rc = syscall(SYS_mbind, p, size, 2 /* MPOL_BIND */, mask, 64 * 64 + 1, 0);
    int e = errno;
    munmap(p, size);
    errno = e;
    return rc == 0 ? 0 : -1;
#else
    (void)fd, (void)size, (void)node;
    errno = ENOSYS;
    return -1;
#endif
}

/* A memfd of `size` bytes sealed against resizing (what the broker wants of an export); huge pages are left to
 * the kernel's transparent huge pages here. */
static int make_memfd(size_t size, const char *name)
{
    int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0)
        return -1;
    if (ftruncate(fd, (off_t)size) != 0 || fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

aclError vs_make_alloc(vs_err *err, size_t size, const vs_prop *prop, enum vs_owner owner, vs_alloc **out)
{
    int device = -1;
    if (prop->loc_type == ACL_MEM_LOCATION_TYPE_DEVICE)
        device = vs_logical((int)prop->loc_id);
    if (device >= 0 && vs_rt.config.cuda)
        return vs_set(err, ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
                      "VMMSHARE_BACKEND=cuda: the C library holds host memory only in this release, so it makes no "
                      "GPU memory; unset VMMSHARE_BACKEND (or set it to host) for device memory on the host");
    if (device >= 0 && size > vs_rt.config.device_memory)
        return vs_set(err, ACL_ERROR_RT_MEMORY_ALLOCATION,
                      "device %d has %llu of %llu bytes free; %zu bytes do not fit (free memory, or raise "
                      "VMMSHARE_DEVICE_MEMORY)", device, (unsigned long long)vs_rt.config.device_memory,
                      (unsigned long long)vs_rt.config.device_memory, size);
    char name[32];
    if (prop->loc_type == ACL_MEM_LOCATION_TYPE_HOST_NUMA)
        snprintf(name, sizeof name, "vmmshare:numa%lld", (long long)prop->loc_id);
    else
        snprintf(name, sizeof name, "vmmshare:%s%d", device >= 0 ? "dev" : "host", device >= 0 ? device : 0);
    uint64_t token;
    aclError rc = vs_node_charge(err, device, size, &token);
    if (rc)
        return rc;
    int fd = make_memfd(size, name);
    if (fd < 0) {
        int e = errno;
        vs_node_release(token);
        return vs_set(err, ACL_ERROR_RT_MEMORY_ALLOCATION, "cannot create %zu bytes of shared memory: %s", size,
                      strerror(e));
    }
    if (prop->loc_type == ACL_MEM_LOCATION_TYPE_HOST_NUMA && bind_numa(fd, size, prop->loc_id) != 0) {
        int e = errno;
        if (!(e == ENOSYS && prop->loc_id == 0)) {
            close(fd);
            vs_node_release(token);
            return vs_set(err, e == ENOSYS ? ACL_ERROR_RT_FEATURE_NOT_SUPPORT : ACL_ERROR_RT_PARAM_INVALID,
                          "cannot bind memory to NUMA node %lld: %s", (long long)prop->loc_id, strerror(e));
        }
    }
    vs_alloc *a = calloc(1, sizeof *a);
    if (a == NULL) {
        close(fd);
        vs_node_release(token);
        return vs_set(err, ACL_ERROR_RT_MEMORY_ALLOCATION, "out of memory");
    }
    a->fd = fd;
    a->size = size;
    a->prop = *prop;
    a->token = token;
    a->refs = 1;
    a->owner = owner;
    *out = a;
    return ACL_SUCCESS;
}
