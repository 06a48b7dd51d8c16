/*
 * Notifies and IPC notifies (aclrtCreateNotify, record, wait and reset, the export key, trustlists, import by key,
 * destroy), as vmmshare.runtime.notifies has them: a flag (bit 0 of word 0) a record sets and a wait takes.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sync.h"
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
    if (pg_create(&err, MAGIC_NOTIFY, &o->pg)) {
        free(o);
        return vs_raise(&err, call);
    }
    o->notify = true;
    o->device = vs_logical(device);
    *pg_word(o->pg, W_DEVICE) = (uint32_t)o->device;
    o->pid_validation = true;
    *notify = (aclrtNotify)(uintptr_t)so_add(o)->handle;
    return ACL_SUCCESS;
}

VS_API aclError aclrtDestroyNotify(aclrtNotify notify)
{
    const char *call = "aclrtDestroyNotify";
    START(call);
    ACL_REQUIRE(notify != NULL, call, "notify is NULL");
    return so_destroy(&err, (uintptr_t)notify, true) ? vs_raise(&err, call) : ACL_SUCCESS;
}

static aclError set_flag(void *arg, vs_err *err)
{
    (void)err;
    sync_obj *o = arg;
    pg_lock(o->pg);
    pg_set(o->pg, (pg_get(o->pg) | 1) & ~DEAD);
    pg_unlock(o->pg);
    return ACL_SUCCESS;
}

VS_API aclError aclrtRecordNotify(aclrtNotify notify, aclrtStream stream)
{
    const char *call = "aclrtRecordNotify";
    START(call);
    ACL_REQUIRE(notify != NULL, call, "notify is NULL");
    vs_stream *s;
    sync_obj *o = so_use_on(&err, (uintptr_t)notify, true, stream, &s);
    if (o == NULL)
        return vs_raise(&err, call);
    return sync_queue(&err, s, call, set_flag, so_unuse, o, true) ? vs_raise(&err, call) : ACL_SUCCESS;
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
        got = pg_wait(p, sync_notify_ready, 0, a->timeout, a->s);
        if (got != READY)
            break;
        pg_lock(p);
        uint32_t w = pg_get(p);
        bool mine = (w & 1) != 0; /* this waiter takes the record (another may have taken it first) */
        if (mine)
            pg_set(p, w & ~1u);
        pg_unlock(p);
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
    vs_stream *s = sync_stream_here(&err, stream);
    if (s == NULL)
        return vs_raise(&err, call);
    int device = 0;
    vs_current_device(&err, &device);
    sync_obj *o = so_use(&err, (uintptr_t)notify, true);
    if (o == NULL)
        return vs_raise(&err, call);
    if (o->opened && vs_logical(device) != o->device) {
        int made = o->device;
        so_unuse(o);
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "notify %#llx was made on device %d: its wait must be "
                       "delivered there, not on device %d", (unsigned long long)(uintptr_t)notify, made,
                       vs_logical(device));
    }
    wait_arg *a = calloc(1, sizeof *a);
    if (a == NULL) {
        so_unuse(o);
        return vs_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call, "out of memory");
    }
    a->o = o;
    a->s = s;
    a->seconds = timeout;
    a->timeout = timeout == 0 || timeout == 0xFFFFFFFFu ? -1 : (double)timeout;
    return sync_queue(&err, s, call, wait_and_reset, so_drop_wait, a, false) ? vs_raise(&err, call) : ACL_SUCCESS;
}

VS_API aclError aclrtNotifyGetExportKey(aclrtNotify notify, char *key, size_t len, uint64_t flags)
{
    const char *call = "aclrtNotifyGetExportKey";
    START(call);
    if (len >= 1024)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "len=%zu: the key buffer is less than 1024 characters", len);
    ACL_REQUIRE(notify != NULL, call, "notify is NULL");
    ACL_REQUIRE(key != NULL, call, "key is NULL");
    sync_obj *o = so_use(&err, (uintptr_t)notify, true);
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
    so_lock();
    if (rc == ACL_SUCCESS && o->key[0] && o->pid_validation != validate)
        rc = vs_set(&err, ACL_ERROR_RT_PARAM_INVALID, "notify %#llx is exported already with pid validation %s: its "
                    "key is %s", (unsigned long long)o->handle, o->pid_validation ? "on" : "off", o->key);
    if (rc == ACL_SUCCESS && !o->key[0]) {
        rc = pg_export(&err, o->pg, validate);
        if (rc == ACL_SUCCESS) {
            o->pid_validation = validate;
            snprintf(o->key, sizeof o->key, "ntf%016llx%08x", (unsigned long long)o->pg->value,
                     vs_rt.config.server_id);
        }
    }
    if (rc == ACL_SUCCESS)
        snprintf(key, len, "%s", o->key);
    so_unlock();
    so_unuse(o);
    return rc ? vs_raise(&err, call) : ACL_SUCCESS;
}

/* The notify `handle` this process exported, with a trustlist to set. */
static sync_obj *exported(vs_err *err, uint64_t handle)
{
    sync_obj *o = so_use(err, handle, true);
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
        so_unuse(o);
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
        : vs_node_set_pids(&err, o->pg->value, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, pids, num);
    so_unuse(o);
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
            rc = vs_node_set_pids(&err, o->pg->value, ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, &one, 1);
    }
    so_unuse(o);
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
    if (pg_open(&err, value, MAGIC_NOTIFY, &o->pg)) {
        free(o);
        return vs_raise(&err, call);
    }
    pg_lock(o->pg); /* one of its producers now */
    pg_add_holder(o->pg, sync_me());
    uint32_t w = pg_get(o->pg);
    if (w & DEAD)
        pg_set(o->pg, w & ~DEAD);
    pg_unlock(o->pg);
    o->notify = true;
    o->opened = true;
    o->device = (int)*pg_word(o->pg, W_DEVICE);
    snprintf(o->key, sizeof o->key, "%s", key);
    so_opened(value);
    *notify = (aclrtNotify)(uintptr_t)so_add(o)->handle;
    return ACL_SUCCESS;
}