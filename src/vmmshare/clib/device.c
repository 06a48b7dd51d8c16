/*
 * Devices, contexts (each thread's current one), streams and the device-id conversions (SPEC §2), as
 * vmmshare.runtime.devices has them.
 *
 * aclrtSetDevice makes the device's default context current in the calling thread (and counts a reference);
 * aclrtCreateContext makes a context of its own. Device ids in calls are user ids (ASCEND_RT_VISIBLE_DEVICES
 * applied); the node's numbers are what the broker charges. Work queued on a stream runs when it is queued, in
 * order, so it is done by the time aclrtSynchronizeStream returns, which reports the first failure since the last
 * synchronize (and work queued behind a failure does not run until then).
 */
#include <errno.h>
#include <stdio.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>

#include "vs.h"
#include "vs_cuda.h"

static _Thread_local uint64_t current_ctx;

void vs_devices_after_fork(void)
{
    vs_rt.contexts.count = 0;
    vs_rt.streams.count = 0;
    memset(vs_rt.device_refs, 0, sizeof vs_rt.device_refs);
    current_ctx = 0;
}

static int visible_count(void)
{
    return vs_rt.config.nvisible >= 0 ? vs_rt.config.nvisible : vs_rt.config.devices;
}

aclError vs_device_id(vs_err *err, int64_t device)
{
    vs_config *c = &vs_rt.config;
    if (c->visible_error[0])
        return vs_set(err, ACL_ERROR_RT_INVALID_DEVICEID,
                      "device %lld is not visible: ASCEND_RT_VISIBLE_DEVICES='%s' is invalid (%s), so this process "
                      "sees no device", (long long)device, c->visible_text, c->visible_error);
    int count = visible_count();
    if (device < 0 || device >= count) {
        if (c->nvisible >= 0)
            return vs_set(err, ACL_ERROR_RT_INVALID_DEVICEID,
                          "device %lld does not exist: ASCEND_RT_VISIBLE_DEVICES='%s' makes %d visible (0..%d)",
                          (long long)device, c->visible_text, count, count - 1);
        return vs_set(err, ACL_ERROR_RT_INVALID_DEVICEID,
                      "device %lld does not exist: there are %d (0..%d); set VMMSHARE_DEVICES for more",
                      (long long)device, count, count - 1);
    }
    return ACL_SUCCESS;
}

int vs_logical(int device)
{
    if (vs_rt.config.nvisible >= 0 && device >= 0 && device < vs_rt.config.nvisible)
        return vs_rt.config.visible[device];
    return device;
}

static vs_context *context_of(uint64_t handle)
{
    for (size_t i = 0; i < vs_rt.contexts.count; i++) {
        vs_context *c = VS_AT(vs_rt.contexts, vs_context *, i);
        if (c->handle == handle)
            return c;
    }
    return NULL;
}

static vs_context *current_context(void)
{
    return current_ctx ? context_of(current_ctx) : NULL;
}

aclError vs_current_device(vs_err *err, int *device)
{
    vs_lock();
    vs_context *c = current_context();
    if (c != NULL)
        *device = c->device;
    vs_unlock();
    if (c == NULL)
        return vs_set(err, ACL_ERROR_RT_CONTEXT_NULL,
                      "no current context in this thread: call aclrtSetDevice(id) (or aclrtCreateContext) first");
    return ACL_SUCCESS;
}

static vs_context *new_context(int device, bool is_default)
{
    vs_context *c = calloc(1, sizeof *c);
    if (c == NULL)
        return NULL;
    c->handle = 0xC7000000ULL + vs_rt.next_id++;
    c->device = device;
    c->is_default = is_default;
    *(vs_context **)vs_vec_push(&vs_rt.contexts, sizeof(vs_context *)) = c;
    return c;
}

static vs_context *default_context(int device)
{
    for (size_t i = 0; i < vs_rt.contexts.count; i++) {
        vs_context *c = VS_AT(vs_rt.contexts, vs_context *, i);
        if (c->is_default && c->device == device)
            return c;
    }
    return NULL;
}

/* Drop a context and its streams from the tables (the lock held); the streams go into `gone`, to be closed once the
 * lock is let go (their work may need it). */
static void forget_context(vs_context *ctx, vs_vec *gone)
{
    for (size_t i = 0; i < vs_rt.streams.count;) {
        vs_stream *s = VS_AT(vs_rt.streams, vs_stream *, i);
        if (s->context == ctx->handle) {
            vs_vec_remove(&vs_rt.streams, i);
            *(vs_stream **)vs_vec_push(gone, sizeof(vs_stream *)) = s;
        } else {
            i++;
        }
    }
    for (size_t i = 0; i < vs_rt.contexts.count; i++)
        if (VS_AT(vs_rt.contexts, vs_context *, i) == ctx) {
            vs_vec_remove(&vs_rt.contexts, i);
            break;
        }
    if (ctx->stream != NULL)
        *(vs_stream **)vs_vec_push(gone, sizeof(vs_stream *)) = ctx->stream;
    free(ctx);
}

static void close_all(vs_vec *gone)
{
    for (size_t i = 0; i < gone->count; i++)
        vs_stream_close(VS_AT(*gone, vs_stream *, i), false);
    free(gone->items);
}

VS_API aclError aclrtSetDevice(int32_t deviceId)
{
    START("aclrtSetDevice");
    if (vs_device_id(&err, deviceId))
        return vs_raise(&err, "aclrtSetDevice");
    vs_lock();
    vs_rt.device_refs[deviceId]++;
    vs_context *c = default_context(deviceId);
    if (c == NULL)
        c = new_context(deviceId, true);
    if (c != NULL)
        current_ctx = c->handle;
    vs_unlock();
    if (c == NULL)
        return vs_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, "aclrtSetDevice", "out of memory");
    return ACL_SUCCESS;
}

static aclError reset(int32_t deviceId, bool force, const char *call)
{
    START(call);
    if (vs_device_id(&err, deviceId))
        return vs_raise(&err, call);
    vs_vec gone = {NULL, 0, 0, sizeof(vs_stream *)};
    vs_lock();
    int refs = force ? 0 : vs_rt.device_refs[deviceId] - 1;
    vs_rt.device_refs[deviceId] = refs < 0 ? 0 : refs;
    if (vs_rt.device_refs[deviceId] == 0) {
        vs_context *c = default_context(deviceId);
        if (c != NULL)
            forget_context(c, &gone);
    }
    vs_unlock();
    close_all(&gone);
    return ACL_SUCCESS;
}

VS_API aclError aclrtResetDevice(int32_t deviceId)
{
    return reset(deviceId, false, "aclrtResetDevice");
}

VS_API aclError aclrtResetDeviceForce(int32_t deviceId)
{
    return reset(deviceId, true, "aclrtResetDeviceForce");
}

VS_API aclError aclrtGetDevice(int32_t *deviceId)
{
    START("aclrtGetDevice");
    if (deviceId == NULL)
        return vs_fail(ACL_ERROR_INVALID_PARAM, "aclrtGetDevice", "deviceId is NULL");
    int d = 0;
    if (vs_current_device(&err, &d))
        return vs_raise(&err, "aclrtGetDevice");
    *deviceId = d;
    return ACL_SUCCESS;
}

VS_API aclError aclrtGetDeviceCount(uint32_t *count)
{
    START("aclrtGetDeviceCount");
    if (count == NULL)
        return vs_fail(ACL_ERROR_INVALID_PARAM, "aclrtGetDeviceCount", "count is NULL");
    if (vs_rt.config.visible_error[0])
        return vs_fail(ACL_ERROR_RT_NO_DEVICE, "aclrtGetDeviceCount", "ASCEND_RT_VISIBLE_DEVICES='%s' is invalid: %s",
                       vs_rt.config.visible_text, vs_rt.config.visible_error);
    *count = (uint32_t)visible_count();
    return ACL_SUCCESS;
}

VS_API aclError aclrtGetRunMode(aclrtRunMode *runMode)
{
    if (runMode == NULL)
        return vs_fail(ACL_ERROR_INVALID_PARAM, "aclrtGetRunMode", "runMode is NULL");
    *runMode = ACL_HOST;
    return ACL_SUCCESS;
}

VS_API aclError aclrtCreateContext(aclrtContext *context, int32_t deviceId)
{
    START("aclrtCreateContext");
    if (context == NULL)
        return vs_fail(ACL_ERROR_INVALID_PARAM, "aclrtCreateContext", "context is NULL");
    if (vs_device_id(&err, deviceId))
        return vs_raise(&err, "aclrtCreateContext");
    vs_lock();
    vs_context *c = new_context(deviceId, false);
    if (c != NULL)
        current_ctx = c->handle;
    vs_unlock();
    if (c == NULL)
        return vs_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, "aclrtCreateContext", "out of memory");
    *context = (aclrtContext)(uintptr_t)c->handle;
    return ACL_SUCCESS;
}

VS_API aclError aclrtDestroyContext(aclrtContext context)
{
    START("aclrtDestroyContext");
    if (context == NULL)
        return vs_fail(ACL_ERROR_INVALID_PARAM, "aclrtDestroyContext", "context is NULL");
    uint64_t h = (uintptr_t)context;
    vs_vec gone = {NULL, 0, 0, sizeof(vs_stream *)};
    vs_lock();
    vs_context *c = context_of(h);
    aclError rc = ACL_SUCCESS;
    if (c == NULL)
        rc = vs_fail(ACL_ERROR_RT_INVALID_HANDLE, "aclrtDestroyContext",
                     "context %#llx is not a live context of this process", (unsigned long long)h);
    else if (c->is_default)
        rc = vs_fail(ACL_ERROR_RT_PARAM_INVALID, "aclrtDestroyContext",
                     "context %#llx is device %d's default context: aclrtResetDevice releases it, "
                     "aclrtDestroyContext only those aclrtCreateContext made", (unsigned long long)h, c->device);
    else
        forget_context(c, &gone);
    vs_unlock();
    close_all(&gone);
    return rc;
}

VS_API aclError aclrtSetCurrentContext(aclrtContext context)
{
    START("aclrtSetCurrentContext");
    if (context == NULL)
        return vs_fail(ACL_ERROR_INVALID_PARAM, "aclrtSetCurrentContext", "context is NULL");
    uint64_t h = (uintptr_t)context;
    vs_lock();
    vs_context *c = context_of(h);
    if (c != NULL)
        current_ctx = h;
    vs_unlock();
    if (c == NULL)
        return vs_fail(ACL_ERROR_RT_INVALID_HANDLE, "aclrtSetCurrentContext",
                       "context %#llx is not a live context of this process", (unsigned long long)h);
    return ACL_SUCCESS;
}

VS_API aclError aclrtGetCurrentContext(aclrtContext *context)
{
    START("aclrtGetCurrentContext");
    if (context == NULL)
        return vs_fail(ACL_ERROR_INVALID_PARAM, "aclrtGetCurrentContext", "context is NULL");
    vs_lock();
    vs_context *c = current_context();
    uint64_t h = c != NULL ? c->handle : 0;
    vs_unlock();
    if (c == NULL)
        return vs_fail(ACL_ERROR_RT_CONTEXT_NULL, "aclrtGetCurrentContext",
                       "no current context in this thread: call aclrtSetDevice(id) (or aclrtCreateContext) first");
    *context = (aclrtContext)(uintptr_t)h;
    return ACL_SUCCESS;
}

/* ---------------------------------------------------------------- streams */

/* The live stream `stream` (0: the current context's default stream); with `here`, it must belong to the
 * current context when the thread has one (107003 otherwise). The caller holds the lock. */
vs_stream *vs_stream_of(vs_err *err, uint64_t stream, bool here)
{
    vs_context *cur = current_context();
    if (stream == 0) {
        if (cur == NULL) {
            vs_set(err, ACL_ERROR_RT_CONTEXT_NULL,
                   "no current context in this thread: call aclrtSetDevice(id) (or aclrtCreateContext) first");
            return NULL;
        }
        if (cur->stream == NULL) {
            cur->stream = vs_stream_new(0, cur->handle, cur->device);
            if (cur->stream == NULL) {
                vs_set(err, ACL_ERROR_RT_MEMORY_ALLOCATION, "out of memory");
                return NULL;
            }
        }
        return cur->stream;
    }
    for (size_t i = 0; i < vs_rt.streams.count; i++) {
        vs_stream *s = VS_AT(vs_rt.streams, vs_stream *, i);
        if (s->handle != stream)
            continue;
        if (here && cur != NULL && s->context != cur->handle) {
            vs_set(err, ACL_ERROR_RT_STREAM_CONTEXT,
                   "stream %#llx belongs to context %#llx, but context %#llx is current in this thread: "
                   "aclrtSetCurrentContext first", (unsigned long long)stream, (unsigned long long)s->context,
                   (unsigned long long)cur->handle);
            return NULL;
        }
        return s;
    }
    vs_set(err, ACL_ERROR_RT_INVALID_HANDLE, "stream %#llx is not a live stream of this process",
           (unsigned long long)stream);
    return NULL;
}

VS_API aclError aclrtCreateStream(aclrtStream *stream)
{
    START("aclrtCreateStream");
    if (stream == NULL)
        return vs_fail(ACL_ERROR_INVALID_PARAM, "aclrtCreateStream", "stream is NULL");
    vs_lock();
    vs_context *c = current_context();
    vs_stream *s = c != NULL ? vs_stream_new(0x57000000ULL + vs_rt.next_id++, c->handle, c->device) : NULL;
    if (s != NULL)
        *(vs_stream **)vs_vec_push(&vs_rt.streams, sizeof(vs_stream *)) = s;
    vs_unlock();
    if (c == NULL)
        return vs_fail(ACL_ERROR_RT_CONTEXT_NULL, "aclrtCreateStream",
                       "no current context in this thread: call aclrtSetDevice(id) (or aclrtCreateContext) first");
    if (s == NULL)
        return vs_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, "aclrtCreateStream", "out of memory");
    *stream = (aclrtStream)(uintptr_t)s->handle;
    return ACL_SUCCESS;
}

/* Destroy a stream once its queued work has run (`force`: dropping what has not started, and waking a task blocked
 * in a wait, which then fails). */
static aclError destroy_stream(aclrtStream stream, bool force, const char *call)
{
    START(call);
    if (stream == NULL)
        return vs_fail(ACL_ERROR_INVALID_PARAM, call, "stream is NULL");
    vs_lock();
    vs_stream *s = vs_stream_of(&err, (uintptr_t)stream, true);
    if (s != NULL)
        for (size_t i = 0; i < vs_rt.streams.count; i++)
            if (VS_AT(vs_rt.streams, vs_stream *, i) == s) {
                vs_vec_remove(&vs_rt.streams, i);
                break;
            }
    vs_unlock();
    if (s == NULL)
        return vs_raise(&err, call);
    vs_stream_close(s, force);
    return ACL_SUCCESS;
}

VS_API aclError aclrtDestroyStream(aclrtStream stream)
{
    return destroy_stream(stream, false, "aclrtDestroyStream");
}

VS_API aclError aclrtDestroyStreamForce(aclrtStream stream)
{
    return destroy_stream(stream, true, "aclrtDestroyStreamForce");
}

static aclError sync_stream(aclrtStream stream, int32_t timeout_ms, const char *call)
{
    START(call);
    vs_lock();
    vs_stream *s = vs_stream_of(&err, (uintptr_t)stream, false);
    vs_unlock();
    return s == NULL ? vs_raise(&err, call) : vs_stream_report(s, timeout_ms, call);
}

VS_API aclError aclrtSynchronizeStream(aclrtStream stream)
{
    return sync_stream(stream, -1, "aclrtSynchronizeStream");
}

static aclError check_timeout(int32_t timeout, const char *call)
{
    if (timeout < -1 || timeout == 0)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                       "timeout=%d: a positive number of milliseconds, or -1 to wait until done", timeout);
    return ACL_SUCCESS;
}

VS_API aclError aclrtSynchronizeStreamWithTimeout(aclrtStream stream, int32_t timeout)
{
    aclError bad = check_timeout(timeout, "aclrtSynchronizeStreamWithTimeout");
    return bad ? bad : sync_stream(stream, timeout, "aclrtSynchronizeStreamWithTimeout");
}

VS_API aclError aclrtStreamQuery(aclrtStream stream, aclrtStreamStatus *status)
{
    START("aclrtStreamQuery");
    if (status == NULL)
        return vs_fail(ACL_ERROR_INVALID_PARAM, "aclrtStreamQuery", "status is NULL");
    vs_lock();
    vs_stream *s = vs_stream_of(&err, (uintptr_t)stream, false);
    if (s != NULL)
        *status = vs_stream_idle(s) ? ACL_STREAM_STATUS_COMPLETE : ACL_STREAM_STATUS_NOT_READY;
    vs_unlock();
    return s == NULL ? vs_raise(&err, "aclrtStreamQuery") : ACL_SUCCESS;
}

static aclError sync_device(int32_t timeout_ms, const char *call)
{
    START(call);
    int device = 0;
    if (vs_current_device(&err, &device))
        return vs_raise(&err, call);
    vs_vec mine = {NULL, 0, 0, sizeof(vs_stream *)};
    vs_lock();
    for (size_t i = 0; i < vs_rt.streams.count; i++) {
        vs_stream *s = VS_AT(vs_rt.streams, vs_stream *, i);
        if (s->device == device)
            *(vs_stream **)vs_vec_push(&mine, sizeof(vs_stream *)) = s;
    }
    for (size_t i = 0; i < vs_rt.contexts.count; i++) {
        vs_context *c = VS_AT(vs_rt.contexts, vs_context *, i);
        if (c->device == device && c->stream != NULL)
            *(vs_stream **)vs_vec_push(&mine, sizeof(vs_stream *)) = c->stream;
    }
    vs_unlock();
    aclError rc = ACL_SUCCESS; /* every stream is waited for; the first failure is the one reported */
    for (size_t i = 0; i < mine.count; i++) {
        aclError got = vs_stream_report(VS_AT(mine, vs_stream *, i), timeout_ms, call);
        rc = rc ? rc : got;
    }
    free(mine.items);
    return rc;
}

VS_API aclError aclrtSynchronizeDevice(void)
{
    return sync_device(-1, "aclrtSynchronizeDevice");
}

VS_API aclError aclrtSynchronizeDeviceWithTimeout(int32_t timeout)
{
    aclError bad = check_timeout(timeout, "aclrtSynchronizeDeviceWithTimeout");
    return bad ? bad : sync_device(timeout, "aclrtSynchronizeDeviceWithTimeout");
}

/* ---------------------------------------------------------------- peers */

VS_API aclError aclrtDeviceCanAccessPeer(int32_t *canAccessPeer, int32_t deviceId, int32_t peerDeviceId)
{
    START("aclrtDeviceCanAccessPeer");
    if (canAccessPeer == NULL)
        return vs_fail(ACL_ERROR_INVALID_PARAM, "aclrtDeviceCanAccessPeer", "canAccessPeer is NULL");
    if (vs_device_id(&err, deviceId) || vs_device_id(&err, peerDeviceId))
        return vs_raise(&err, "aclrtDeviceCanAccessPeer");
    int can = deviceId != peerDeviceId;
    if (can && vs_rt.config.cuda && /* the GPUs' topology says */
        vs_cuda_can_access_peer(&err, vs_logical(deviceId), vs_logical(peerDeviceId), &can))
        return vs_raise(&err, "aclrtDeviceCanAccessPeer");
    *canAccessPeer = can != 0;
    return ACL_SUCCESS;
}

/* Peer access from the current device to `peer`: both real and distinct, and (enabling, under the CUDA backend) a
 * path the GPUs' topology has. */
static aclError peer_access(int32_t peer, bool enable, const char *call)
{
    START(call);
    if (vs_device_id(&err, peer))
        return vs_raise(&err, call);
    int device = 0;
    if (vs_current_device(&err, &device))
        return vs_raise(&err, call);
    if (device == peer)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                       "device %d is the current device: peer access is between two devices", peer);
    int can = 1;
    if (enable && vs_rt.config.cuda) {
        if (vs_cuda_can_access_peer(&err, vs_logical(device), vs_logical(peer), &can))
            return vs_raise(&err, call);
        if (!can)
            return vs_fail(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, call,
                           "GPU %d cannot access GPU %d's memory (cuDeviceCanAccessPeer says no)", device, peer);
    }
    return ACL_SUCCESS;
}

VS_API aclError aclrtDeviceEnablePeerAccess(int32_t peerDeviceId, uint32_t flags)
{
    if (flags != 0)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, "aclrtDeviceEnablePeerAccess", "flags=%u is out of range [0, 0]",
                       flags);
    return peer_access(peerDeviceId, true, "aclrtDeviceEnablePeerAccess");
}

VS_API aclError aclrtDeviceDisablePeerAccess(int32_t peerDeviceId)
{
    return peer_access(peerDeviceId, false, "aclrtDeviceDisablePeerAccess");
}

/* ---------------------------------------------------------------- device ids */

static aclError node_device(int32_t device, const char *name, const char *call)
{
    if (device >= vs_rt.config.devices)
        return vs_fail(ACL_ERROR_RT_INVALID_DEVICEID, call, "%s=%d is not a device of this node: it has %d (0..%d)",
                       name, device, vs_rt.config.devices, vs_rt.config.devices - 1);
    return ACL_SUCCESS;
}

static aclError non_negative(int32_t v, const char *name, const char *call)
{
    if (v < 0)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call, "%s=%d must be greater than or equal to 0", name, v);
    return ACL_SUCCESS;
}

static aclError visible_summary_fail(const char *what, int32_t id, const char *call)
{
    vs_config *c = &vs_rt.config;
    if (c->visible_error[0])
        return vs_fail(ACL_ERROR_RT_INVALID_DEVICEID, call, "%s %d is not visible: ASCEND_RT_VISIBLE_DEVICES='%s' is "
                       "invalid (%s)", what, id, c->visible_text, c->visible_error);
    return vs_fail(ACL_ERROR_RT_INVALID_DEVICEID, call, "%s %d is not visible: ASCEND_RT_VISIBLE_DEVICES='%s' makes "
                   "%d node devices visible as 0..%d", what, id, c->visible_text, c->nvisible, c->nvisible - 1);
}

static aclError logic_of_user(int32_t user, int32_t *out, const char *call)
{
    aclError rc = non_negative(user, "userDevId", call);
    if (rc)
        return rc;
    vs_config *c = &vs_rt.config;
    if (c->nvisible >= 0) {
        if (c->visible_error[0] || user >= c->nvisible)
            return visible_summary_fail("user device", user, call);
        *out = c->visible[user];
        return ACL_SUCCESS;
    }
    rc = node_device(user, "logicDevId", call);
    if (rc == ACL_SUCCESS)
        *out = user;
    return rc;
}

static aclError user_of_logic(int32_t logic, int32_t *out, const char *call)
{
    aclError rc = non_negative(logic, "logicDevId", call);
    if (rc == ACL_SUCCESS)
        rc = node_device(logic, "logicDevId", call);
    if (rc)
        return rc;
    vs_config *c = &vs_rt.config;
    if (c->nvisible < 0) {
        *out = logic;
        return ACL_SUCCESS;
    }
    for (int i = 0; i < c->nvisible && !c->visible_error[0]; i++)
        if (c->visible[i] == logic) {
            *out = i;
            return ACL_SUCCESS;
        }
    return visible_summary_fail("node device", logic, call);
}

#define ID_CALL(name, out_name)                                                 \
    START(#name);                                                               \
    if (out_name == NULL)                                                       \
        return vs_fail(ACL_ERROR_INVALID_PARAM, #name, #out_name " is NULL");

VS_API aclError aclrtGetLogicDevIdByUserDevId(const int32_t userDevid, int32_t *const logicDevId)
{
    ID_CALL(aclrtGetLogicDevIdByUserDevId, logicDevId);
    return logic_of_user(userDevid, logicDevId, "aclrtGetLogicDevIdByUserDevId");
}

VS_API aclError aclrtGetUserDevIdByLogicDevId(const int32_t logicDevId, int32_t *const userDevid)
{
    ID_CALL(aclrtGetUserDevIdByLogicDevId, userDevid);
    return user_of_logic(logicDevId, userDevid, "aclrtGetUserDevIdByLogicDevId");
}

VS_API aclError aclrtGetPhyDevIdByLogicDevId(const int32_t logicDevId, int32_t *const phyDevId)
{
    ID_CALL(aclrtGetPhyDevIdByLogicDevId, phyDevId);
    const char *call = "aclrtGetPhyDevIdByLogicDevId";
    aclError rc = non_negative(logicDevId, "logicDevId", call);
    if (rc)
        return rc;
    if (vs_rt.config.nvisible >= 0)
        return logic_of_user(logicDevId, phyDevId, call);
    rc = node_device(logicDevId, "logicDevId", call);
    if (rc == ACL_SUCCESS)
        *phyDevId = logicDevId;
    return rc;
}

VS_API aclError aclrtGetLogicDevIdByPhyDevId(const int32_t phyDevId, int32_t *const logicDevId)
{
    ID_CALL(aclrtGetLogicDevIdByPhyDevId, logicDevId);
    const char *call = "aclrtGetLogicDevIdByPhyDevId";
    aclError rc = non_negative(phyDevId, "phyDevId", call);
    if (rc == ACL_SUCCESS)
        rc = node_device(phyDevId, "phyDevId", call);
    return rc ? rc : user_of_logic(phyDevId, logicDevId, call);
}

/* A name-based (SHA-1) uuid of "<server id>/<node device>" in vmmshare's namespace: the Python runtime's. */
VS_API aclError aclrtDeviceGetUuid(int32_t deviceId, void *uuid)
{
    START("aclrtDeviceGetUuid");
    if (uuid == NULL)
        return vs_fail(ACL_ERROR_INVALID_PARAM, "aclrtDeviceGetUuid", "uuid is NULL");
    if (deviceId < 0)
        return vs_fail(ACL_ERROR_RT_INVALID_DEVICEID, "aclrtDeviceGetUuid",
                       "deviceId=%d must be greater than or equal to 0", deviceId);
    if (vs_device_id(&err, deviceId))
        return vs_raise(&err, "aclrtDeviceGetUuid");
    static const uint8_t space[16] = {0x6c, 0x1d, 0x3f, 0x0e, 0x5a, 0x4b, 0x4e, 0x8e,
                                      0x9d, 0x7a, 0x76, 0x6d, 0x6d, 0x73, 0x68, 0x72};
    uint8_t buf[16 + 32], digest[20];
    memcpy(buf, space, 16);
    int n = snprintf((char *)buf + 16, 32, "%08x/%d", vs_rt.config.server_id, vs_logical(deviceId));
    vs_sha1(buf, 16 + (size_t)n, digest);
    digest[6] = (uint8_t)((digest[6] & 0x0F) | 0x50);
    digest[8] = (uint8_t)((digest[8] & 0x3F) | 0x80);
    memcpy(uuid, digest, 16);
    return ACL_SUCCESS;
}
