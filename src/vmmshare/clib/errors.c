/*
 * Each thread's last failure: its message (aclGetRecentErrMsg) and its code (aclrtPeekAtLastError,
 * aclrtGetLastError), as the runtime keeps them per thread.
 */
#include <stdio.h>
#include <string.h>

#include "vs.h"

static _Thread_local char recent[1024];
static _Thread_local aclError last_code;

aclError vs_fail(aclError code, const char *call, const char *fmt, ...)
{
    int n = snprintf(recent, sizeof recent, "%s: ", call);
    if (n < 0 || (size_t)n >= sizeof recent)
        n = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(recent + n, sizeof recent - (size_t)n, fmt, ap);
    va_end(ap);
    last_code = code;
    return code;
}

aclError vs_set(vs_err *err, aclError code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
    err->code = code;
    return code;
}

aclError vs_raise(const vs_err *err, const char *call)
{
    return vs_fail(err->code, call, "%s", err->message);
}

VS_API const char *aclGetRecentErrMsg(void)
{
    return recent;
}

static aclError level_check(aclrtLastErrLevel level, const char *call)
{
    if ((int)level != ACL_RT_THREAD_LEVEL)
        return vs_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                       "level=%d: the last error is kept per thread (ACL_RT_THREAD_LEVEL, 0)", (int)level);
    return ACL_SUCCESS;
}

VS_API aclError aclrtPeekAtLastError(aclrtLastErrLevel level)
{
    aclError bad = level_check(level, "aclrtPeekAtLastError");
    return bad ? bad : last_code;
}

VS_API aclError aclrtGetLastError(aclrtLastErrLevel level)
{
    aclError bad = level_check(level, "aclrtGetLastError");
    if (bad)
        return bad;
    aclError code = last_code;
    last_code = 0;
    return code;
}
