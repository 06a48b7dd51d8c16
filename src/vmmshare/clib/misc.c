/*
 * The process-wide calls (aclInit, aclFinalize, versions, the backend's name, half-precision conversions, the
 * application log) and the stand-ins of the synchronisation calls (events, notifies), which this release answers
 * with 207000 as the Python surface does.
 */
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "stubs.h"

#define WHY "is not supported by vmmshare in this release, which provides the runtime's device, memory, stream and " \
            "sharing calls (see docs/c.md)"

aclError vs_stand_in(const char *call)
{
    return vs_fail(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, call, "%s " WHY, call);
}

void *vs_stand_in_value(const char *call)
{
    vs_fail(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, call, "%s " WHY, call);
    return NULL;
}

VS_API aclError aclInit(const char *configPath)
{
    const char *call = "aclInit";
    vs_err err;
    if (vs_start(&err))
        return vs_raise(&err, call);
    vs_lock();
    bool again = vs_rt.initialized;
    vs_unlock();
    if (again)
        return vs_fail(ACL_ERROR_REPEAT_INITIALIZE, call, "aclInit was called already: call aclFinalize first");
    if (configPath != NULL && configPath[0] != '\0') {
        struct stat st;
        if (stat(configPath, &st) != 0 || !S_ISREG(st.st_mode))
            return vs_fail(ACL_ERROR_INVALID_FILE, call, "config file '%s' does not exist", configPath);
        FILE *f = fopen(configPath, "re");
        if (f == NULL)
            return vs_fail(ACL_ERROR_INVALID_FILE, call, "config file '%s' cannot be read", configPath);
        /* a JSON object is expected; vmmshare reads none of its keys, so only its outer shape is checked */
        int c, first = 0, last = 0;
        while ((c = fgetc(f)) != EOF)
            if (c != ' ' && c != '\n' && c != '\t' && c != '\r') {
                if (!first)
                    first = c;
                last = c;
            }
        fclose(f);
        if (first && !((first == '{' && last == '}') || (first == '[' && last == ']')))
            return vs_fail(ACL_ERROR_INVALID_FILE, call, "config file '%s' is not valid JSON", configPath);
    }
    vs_lock();
    vs_rt.initialized = true;
    vs_unlock();
    return ACL_SUCCESS;
}

VS_API aclError aclFinalize(void)
{
    vs_err err;
    if (vs_start(&err))
        return vs_raise(&err, "aclFinalize");
    vs_lock();
    bool was = vs_rt.initialized;
    vs_rt.initialized = false;
    vs_unlock();
    if (!was)
        return vs_fail(ACL_ERROR_REPEAT_FINALIZE, "aclFinalize", "aclFinalize without a matching aclInit");
    return ACL_SUCCESS;
}

VS_API aclError aclrtGetVersion(int32_t *majorVersion, int32_t *minorVersion, int32_t *patchVersion)
{
    if (majorVersion == NULL || minorVersion == NULL || patchVersion == NULL)
        return vs_fail(ACL_ERROR_INVALID_PARAM, "aclrtGetVersion", "a version pointer is NULL");
    *majorVersion = ACL_MAJOR_VERSION;
    *minorVersion = ACL_MINOR_VERSION;
    *patchVersion = ACL_PATCH_VERSION;
    return ACL_SUCCESS;
}

/* What holds the C library's device memory: the GPUs under VMMSHARE_BACKEND=cuda, else host memory (never NULL). */
VS_API const char *aclrtGetSocName(void)
{
    vs_err err;
    if (vs_start(&err))
        vs_raise(&err, "aclrtGetSocName");
    return vs_rt.config.cuda ? "vmmshare-cuda" : "vmmshare-host";
}

VS_API float aclFloat16ToFloat(aclFloat16 value)
{
    uint32_t sign = (uint32_t)(value >> 15) << 31, exp = (value >> 10) & 0x1F, man = value & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise it */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) {
                man <<= 1;
                exp--;
            }
            bits = sign | exp << 23 | (man & 0x3FF) << 13;
        }
    } else if (exp == 0x1F) {
        bits = sign | 0x7F800000u | man << 13;
    } else {
        bits = sign | (exp + 127 - 15) << 23 | man << 13;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

VS_API aclFloat16 aclFloatToFloat16(float value)
{
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    uint32_t sign = (bits >> 16) & 0x8000;
    int32_t exp = (int32_t)((bits >> 23) & 0xFF);
    uint32_t man = bits & 0x7FFFFF;
    if (exp == 0xFF)
        return (aclFloat16)(sign | 0x7C00 | (man ? 0x200 : 0));
    int32_t e = exp - 127 + 15;
    if (e >= 0x1F)
        return (aclFloat16)(sign | 0x7C00); /* out of range: infinity */
    if (e <= 0) {
        if (e < -10)
            return (aclFloat16)sign;
        man |= 0x800000;
        uint32_t shift = (uint32_t)(14 - e);
        uint32_t half = man >> shift, rest = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rest > mid || (rest == mid && (half & 1)))
            half++;
        return (aclFloat16)(sign | half);
    }
    uint32_t half = sign | (uint32_t)e << 10 | man >> 13, rest = man & 0x1FFF;
    if (rest > 0x1000 || (rest == 0x1000 && (half & 1)))
        half++; /* round to nearest even (a carry into the exponent is right) */
    return (aclFloat16)half;
}

VS_API void aclAppLog(aclLogLevel logLevel, const char *func, const char *file, uint32_t line, const char *fmt, ...)
{
    static const char *const names[] = {"DEBUG", "INFO", "WARNING", "ERROR"};
    const char *level = (unsigned)logLevel < 4 ? names[logLevel] : "INFO";
    char text[1024] = "";
    if (fmt != NULL) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(text, sizeof text, fmt, ap);
        va_end(ap);
    }
    fprintf(stderr, "[%s] %s:%u %s: %s\n", level, file ? file : "?", line, func ? func : "?", text);
}

/* ---------------------------------------------------------------- event calls not provided: 207000, as in Python */

#pragma GCC diagnostic ignored "-Wunused-parameter" /* a stand-in reads none of its arguments */

#define STAND_IN(name, ...) \
    VS_API aclError name(__VA_ARGS__) { return vs_stand_in(#name); }

STAND_IN(aclrtResetEvent, aclrtEvent event, aclrtStream stream)
STAND_IN(aclrtQueryEvent, aclrtEvent event, aclrtEventStatus *status)
