/*
 * Export, trustlists and import of shareable handles (SPEC §4 rules 9-17, §6), through the node's broker, as
 * vmmshare.runtime.sharing does them: the same messages on the same broker, so C and Python processes share memory
 * with one another and one trustlist decides for both.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <sys/socket.h>
#include <unistd.h>

#include "vs.h"
#include "vs_cuda.h"
#include "wire.h"

/* A shareable handle as the calls take it: its node-local value and, for FABRIC, the decoded fields. */
typedef struct shareable {
    uint32_t share_type;
    uint64_t value;
    uint32_t server_id;
    uint64_t size;
    const uint8_t *secret;
    const uint8_t *raw;      /* a FABRIC handle's 128 bytes */
} shareable;

/* Decode a FABRIC handle (wire.handles.decode_fabric): 107017 for content that is not a handle, 107000 for a
 * malformed endpoint. */
static aclError decode_fabric(vs_err *err, const uint8_t *raw, shareable *out)
{
    if (memcmp(raw, "VMMF", 4) != 0)
        return vs_set(err, ACL_ERROR_RT_INVALID_HANDLE,
                      "not a FABRIC handle (bad magic): pass the 128 bytes the exporter produced");
    if (raw[4] != 1 || raw[5] != ACL_MEM_SHARE_HANDLE_TYPE_FABRIC)
        return vs_set(err, ACL_ERROR_RT_INVALID_HANDLE, "FABRIC handle version %u / share type %u is not supported",
                      raw[4], raw[5]);
    uint64_t flags = vs_wire_get_le(raw + 6, 2), value = vs_wire_get_le(raw + 16, 8);
    bool reserved = false;
    for (int i = 96; i < 128; i++)
        reserved |= raw[i] != 0;
    if ((flags & ~1ULL) || value == 0 || reserved)
        return vs_set(err, ACL_ERROR_RT_INVALID_HANDLE, "FABRIC handle is malformed (flags, handle or reserved bytes)");
    uint8_t family = raw[32];
    if (family == 0) {
        for (int i = 32; i < 64; i++)
            if (raw[i])
                return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "FABRIC handle endpoint has family 0 but is not zero");
    } else if (family != 4 && family != 6) {
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "FABRIC handle endpoint family %u is not 0, 4 or 6", family);
    }
    out->share_type = ACL_MEM_SHARE_HANDLE_TYPE_FABRIC;
    out->value = value;
    out->server_id = (uint32_t)vs_wire_get_le(raw + 8, 4);
    out->size = vs_wire_get_le(raw + 24, 8);
    out->secret = raw + 64;
    out->raw = raw;
    return ACL_SUCCESS;
}

/* Whether `s` names memory of another server (a FABRIC handle of another server id: SPEC §8). */
static bool of_another_server(const shareable *s)
{
    return s->share_type == ACL_MEM_SHARE_HANDLE_TYPE_FABRIC && s->server_id != vs_rt.config.server_id;
}

/* The handle `raw` points at, of share type `st` (a uint64_t for DEFAULT, 128 bytes for FABRIC): 107000 for a type
 * that is neither, 107017 for a DEFAULT value of 0. */
static aclError read_shareable(vs_err *err, const void *raw, uint32_t st, shareable *out)
{
    memset(out, 0, sizeof *out);
    if (st == ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT) {
        uint64_t v;
        memcpy(&v, raw, sizeof v);
        if (v == 0)
            return vs_set(err, ACL_ERROR_RT_INVALID_HANDLE, "shareable handle 0 is never valid");
        out->share_type = st;
        out->value = v;
        return ACL_SUCCESS;
    }
    if (st != ACL_MEM_SHARE_HANDLE_TYPE_FABRIC)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "shareType=%u: use ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT (1) or "
                      "FABRIC (2)", st);
    return decode_fabric(err, raw, out);
}

/* A trustlist argument: 1..4096 positive 32-bit pids (props.check_pids). */
aclError vs_read_pids(vs_err *err, const int32_t *pid, size_t n, uint32_t *out)
{
    if (n > VS_MAX_TRUSTLIST)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "pid_list has %zu pids; at most %d per handle", n,
                      VS_MAX_TRUSTLIST);
    for (size_t i = 0; i < n; i++) {
        if (pid[i] < 1)
            return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "pid_list[%zu]=%d is out of range [1, %d]", i, pid[i],
                          INT32_MAX);
        out[i] = (uint32_t)pid[i];
    }
    return ACL_SUCCESS;
}

/* ---------------------------------------------------------------- export */

aclError vs_export_alloc(vs_err *err, vs_alloc *a, uint32_t share_type, bool pid_validation, uint8_t *out,
                         size_t *outlen)
{
    if (a->imported_from)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID,
                      "an imported allocation cannot be exported again; the exporter owns it");
    if (a->exported)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "handle %#llx was exported already; a handle exports once",
                      (unsigned long long)a->handle);
    uint32_t flags = pid_validation ? 0 : ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION;
    if (a->gpu != NULL && vs_cuda_export_fd(err, a)) /* GPU memory: the driver's POSIX fd goes to the broker */
        return err->code;
    aclError rc = vs_node_export(err, a->token, a->fd, &a->prop, a->size, flags, share_type, out, outlen);
    if (rc)
        return rc;
    if (*outlen != (share_type == ACL_MEM_SHARE_HANDLE_TYPE_FABRIC ? (size_t)VS_FABRIC_SIZE : 8u))
        return vs_set(err, ACL_ERROR_RT_IPC_ERROR, "bad reply from the broker: a %zu-byte handle for a %s export",
                      *outlen, share_type == ACL_MEM_SHARE_HANDLE_TYPE_FABRIC ? "FABRIC" : "DEFAULT");
    a->exported = true;
    a->export_live = true;
    if (*outlen == 8)
        memcpy(&a->exported_value, out, 8);
    else
        memcpy(&a->exported_value, out + 16, 8);
    return ACL_SUCCESS;
}

static aclError export_flags(vs_err *err, uint64_t flags, bool *pid_validation)
{
    if (flags != ACL_RT_VMM_EXPORT_FLAG_DEFAULT && flags != ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID,
                      "flags=%llu: use ACL_RT_VMM_EXPORT_FLAG_DEFAULT (0) or DISABLE_PID_VALIDATION (1)",
                      (unsigned long long)flags);
    *pid_validation = flags == ACL_RT_VMM_EXPORT_FLAG_DEFAULT;
    return ACL_SUCCESS;
}

static aclError export(uint64_t handle, uint32_t share_type, uint64_t flags, uint8_t *out, size_t *outlen,
                       const char *call)
{
    vs_err err;
    bool validate = true;
    if (export_flags(&err, flags, &validate))
        return vs_raise(&err, call);
    vs_lock();
    vs_alloc *a = vs_allocation(handle);
    aclError rc;
    if (a == NULL)
        rc = vs_set(&err, ACL_ERROR_RT_INVALID_HANDLE, "handle %#llx is not a live physical allocation of this process",
                    (unsigned long long)handle);
    else
        rc = vs_export_alloc(&err, a, share_type, validate, out, outlen);
    vs_unlock();
    return rc ? vs_raise(&err, call) : ACL_SUCCESS;
}

VS_API aclError aclrtMemExportToShareableHandle(aclrtDrvMemHandle handle, aclrtMemHandleType handleType,
                                                uint64_t flags, uint64_t *shareableHandle)
{
    const char *call = "aclrtMemExportToShareableHandle";
    START(call);
    ACL_REQUIRE(shareableHandle != NULL, call, "shareableHandle is NULL");
    ACL_REQUIRE(handle != NULL, call, "handle is NULL");
    ACL_REQUIRE(handleType == ACL_MEM_HANDLE_TYPE_NONE, call, "handleType=%u: use ACL_MEM_HANDLE_TYPE_NONE (0)",
                (unsigned)handleType);
    uint8_t out[VS_FABRIC_SIZE];
    size_t n;
    aclError rc = export((uintptr_t)handle, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, flags, out, &n, call);
    if (rc == ACL_SUCCESS)
        memcpy(shareableHandle, out, 8);
    return rc;
}

VS_API aclError aclrtMemExportToShareableHandleV2(aclrtDrvMemHandle handle, uint64_t flags,
                                                  aclrtMemSharedHandleType shareType, void *shareableHandle)
{
    const char *call = "aclrtMemExportToShareableHandleV2";
    START(call);
    ACL_REQUIRE(shareableHandle != NULL, call, "shareableHandle is NULL");
    ACL_REQUIRE(handle != NULL, call, "handle is NULL");
    uint32_t st = (uint32_t)shareType;
    if (st != ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT && st != ACL_MEM_SHARE_HANDLE_TYPE_FABRIC)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                       "shareType=%u: use ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT (1) or FABRIC (2)", st);
    uint8_t out[VS_FABRIC_SIZE];
    size_t n;
    aclError rc = export((uintptr_t)handle, st, flags, out, &n, call);
    if (rc == ACL_SUCCESS)
        memcpy(shareableHandle, out, st == ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT ? 8 : VS_FABRIC_SIZE);
    return rc;
}

/* ---------------------------------------------------------------- trustlists */

static aclError set_pids(const shareable *s, const int32_t *pid, size_t n, const char *call)
{
    vs_err err;
    if (n > VS_MAX_TRUSTLIST)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "pid_list has %zu pids; at most %d per handle", n,
                       VS_MAX_TRUSTLIST);
    uint32_t *pids = malloc(sizeof(uint32_t) * (n ? n : 1));
    if (pids == NULL)
        return vs_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call, "out of memory");
    aclError rc = vs_read_pids(&err, pid, n, pids);
    if (rc == ACL_SUCCESS && s->share_type == ACL_MEM_SHARE_HANDLE_TYPE_FABRIC &&
        s->server_id != vs_rt.config.server_id)
        rc = vs_set(&err, ACL_ERROR_RT_NO_PERMISSION, "this FABRIC handle was exported on server %#x: only its "
                    "exporting process, there, may set its trustlist", s->server_id);
    if (rc == ACL_SUCCESS)
        rc = vs_node_set_pids(&err, s->value, s->share_type, pids, n);
    free(pids);
    return rc ? vs_raise(&err, call) : ACL_SUCCESS;
}

VS_API aclError aclrtMemSetPidToShareableHandle(uint64_t shareableHandle, int32_t *pid, size_t pidNum)
{
    const char *call = "aclrtMemSetPidToShareableHandle";
    START(call);
    ACL_REQUIRE(pid != NULL, call, "pid_list is NULL");
    ACL_REQUIRE(pidNum != 0, call, "pid_list is empty");
    shareable s;
    if (read_shareable(&err, &shareableHandle, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, &s))
        return vs_raise(&err, call);
    return set_pids(&s, pid, pidNum, call);
}

VS_API aclError aclrtMemSetPidToShareableHandleV2(void *shareableHandle, aclrtMemSharedHandleType shareType,
                                                  int32_t *pid, size_t pidNum)
{
    const char *call = "aclrtMemSetPidToShareableHandleV2";
    START(call);
    ACL_REQUIRE(shareableHandle != NULL, call, "shareableHandle is NULL");
    ACL_REQUIRE(pid != NULL, call, "pid_list is NULL");
    ACL_REQUIRE(pidNum != 0, call, "pid_list is empty");
    shareable s;
    if (read_shareable(&err, shareableHandle, (uint32_t)shareType, &s))
        return vs_raise(&err, call);
    return set_pids(&s, pid, pidNum, call);
}

/* ---------------------------------------------------------------- import */

static vs_alloc *imported(uint64_t value)
{
    for (vs_alloc *a = vs_rt.allocs; a != NULL; a = a->next)
        if (a->in_imports && a->imported_from == value)
            return a;
    return NULL;
}

/* A new import of a handle of this node (not registered): the broker's memfd, adopted. */
aclError vs_import_alloc(vs_err *err, uint64_t value, uint32_t share_type, const uint8_t *secret, int device,
                         enum vs_owner owner, size_t fabric_size, vs_alloc **out)
{
    int fd;
    uint64_t token, size;
    vs_prop prop;
    bool gpu;
    aclError rc = vs_node_import(err, value, share_type, secret, &fd, &token, &size, &prop, &gpu);
    if (rc)
        return rc;
    if (share_type == ACL_MEM_SHARE_HANDLE_TYPE_FABRIC && fabric_size != size) {
        close(fd);
        vs_node_release(token);
        return vs_set(err, ACL_ERROR_RT_INVALID_HANDLE,
                      "this FABRIC handle says %zu bytes but its memory was exported with %llu: it does not match "
                      "what was exported (pass the 128 bytes the exporter produced)", fabric_size,
                      (unsigned long long)size);
    }
    if (gpu && !vs_rt.config.cuda) {
        close(fd);
        vs_node_release(token);
        return vs_set(err, ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
                      "this handle is GPU memory: import it in a process with VMMSHARE_BACKEND=cuda");
    }
    vs_alloc *a = calloc(1, sizeof *a);
    if (a == NULL) {
        close(fd);
        vs_node_release(token);
        return vs_set(err, ACL_ERROR_RT_MEMORY_ALLOCATION, "out of memory");
    }
    if (prop.loc_type == ACL_MEM_LOCATION_TYPE_DEVICE)
        prop.loc_id = device; /* device memory is placed on the importer's device */
    a->fd = fd;
    a->size = size;
    a->prop = prop;
    a->token = token;
    a->refs = 1;
    a->imported_from = value;
    a->owner = owner;
    if (gpu && vs_cuda_adopt(err, a, device)) { /* GPU memory: the driver imports the fd (closed either way) */
        vs_node_release(token);
        free(a);
        return err->code;
    }
    *out = a;
    return ACL_SUCCESS;
}

/* A new import of another server's memory (SPEC §8): this node's broker asks the exporting node's, which serves the
 * memory to this process alone through its transfer engine. No fd: the memory stays there, a mapping of it here
 * stays inaccessible, and copies reach it through that engine (fabric.c). */
static aclError remote_import_alloc(vs_err *err, const shareable *s, int device, vs_alloc **out)
{
    uint64_t token, size, address;
    uint16_t port;
    vs_prop prop;
    aclError rc = vs_node_remote_import(err, s->raw, &token, &size, &prop, &address, &port);
    if (rc)
        return rc;
    const uint8_t *ep = s->raw + 32; /* family, pad, port (u16), address (16 bytes), reserved */
    vs_remote *r = calloc(1, sizeof *r);
    vs_alloc *a = calloc(1, sizeof *a);
    if (r == NULL || a == NULL) {
        free(r);
        free(a);
        vs_node_release(token);
        return vs_set(err, ACL_ERROR_RT_MEMORY_ALLOCATION, "out of memory");
    }
    if (size != s->size || address == 0 || port == 0 || (ep[0] != 4 && ep[0] != 6)) {
        free(r);
        free(a);
        vs_node_release(token);
        return vs_set(err, ACL_ERROR_RT_IPC_ERROR, "bad reply from the broker: a remote import of %llu bytes at %#llx, "
                      "port %u, for a handle of %llu bytes", (unsigned long long)size, (unsigned long long)address,
                      port, (unsigned long long)s->size);
    }
    r->family = ep[0] == 4 ? AF_INET : AF_INET6;
    memcpy(r->addr, ep + 4, 16);
    r->port = port;
    r->address = address;
    r->size = size;
    char host[INET6_ADDRSTRLEN] = "?";
    inet_ntop(r->family, r->addr, host, sizeof host);
    snprintf(r->where, sizeof r->where, r->family == AF_INET6 ? "[%s]:%u" : "%s:%u", host, port);
    if (prop.loc_type == ACL_MEM_LOCATION_TYPE_DEVICE)
        prop.loc_id = device; /* device memory is placed on the importer's device */
    a->fd = -1;
    a->remote = r;
    a->size = size;
    a->prop = prop;
    a->token = token;
    a->refs = 1;
    a->imported_from = s->value;
    a->owner = VS_VMM;
    *out = a;
    return ACL_SUCCESS;
}

/* Ask the broker again (vs_node_still_admitted, or a remote import for another server's handle), and check a FABRIC
 * handle's size against the export's. */
static aclError still_admitted(vs_err *err, const shareable *s)
{
    uint64_t size;
    if (of_another_server(s)) { /* the importing broker checks the size the exporter answers */
        uint64_t token, address;
        uint16_t port;
        vs_prop prop;
        aclError rc = vs_node_remote_import(err, s->raw, &token, &size, &prop, &address, &port);
        if (rc == ACL_SUCCESS)
            vs_node_release(token);
        return rc;
    }
    aclError rc = vs_node_still_admitted(err, s->value, s->share_type, s->secret, &size);
    if (rc)
        return rc;
    if (s->share_type == ACL_MEM_SHARE_HANDLE_TYPE_FABRIC && s->size != size)
        return vs_set(err, ACL_ERROR_RT_INVALID_HANDLE,
                      "this FABRIC handle says %llu bytes but its memory was exported with %llu: it does not match "
                      "what was exported (pass the 128 bytes the exporter produced)", (unsigned long long)s->size,
                      (unsigned long long)size);
    return ACL_SUCCESS;
}

/* Import `s` as memory of `device` (rule 13: a handle this process holds an import of comes back with a
 * reference added, once the broker still admits it). */
static aclError import_handle(vs_err *err, const shareable *s, int device, uint64_t *handle)
{
    pthread_mutex_lock(&vs_rt.import_lock); /* one import at a time: a second of the same handle shares the first */
    vs_lock();
    vs_alloc *done = imported(s->value);
    if (done != NULL && done->refs > 0)
        done->pins++; /* kept while the broker is asked again (a free meanwhile cannot destroy it) */
    else
        done = NULL;
    vs_unlock();
    aclError rc;
    if (done != NULL) {
        rc = still_admitted(err, s);
        vs_lock();
        done->pins--;
        if (rc == ACL_SUCCESS && !(done->registered && done->refs > 0 && done->in_imports))
            rc = vs_set(err, ACL_ERROR_RT_INVALID_HANDLE,
                        "the import of this handle was freed while it was imported again: import it anew");
        if (rc == ACL_SUCCESS) {
            done->refs++; /* the reference this import adds */
            *handle = done->handle;
        }
        vs_maybe_destroy(done);
        vs_unlock();
    } else {
        vs_alloc *a;
        rc = of_another_server(s) ? remote_import_alloc(err, s, device, &a)
                                  : vs_import_alloc(err, s->value, s->share_type, s->secret, device, VS_VMM, s->size, &a);
        if (rc == ACL_SUCCESS) {
            vs_lock();
            vs_register(a);
            a->in_imports = true;
            *handle = a->handle;
            vs_unlock();
        }
    }
    pthread_mutex_unlock(&vs_rt.import_lock);
    return rc;
}

VS_API aclError aclrtMemImportFromShareableHandle(uint64_t shareableHandle, int32_t deviceId,
                                                  aclrtDrvMemHandle *handle)
{
    const char *call = "aclrtMemImportFromShareableHandle";
    START(call);
    ACL_REQUIRE(handle != NULL, call, "handle is NULL");
    shareable s;
    if (read_shareable(&err, &shareableHandle, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, &s) || vs_device_id(&err, deviceId))
        return vs_raise(&err, call);
    uint64_t h;
    if (import_handle(&err, &s, deviceId, &h))
        return vs_raise(&err, call);
    *handle = (aclrtDrvMemHandle)(uintptr_t)h;
    return ACL_SUCCESS;
}

VS_API aclError aclrtMemImportFromShareableHandleV2(void *shareableHandle, aclrtMemSharedHandleType shareType,
                                                    uint64_t flags, aclrtDrvMemHandle *handle)
{
    const char *call = "aclrtMemImportFromShareableHandleV2";
    START(call);
    ACL_REQUIRE(shareableHandle != NULL, call, "shareableHandle is NULL");
    ACL_REQUIRE(flags == 0, call, "flags=%llu: reserved, must be 0", (unsigned long long)flags);
    ACL_REQUIRE(handle != NULL, call, "handle is NULL");
    int device = 0;
    if (vs_current_device(&err, &device))
        return vs_raise(&err, call);
    shareable s;
    if (read_shareable(&err, shareableHandle, (uint32_t)shareType, &s))
        return vs_raise(&err, call);
    uint64_t h;
    if (import_handle(&err, &s, device, &h))
        return vs_raise(&err, call);
    *handle = (aclrtDrvMemHandle)(uintptr_t)h;
    return ACL_SUCCESS;
}

/* ---------------------------------------------------------------- revocation */

void vs_revoke_alloc(vs_alloc *a)
{
    if (a->exported && a->export_live) {
        a->export_live = false;
        vs_err ignored;
        vs_node_revoke(&ignored, a->token);
    }
}

/* The last handle to `a` was freed: an export of it is revoked (now, if it is still mapped here: unmapped, the
 * node's release revokes it), an import of it may come again. */
void vs_forget_exports(vs_alloc *a)
{
    if (a->imported_from && a->in_imports) {
        a->in_imports = false;
    } else if (a->maps) {
        vs_revoke_alloc(a);
    } else {
        a->export_live = false; /* (unmapped: the node's release revokes it) */
    }
}

VS_API aclError aclrtDeviceGetBareTgid(int32_t *pid)
{
    const char *call = "aclrtDeviceGetBareTgid";
    START(call);
    ACL_REQUIRE(pid != NULL, call, "pid is NULL");
    uint32_t got;
    if (vs_node_bare_tgid(&err, &got))
        return vs_raise(&err, call);
    *pid = (int32_t)got;
    return ACL_SUCCESS;
}
