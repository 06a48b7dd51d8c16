/*
 * The runtime's older sharing API, IPC memory keys (aclrtIpcMem*), on the broker's exports and trustlists, as
 * vmmshare.runtime.ipc has it: a key names the broker export of the allocation behind an aclrtMalloc pointer, as
 * 24 hex digits (16 of its DEFAULT handle, 8 of the server that made it), so keys pass between C and Python
 * processes both ways.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "vs.h"

#define MAX_KEY_LEN 1024

typedef struct key {
    uint64_t value;
    uint32_t server;
} key;

/* An IPC key's text: 107000 for anything that is not one; 207000 for a key of another server. */
static aclError parse_key(vs_err *err, const char *text, key *out)
{
    size_t n = strnlen(text, 81);
    bool ok = n == VS_KEY_CHARS;
    for (size_t i = 0; ok && i < n; i++)
        ok = (text[i] >= '0' && text[i] <= '9') || (text[i] >= 'a' && text[i] <= 'f');
    if (ok) {
        char head[17];
        memcpy(head, text, 16);
        head[16] = '\0';
        out->value = strtoull(head, NULL, 16);
        out->server = (uint32_t)strtoul(text + 16, NULL, 16);
        ok = out->value != 0;
    }
    if (!ok)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID,
                      "'%.77s%s' is not an IPC memory key (24 lower-case hex digits from aclrtIpcMemGetExportKey)",
                      text, n > 80 ? "..." : "");
    return ACL_SUCCESS;
}

static aclError local_key(vs_err *err, const key *k)
{
    if (k->server != vs_rt.config.server_id)
        return vs_set(err, ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
                      "this key comes from server %#x, not this one (%#x): an IPC key names memory on the server that "
                      "made it, and carries neither that server's address nor a secret for the cross-server "
                      "transport; to share memory across servers, export it as a FABRIC handle", k->server,
                      vs_rt.config.server_id);
    return ACL_SUCCESS;
}

static vs_ipc_export *export_of(uint64_t value)
{
    for (size_t i = 0; i < vs_rt.ipc_exports.count; i++)
        if (VS_AT(vs_rt.ipc_exports, vs_ipc_export, i).value == value)
            return &VS_AT(vs_rt.ipc_exports, vs_ipc_export, i);
    return NULL;
}

static vs_ipc_import *import_of(uint64_t value)
{
    for (size_t i = 0; i < vs_rt.ipc_imports.count; i++)
        if (VS_AT(vs_rt.ipc_imports, vs_ipc_import, i).value == value)
            return &VS_AT(vs_rt.ipc_imports, vs_ipc_import, i);
    return NULL;
}

static vs_block *block_at(uintptr_t ptr, enum vs_owner owner)
{
    for (size_t i = 0; i < vs_rt.blocks.count; i++) {
        vs_block *b = &VS_AT(vs_rt.blocks, vs_block, i);
        if (b->ptr == ptr && b->alloc->owner == owner)
            return b;
    }
    return NULL;
}

/* An aclrtMalloc block is being freed: its key goes with it. */
void vs_ipc_forget_block(vs_alloc *a)
{
    if (!a->exported)
        return;
    for (size_t i = 0; i < vs_rt.ipc_exports.count; i++)
        if (VS_AT(vs_rt.ipc_exports, vs_ipc_export, i).value == a->exported_value) {
            vs_vec_remove(&vs_rt.ipc_exports, i);
            return;
        }
}

/* Map a fresh (registered) allocation at the start of a reservation of its own, as a block (the lock held); on
 * failure the allocation is dropped. */
aclError vs_map_block(vs_err *err, vs_alloc *a, size_t size, uintptr_t *out)
{
    uintptr_t ptr;
    if (vs_map_new(err, a, ACL_RT_MEM_ACCESS_FLAGS_READWRITE, a->owner, &ptr)) {
        vs_drop(a);
        return err->code;
    }
    vs_block *b = vs_vec_push(&vs_rt.blocks, sizeof(vs_block));
    b->ptr = ptr;
    b->size = size;
    b->alloc = a;
    *out = ptr;
    return ACL_SUCCESS;
}

/* Unmap and release a block and drop its allocation: an export of it is revoked, importers keep theirs. */
aclError vs_free_block(vs_err *err, uintptr_t ptr, enum vs_owner owner)
{
    vs_block *b = block_at(ptr, owner);
    if (b == NULL)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "%#lx is not a pointer %s returned (or it was released already)",
                      (unsigned long)ptr, owner == VS_MALLOC ? "aclrtMalloc" : "aclrtIpcMemImportByKey");
    vs_alloc *a = b->alloc;
    vs_vec_remove(&vs_rt.blocks, (size_t)(b - &VS_AT(vs_rt.blocks, vs_block, 0)));
    if (owner == VS_MALLOC)
        vs_ipc_forget_block(a);
    a->refs++; /* held across the unmap, which would destroy it with its last mapping */
    aclError rc = vs_unmap_release(err, ptr, owner);
    a->refs--;
    vs_drop(a);
    return rc;
}

VS_API aclError aclrtIpcMemGetExportKey(void *devPtr, size_t size, char *keyOut, size_t len, uint64_t flags)
{
    const char *call = "aclrtIpcMemGetExportKey";
    START(call);
    if (len >= MAX_KEY_LEN)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "len=%zu: the key buffer is less than %d characters", len,
                       MAX_KEY_LEN);
    ACL_REQUIRE(devPtr != NULL, call, "devPtr is NULL");
    ACL_REQUIRE(keyOut != NULL, call, "key is NULL");
    if (size == 0 || len == 0)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "%s is 0", size == 0 ? "size" : "len");
    if (flags != ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT && flags != ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                       "flags=%llu: use ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT (0) or DISABLE_PID_VALIDATION (1)",
                       (unsigned long long)flags);
    int device = 0;
    if (vs_current_device(&err, &device))
        return vs_raise(&err, call);
    if (len < VS_KEY_BUFFER)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "len=%zu: the key buffer must hold at least %d characters",
                       len, VS_KEY_BUFFER);
    bool validate = flags == ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT;
    uintptr_t ptr = (uintptr_t)devPtr;
    vs_lock();
    aclError rc = ACL_SUCCESS;
    char text[32];
    vs_block *b = block_at(ptr, VS_MALLOC);
    if (b == NULL) {
        rc = vs_set(&err, ACL_ERROR_RT_PARAM_INVALID,
                    "%#lx is not a pointer aclrtMalloc returned (or it was released already)", (unsigned long)ptr);
    } else if (size > b->size) {
        rc = vs_set(&err, ACL_ERROR_RT_PARAM_INVALID, "size %zu must be in [1, %zu], the size aclrtMalloc gave %#lx",
                    size, b->size, (unsigned long)ptr);
    } else if (b->alloc->exported) {
        vs_ipc_export *done = export_of(b->alloc->exported_value);
        if (done == NULL || done->refs == 0)
            rc = vs_set(&err, ACL_ERROR_RT_PARAM_INVALID, "the IPC key of %#lx was closed: memory exports once; "
                        "aclrtMalloc new memory to share again", (unsigned long)ptr);
        else if (done->pid_validation != validate)
            rc = vs_set(&err, ACL_ERROR_RT_PARAM_INVALID, "%#lx is exported already with pid validation %s",
                        (unsigned long)ptr, done->pid_validation ? "on" : "off");
        else
            done->refs++;
    } else {
        uint8_t out[VS_FABRIC_SIZE];
        size_t n;
        rc = vs_export_alloc(&err, b->alloc, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, validate, out, &n);
        if (rc == ACL_SUCCESS) {
            vs_ipc_export *e = vs_vec_push(&vs_rt.ipc_exports, sizeof(vs_ipc_export));
            e->value = b->alloc->exported_value;
            e->alloc = b->alloc;
            e->pid_validation = validate;
            e->refs = 1;
        }
    }
    if (rc == ACL_SUCCESS)
        snprintf(text, sizeof text, "%016llx%08x", (unsigned long long)b->alloc->exported_value,
                 vs_rt.config.server_id);
    vs_unlock();
    if (rc)
        return vs_raise(&err, call);
    snprintf(keyOut, len, "%s", text);
    return ACL_SUCCESS;
}

/* A key of this server whose export has a trustlist to set (207006 for one exported without pid validation). */
static aclError has_trustlist(vs_err *err, const key *k, const char *text)
{
    if (local_key(err, k))
        return err->code;
    vs_lock();
    vs_ipc_export *done = export_of(k->value);
    bool open_to_all = done != NULL && !done->pid_validation;
    vs_unlock();
    if (open_to_all)
        return vs_set(err, ACL_ERROR_RT_NO_PERMISSION, "key %s was exported with "
                      "ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION: it has no trustlist to set", text);
    return ACL_SUCCESS;
}

/* Add this server's pids to the trustlist of a key this process exported. */
static aclError set_local_pids(vs_err *err, const key *k, const char *text, const uint32_t *pids, size_t n)
{
    if (has_trustlist(err, k, text))
        return err->code;
    if (n > VS_IPC_MAX_PIDS)
        return vs_set(err, ACL_ERROR_RT_PARAM_INVALID, "%zu pids in one call: at most %d; call again for more", n,
                      VS_IPC_MAX_PIDS);
    return vs_node_set_pids(err, k->value, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, pids, n);
}

VS_API aclError aclrtIpcMemSetImportPid(const char *keyText, int32_t *pid, size_t num)
{
    const char *call = "aclrtIpcMemSetImportPid";
    START(call);
    ACL_REQUIRE(keyText != NULL, call, "key is NULL");
    ACL_REQUIRE(pid != NULL, call, "pid_list is NULL");
    if (num == 0)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "pid_list is empty");
    int device = 0;
    if (vs_current_device(&err, &device))
        return vs_raise(&err, call);
    if (num > VS_MAX_TRUSTLIST)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "pid_list has %zu pids; at most %d per handle", num,
                       VS_MAX_TRUSTLIST);
    uint32_t *pids = malloc(sizeof(uint32_t) * num);
    if (pids == NULL)
        return vs_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call, "out of memory");
    key k;
    aclError rc = vs_read_pids(&err, pid, num, pids);
    if (rc == ACL_SUCCESS)
        rc = parse_key(&err, keyText, &k);
    if (rc == ACL_SUCCESS)
        rc = set_local_pids(&err, &k, keyText, pids, num);
    free(pids);
    return rc ? vs_raise(&err, call) : ACL_SUCCESS;
}

VS_API aclError aclrtIpcMemImportPidInterServer(const char *keyText, aclrtServerPid *serverPids, size_t num)
{
    const char *call = "aclrtIpcMemImportPidInterServer";
    START(call);
    if (keyText == NULL)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "key is NULL");
    if (serverPids == NULL || num == 0)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "server_pids is %s", serverPids == NULL ? "NULL" : "empty");
    for (size_t i = 0; i < num; i++) {
        if (serverPids[i].pid == NULL)
            return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "server_pids[%zu].pid is NULL", i);
        if (serverPids[i].num == 0)
            return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "server_pids[%zu] has no pids", i);
        if (serverPids[i].num > VS_MAX_TRUSTLIST)
            return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "server_pids[%zu] has %zu pids; at most %d", i,
                           serverPids[i].num, VS_MAX_TRUSTLIST);
    }
    int device = 0;
    if (vs_current_device(&err, &device))
        return vs_raise(&err, call);
    key k;
    if (parse_key(&err, keyText, &k))
        return vs_raise(&err, call);
    for (size_t i = 0; i < num; i++)
        if (serverPids[i].num > VS_IPC_MAX_PIDS)
            return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "server_pids[%zu] has %zu pids: at most %d per entry", i,
                           serverPids[i].num, VS_IPC_MAX_PIDS);
    uint32_t pids[VS_IPC_MAX_PIDS];
    aclError rc = ACL_SUCCESS;
    for (size_t i = 0; i < num && rc == ACL_SUCCESS; i++) /* every entry checked before any takes effect */
        rc = vs_read_pids(&err, serverPids[i].pid, serverPids[i].num, pids);
    /* other servers' pids first (the broker refuses them with 207000 without the cross-server transport) */
    for (size_t i = 0; i < num && rc == ACL_SUCCESS; i++) {
        if (serverPids[i].sdid == vs_rt.config.server_id)
            continue;
        rc = has_trustlist(&err, &k, keyText);
        if (rc == ACL_SUCCESS)
            rc = vs_read_pids(&err, serverPids[i].pid, serverPids[i].num, pids);
        if (rc == ACL_SUCCESS)
            rc = vs_node_set_remote_pids(&err, k.value, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, serverPids[i].sdid, pids,
                                         serverPids[i].num);
    }
    for (size_t i = 0; i < num && rc == ACL_SUCCESS; i++) {
        if (serverPids[i].sdid != vs_rt.config.server_id)
            continue;
        rc = vs_read_pids(&err, serverPids[i].pid, serverPids[i].num, pids);
        if (rc == ACL_SUCCESS)
            rc = set_local_pids(&err, &k, keyText, pids, serverPids[i].num);
    }
    return rc ? vs_raise(&err, call) : ACL_SUCCESS;
}

VS_API aclError aclrtIpcMemImportByKey(void **devPtr, const char *keyText, uint64_t flags)
{
    const char *call = "aclrtIpcMemImportByKey";
    START(call);
    ACL_REQUIRE(devPtr != NULL, call, "devPtr is NULL");
    ACL_REQUIRE(keyText != NULL, call, "key is NULL");
    if (flags != ACL_RT_IPC_MEM_IMPORT_FLAG_DEFAULT && flags != ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                       "flags=%llu: use ACL_RT_IPC_MEM_IMPORT_FLAG_DEFAULT (0) or ENABLE_PEER_ACCESS (1)",
                       (unsigned long long)flags);
    int device = 0;
    if (vs_current_device(&err, &device))
        return vs_raise(&err, call);
    key k;
    if (parse_key(&err, keyText, &k) || local_key(&err, &k))
        return vs_raise(&err, call);
    pthread_mutex_lock(&vs_rt.import_lock);
    aclError rc = ACL_SUCCESS;
    vs_lock();
    vs_ipc_import *done = import_of(k.value);
    uintptr_t ptr = done != NULL ? done->ptr : 0;
    vs_unlock();
    if (done != NULL) { /* the same pointer, if the broker still admits this process to the key */
        uint64_t size;
        rc = vs_node_still_admitted(&err, k.value, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, NULL, &size);
        if (rc == ACL_SUCCESS) {
            vs_lock();
            done = import_of(k.value);
            if (done != NULL)
                done->count++;
            vs_unlock();
        }
    } else {
        vs_alloc *a;
        rc = vs_device_id(&err, device);
        if (rc == ACL_SUCCESS)
            rc = vs_import_alloc(&err, k.value, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, NULL, device, VS_IPC, 0, &a);
        if (rc == ACL_SUCCESS) {
            vs_lock();
            vs_register(a);
            rc = vs_map_block(&err, a, a->size, &ptr);
            if (rc == ACL_SUCCESS) {
                vs_ipc_import *imp = vs_vec_push(&vs_rt.ipc_imports, sizeof(vs_ipc_import));
                imp->value = k.value;
                imp->ptr = ptr;
                imp->count = 1;
            }
            vs_unlock();
        }
    }
    pthread_mutex_unlock(&vs_rt.import_lock);
    if (rc)
        return vs_raise(&err, call);
    *devPtr = (void *)ptr;
    return ACL_SUCCESS;
}

VS_API aclError aclrtIpcMemSetAttr(const char *keyText, aclrtIpcMemAttrType type, uint64_t attr)
{
    const char *call = "aclrtIpcMemSetAttr";
    START(call);
    if (keyText == NULL)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "key is NULL");
    if (type != ACL_RT_IPC_MEM_ATTR_ACCESS_LINK)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "type=%u: the attribute is ACL_RT_IPC_MEM_ATTR_ACCESS_LINK (0)",
                       (unsigned)type);
    if (attr > ACL_RT_IPC_MEM_ATTR_ACCESS_LINK_UB_MULTI_PORT_PATH)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "attr=%llu: use ACL_RT_IPC_MEM_ATTR_ACCESS_LINK_SIO (0), HCCS "
                       "(1), UB_ONE_PORT_PATH (2) or UB_MULTI_PORT_PATH (3)", (unsigned long long)attr);
    key k;
    if (parse_key(&err, keyText, &k))
        return vs_raise(&err, call);
    vs_lock();
    bool known = false;
    for (size_t i = 0; i < vs_rt.ipc_attrs.count; i++)
        known |= VS_AT(vs_rt.ipc_attrs, key, i).value == k.value && VS_AT(vs_rt.ipc_attrs, key, i).server == k.server;
    if (!known)
        *(key *)vs_vec_push(&vs_rt.ipc_attrs, sizeof(key)) = k;
    vs_unlock();
    return ACL_SUCCESS;
}

VS_API aclError aclrtIpcMemClose(const char *keyText)
{
    const char *call = "aclrtIpcMemClose";
    START(call);
    ACL_REQUIRE(keyText != NULL, call, "key is NULL");
    key k;
    if (parse_key(&err, keyText, &k))
        return vs_raise(&err, call);
    pthread_mutex_lock(&vs_rt.import_lock);
    vs_lock();
    aclError rc = ACL_SUCCESS;
    bool had_attr = false;
    for (size_t i = 0; i < vs_rt.ipc_attrs.count; i++) {
        key *a = &VS_AT(vs_rt.ipc_attrs, key, i);
        if (a->value == k.value && a->server == k.server) {
            vs_vec_remove(&vs_rt.ipc_attrs, i);
            had_attr = true;
            break;
        }
    }
    vs_ipc_import *imp = import_of(k.value);
    vs_ipc_export *mine = export_of(k.value);
    if (imp != NULL) {
        if (--imp->count == 0) {
            uintptr_t ptr = imp->ptr;
            vs_vec_remove(&vs_rt.ipc_imports, (size_t)(imp - &VS_AT(vs_rt.ipc_imports, vs_ipc_import, 0)));
            if (vs_free_block(&err, ptr, VS_IPC))
                rc = vs_raise(&err, call);
        }
    } else if (mine != NULL && mine->refs > 0) {
        if (--mine->refs == 0)
            vs_revoke_alloc(mine->alloc);
    } else if (!had_attr) {
        rc = vs_fail(ACL_ERROR_RT_INVALID_HANDLE, call, "key %s is not one this process exported or imported (or it "
                     "was closed already)", keyText);
    }
    vs_unlock();
    pthread_mutex_unlock(&vs_rt.import_lock);
    return rc;
}
