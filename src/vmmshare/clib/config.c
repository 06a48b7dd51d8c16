/*
 * The configuration: the VMMSHARE_* variables (and ASCEND_RT_VISIBLE_DEVICES), read once when the runtime starts,
 * as vmmshare.config reads them, so a C and a Python process of one node agree (the socket, the server id their
 * handles carry, the devices). A variable that cannot be used is kept as the configuration's error.
 */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/utsname.h>
#include <unistd.h>

#include "vs.h"

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
    if (v != NULL) { /* whitespace around it goes, as str.strip() takes it (config.backend); none inside */
        const char *p = v, *end = v + strlen(v);
        while (p < end && strchr(" \t\n\r\v\f", *p) != NULL)
            p++;
        while (end > p && strchr(" \t\n\r\v\f", end[-1]) != NULL)
            end--;
        size_t j = 0;
        for (; p < end && j < sizeof text - 1; p++)
            text[j++] = (char)(*p >= 'A' && *p <= 'Z' ? *p + 32 : *p);
        text[j] = p < end ? '?' : '\0'; /* (longer than any backend's name: no name) */
        text[sizeof text - 1] = '\0';
    }
    if (text[0] == '\0' || strcmp(text, "host") == 0)
        return 0;
    if (strcmp(text, "auto") == 0) { /* the GPUs when the driver loads and sees one (cuda.c), else host memory */
        c->cuda = c->cuda_auto = true;
        return 0;
    }
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

/* VMMSHARE_FABRIC_TIMEOUT (config.fabric_timeout): seconds in [0.2, 3600], 5 by default. */
static int read_fabric_timeout(vs_config *c)
{
    const char *v = raw("VMMSHARE_FABRIC_TIMEOUT");
    c->fabric_timeout = 5.0;
    if (v == NULL)
        return 0;
    char *end;
    double s = strtod(v, &end);
    while (*end == ' ' || *end == '\t' || *end == '\n')
        end++;
    if (end == v || *end || !(s >= 0.2 && s <= 3600))
        return bad(c, "%s='%s' is not a number of seconds in [0.2, 3600]", "VMMSHARE_FABRIC_TIMEOUT", v);
    c->fabric_timeout = s;
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
 * other character; ids up to the first that is not a device (of c->devices: read again once the CUDA backend
 * counted the GPUs); they must ascend without repeats. */
void vs_read_visible(vs_config *c)
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

int vs_read_config(vs_config *c)
{
    c->broker_user = -1;
    c->nvisible = -1;
    if (read_devices(c) || read_memory(c) || read_socket(c) || read_server_id(c) || read_backend(c) ||
        read_broker_user(c) || read_spin(c) || read_fabric_timeout(c))
        return -1;
    c->prepopulate = read_flag("VMMSHARE_PREPOPULATE");
    vs_read_visible(c);
    return 0;
}
