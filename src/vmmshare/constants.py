"""ACL constants with the real runtime's names and values: error codes, VMM enums, flags and sizes."""

from __future__ import annotations

# Sources (CANN 8.x public headers, as published in the open-source runtime):
#   acl/acl_base_rt.h (included by acl_base.h)  general aclError codes
#   acl/error_codes/rt_error_codes.h            ACL_ERROR_RT_* runtime codes
#   acl/acl_rt.h                                aclrt* enums and flags
# Every value below agrees with SPEC.md §3; where SPEC.md names a constant it is the authority.

# ---------------------------------------------------------------------------
# Success (acl_base_rt.h, rt_error_codes.h)
# ---------------------------------------------------------------------------
ACL_SUCCESS = 0
ACL_ERROR_NONE = 0
ACL_RT_SUCCESS = 0

# ---------------------------------------------------------------------------
# aclError general codes (acl_base_rt.h)
# ---------------------------------------------------------------------------
ACL_ERROR_INVALID_EXCEPTION_INFO = -1

# 1000xx / 148xxx: parameter and usage errors
ACL_ERROR_INVALID_PARAM = 100000
ACL_ERROR_UNINITIALIZE = 100001
ACL_ERROR_REPEAT_INITIALIZE = 100002
ACL_ERROR_INVALID_FILE = 100003
ACL_ERROR_WRITE_FILE = 100004
ACL_ERROR_INVALID_FILE_SIZE = 100005
ACL_ERROR_PARSE_FILE = 100006
ACL_ERROR_FILE_MISSING_ATTR = 100007
ACL_ERROR_FILE_ATTR_INVALID = 100008
ACL_ERROR_INVALID_DUMP_CONFIG = 100009
ACL_ERROR_INVALID_PROFILING_CONFIG = 100010
ACL_ERROR_INVALID_MODEL_ID = 100011
ACL_ERROR_DESERIALIZE_MODEL = 100012
ACL_ERROR_PARSE_MODEL = 100013
ACL_ERROR_READ_MODEL_FAILURE = 100014
ACL_ERROR_MODEL_SIZE_INVALID = 100015
ACL_ERROR_MODEL_MISSING_ATTR = 100016
ACL_ERROR_MODEL_INPUT_NOT_MATCH = 100017
ACL_ERROR_MODEL_OUTPUT_NOT_MATCH = 100018
ACL_ERROR_MODEL_NOT_DYNAMIC = 100019
ACL_ERROR_OP_TYPE_NOT_MATCH = 100020
ACL_ERROR_OP_INPUT_NOT_MATCH = 100021
ACL_ERROR_OP_OUTPUT_NOT_MATCH = 100022
ACL_ERROR_OP_ATTR_NOT_MATCH = 100023
ACL_ERROR_OP_NOT_FOUND = 100024
ACL_ERROR_OP_LOAD_FAILED = 100025
ACL_ERROR_UNSUPPORTED_DATA_TYPE = 100026
ACL_ERROR_FORMAT_NOT_MATCH = 100027
ACL_ERROR_BIN_SELECTOR_NOT_REGISTERED = 100028
ACL_ERROR_KERNEL_NOT_FOUND = 100029
ACL_ERROR_BIN_SELECTOR_ALREADY_REGISTERED = 100030
ACL_ERROR_KERNEL_ALREADY_REGISTERED = 100031
ACL_ERROR_INVALID_QUEUE_ID = 100032
ACL_ERROR_REPEAT_SUBSCRIBE = 100033
ACL_ERROR_STREAM_NOT_SUBSCRIBE = 100034
ACL_ERROR_THREAD_NOT_SUBSCRIBE = 100035
ACL_ERROR_WAIT_CALLBACK_TIMEOUT = 100036
ACL_ERROR_REPEAT_FINALIZE = 100037
ACL_ERROR_NOT_STATIC_AIPP = 100038
ACL_ERROR_COMPILING_STUB_MODE = 100039
ACL_ERROR_GROUP_NOT_SET = 100040
ACL_ERROR_GROUP_NOT_CREATE = 100041
ACL_ERROR_PROF_ALREADY_RUN = 100042
ACL_ERROR_PROF_NOT_RUN = 100043
ACL_ERROR_DUMP_ALREADY_RUN = 100044
ACL_ERROR_DUMP_NOT_RUN = 100045
ACL_ERROR_PROF_REPEAT_SUBSCRIBE = 148046
ACL_ERROR_PROF_API_CONFLICT = 148047
ACL_ERROR_INVALID_MAX_OPQUEUE_NUM_CONFIG = 148048
ACL_ERROR_INVALID_OPP_PATH = 148049
ACL_ERROR_OP_UNSUPPORTED_DYNAMIC = 148050
ACL_ERROR_RELATIVE_RESOURCE_NOT_CLEARED = 148051
ACL_ERROR_UNSUPPORTED_JPEG = 148052
ACL_ERROR_INVALID_BUNDLE_MODEL_ID = 148053

# 2000xx: resource errors
ACL_ERROR_BAD_ALLOC = 200000
ACL_ERROR_API_NOT_SUPPORT = 200001
ACL_ERROR_INVALID_DEVICE = 200002
ACL_ERROR_MEMORY_ADDRESS_UNALIGNED = 200003
ACL_ERROR_RESOURCE_NOT_MATCH = 200004
ACL_ERROR_INVALID_RESOURCE_HANDLE = 200005
ACL_ERROR_FEATURE_UNSUPPORTED = 200006
ACL_ERROR_PROF_MODULES_UNSUPPORTED = 200007

# 300000: storage
ACL_ERROR_STORAGE_OVER_LIMIT = 300000

# 5000xx: internal errors
ACL_ERROR_INTERNAL_ERROR = 500000
ACL_ERROR_FAILURE = 500001
ACL_ERROR_GE_FAILURE = 500002
ACL_ERROR_RT_FAILURE = 500003
ACL_ERROR_DRV_FAILURE = 500004
ACL_ERROR_PROFILING_FAILURE = 500005

# ---------------------------------------------------------------------------
# Runtime error codes (error_codes/rt_error_codes.h)
# A few entries of that header carry no "RT_" in their names; they are kept as spelled there.
# ---------------------------------------------------------------------------
# 107xxx: parameter / state errors
ACL_ERROR_RT_PARAM_INVALID = 107000
ACL_ERROR_RT_INVALID_DEVICEID = 107001
ACL_ERROR_RT_CONTEXT_NULL = 107002
ACL_ERROR_RT_STREAM_CONTEXT = 107003
ACL_ERROR_RT_MODEL_CONTEXT = 107004
ACL_ERROR_RT_STREAM_MODEL = 107005
ACL_ERROR_RT_EVENT_TIMESTAMP_INVALID = 107006
ACL_ERROR_RT_EVENT_TIMESTAMP_REVERSAL = 107007
ACL_ERROR_RT_ADDR_UNALIGNED = 107008
ACL_ERROR_RT_FILE_OPEN = 107009
ACL_ERROR_RT_FILE_WRITE = 107010
ACL_ERROR_RT_STREAM_SUBSCRIBE = 107011
ACL_ERROR_RT_THREAD_SUBSCRIBE = 107012
ACL_ERROR_RT_GROUP_NOT_SET = 107013
ACL_ERROR_RT_GROUP_NOT_CREATE = 107014
ACL_ERROR_RT_STREAM_NO_CB_REG = 107015
ACL_ERROR_RT_INVALID_MEMORY_TYPE = 107016
ACL_ERROR_RT_INVALID_HANDLE = 107017
ACL_ERROR_RT_INVALID_MALLOC_TYPE = 107018
ACL_ERROR_RT_WAIT_TIMEOUT = 107019
ACL_ERROR_RT_TASK_TIMEOUT = 107020
ACL_ERROR_RT_SYSPARAMOPT_NOT_SET = 107021
ACL_ERROR_RT_DEVICE_TASK_ABORT = 107022
ACL_ERROR_RT_STREAM_ABORT = 107023
ACL_ERROR_RT_CAPTURE_DEPENDENCY = 107024
ACL_ERROR_RT_STREAM_UNJOINED = 107025
ACL_ERROR_RT_MODEL_CAPTURED = 107026
ACL_ERROR_RT_STREAM_CAPTURED = 107027
ACL_ERROR_RT_EVENT_CAPTURED = 107028
ACL_ERROR_RT_STREAM_NOT_CAPTURED = 107029
ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT = 107030
ACL_ERROR_RT_STREAM_CAPTURE_IMPLICIT = 107031
ACL_ERROR_STREAM_CAPTURE_CONFLICT = 107032
ACL_ERROR_STREAM_TASK_GROUP_STATUS = 107033
ACL_ERROR_STREAM_TASK_GROUP_INTR = 107034
ACL_ERROR_RT_TASK_ABORT_STOP = 107035
ACL_ERROR_RT_STREAM_CAPTURE_UNMATCHED = 107036
ACL_ERROR_RT_MODEL_RUNNING = 107037
ACL_ERROR_RT_STREAM_CAPTURE_WRONG_THREAD = 107038
ACL_ERROR_RT_INSUFFICIENT_INPUT_ARRAY = 107039
ACL_ERROR_RT_MODEL_UPDATE_FAILED = 107040
ACL_ERROR_RT_CAPTURE_MODE_BLOCK_ASYNC = 107041

# 207xxx: resource / capability errors
ACL_ERROR_RT_FEATURE_NOT_SUPPORT = 207000
ACL_ERROR_RT_MEMORY_ALLOCATION = 207001
ACL_ERROR_RT_MEMORY_FREE = 207002
ACL_ERROR_RT_AICORE_OVER_FLOW = 207003
ACL_ERROR_RT_NO_DEVICE = 207004
ACL_ERROR_RT_RESOURCE_ALLOC_FAIL = 207005
ACL_ERROR_RT_NO_PERMISSION = 207006
ACL_ERROR_RT_NO_EVENT_RESOURCE = 207007
ACL_ERROR_RT_NO_STREAM_RESOURCE = 207008
ACL_ERROR_RT_NO_NOTIFY_RESOURCE = 207009
ACL_ERROR_RT_NO_MODEL_RESOURCE = 207010
ACL_ERROR_RT_NO_CDQ_RESOURCE = 207011
ACL_ERROR_RT_OVER_LIMIT = 207012
ACL_ERROR_RT_QUEUE_EMPTY = 207013
ACL_ERROR_RT_QUEUE_FULL = 207014
ACL_ERROR_RT_REPEATED_INIT = 207015
ACL_ERROR_RT_AIVEC_OVER_FLOW = 207016
ACL_ERROR_RT_OVER_FLOW = 207017
ACL_ERROR_RT_DEVICE_OOM = 207018
ACL_ERROR_RT_FEATURE_NOT_SUPPORT_UPDATE_OP = 207019
ACL_ERROR_RT_TIMEOUT = 207020

# 507xxx: internal / device / driver errors
ACL_ERROR_RT_INTERNAL_ERROR = 507000
ACL_ERROR_RT_TS_ERROR = 507001
ACL_ERROR_RT_STREAM_TASK_FULL = 507002
ACL_ERROR_RT_STREAM_TASK_EMPTY = 507003
ACL_ERROR_RT_STREAM_NOT_COMPLETE = 507004
ACL_ERROR_RT_END_OF_SEQUENCE = 507005
ACL_ERROR_RT_EVENT_NOT_COMPLETE = 507006
ACL_ERROR_RT_CONTEXT_RELEASE_ERROR = 507007
ACL_ERROR_RT_SOC_VERSION = 507008
ACL_ERROR_RT_TASK_TYPE_NOT_SUPPORT = 507009
ACL_ERROR_RT_LOST_HEARTBEAT = 507010
ACL_ERROR_RT_MODEL_EXECUTE = 507011
ACL_ERROR_RT_REPORT_TIMEOUT = 507012
ACL_ERROR_RT_SYS_DMA = 507013
ACL_ERROR_RT_AICORE_TIMEOUT = 507014
ACL_ERROR_RT_AICORE_EXCEPTION = 507015
ACL_ERROR_RT_AICORE_TRAP_EXCEPTION = 507016
ACL_ERROR_RT_AICPU_TIMEOUT = 507017
ACL_ERROR_RT_AICPU_EXCEPTION = 507018
ACL_ERROR_RT_AICPU_DATADUMP_RSP_ERR = 507019
ACL_ERROR_RT_AICPU_MODEL_RSP_ERR = 507020
ACL_ERROR_RT_PROFILING_ERROR = 507021
ACL_ERROR_RT_IPC_ERROR = 507022
ACL_ERROR_RT_MODEL_ABORT_NORMAL = 507023
ACL_ERROR_RT_KERNEL_UNREGISTERING = 507024
ACL_ERROR_RT_RINGBUFFER_NOT_INIT = 507025
ACL_ERROR_RT_RINGBUFFER_NO_DATA = 507026
ACL_ERROR_RT_KERNEL_LOOKUP = 507027
ACL_ERROR_RT_KERNEL_DUPLICATE = 507028
ACL_ERROR_RT_DEBUG_REGISTER_FAIL = 507029
ACL_ERROR_RT_DEBUG_UNREGISTER_FAIL = 507030
ACL_ERROR_RT_LABEL_CONTEXT = 507031
ACL_ERROR_RT_PROGRAM_USE_OUT = 507032
ACL_ERROR_RT_DEV_SETUP_ERROR = 507033
ACL_ERROR_RT_VECTOR_CORE_TIMEOUT = 507034
ACL_ERROR_RT_VECTOR_CORE_EXCEPTION = 507035
ACL_ERROR_RT_VECTOR_CORE_TRAP_EXCEPTION = 507036
ACL_ERROR_RT_CDQ_BATCH_ABNORMAL = 507037
ACL_ERROR_RT_DIE_MODE_CHANGE_ERROR = 507038
ACL_ERROR_RT_DIE_SET_ERROR = 507039
ACL_ERROR_RT_INVALID_DIEID = 507040
ACL_ERROR_RT_DIE_MODE_NOT_SET = 507041
ACL_ERROR_RT_AICORE_TRAP_READ_OVERFLOW = 507042
ACL_ERROR_RT_AICORE_TRAP_WRITE_OVERFLOW = 507043
ACL_ERROR_RT_VECTOR_CORE_TRAP_READ_OVERFLOW = 507044
ACL_ERROR_RT_VECTOR_CORE_TRAP_WRITE_OVERFLOW = 507045
ACL_ERROR_RT_STREAM_SYNC_TIMEOUT = 507046
ACL_ERROR_RT_EVENT_SYNC_TIMEOUT = 507047
ACL_ERROR_RT_FFTS_PLUS_TIMEOUT = 507048
ACL_ERROR_RT_FFTS_PLUS_EXCEPTION = 507049
ACL_ERROR_RT_FFTS_PLUS_TRAP_EXCEPTION = 507050
ACL_ERROR_RT_SEND_MSG = 507051
ACL_ERROR_RT_COPY_DATA = 507052
ACL_ERROR_RT_DEVICE_MEM_ERROR = 507053
ACL_ERROR_RT_HBM_MULTI_BIT_ECC_ERROR = 507054
ACL_ERROR_RT_SUSPECT_DEVICE_MEM_ERROR = 507055
ACL_ERROR_RT_LINK_ERROR = 507056
ACL_ERROR_RT_SUSPECT_REMOTE_ERROR = 507057
ACL_ERROR_RT_DRV_INTERNAL_ERROR = 507899
ACL_ERROR_RT_AICPU_INTERNAL_ERROR = 507900
ACL_ERROR_RT_SOCKET_CLOSE = 507901
ACL_ERROR_RT_AICPU_INFO_LOAD_RSP_ERR = 507902
ACL_ERROR_RT_STREAM_CAPTURE_INVALIDATED = 507903
ACL_ERROR_RT_COMM_OP_RETRY_FAIL = 507904
ACL_ERROR_SNAPSHOT_LOCK_TIMEOUT = 507905
ACL_ERROR_SNAPSHOT_LOCK_FAILED = 507906
ACL_ERROR_SNAPSHOT_UNLOCK_FAILED = 507907
ACL_ERROR_SNAPSHOT_BACKUP_FAILED = 507908
ACL_ERROR_SNAPSHOT_RESTORE_FAILED = 507909
ACL_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 507910
ACL_ERROR_HOST_MEMORY_NOT_REGISTERED = 507911
ACL_ERROR_SNAPSHOT_CALLBACK_FAILED = 507912
ACL_ERROR_SNAPSHOT_REGISTER_CALLBACK_FAILED = 507913
ACL_ERROR_RT_L3_PORT_ERROR = 507914
ACL_ERROR_RT_SYMBOL_NOT_FOUND = 507915

# ---------------------------------------------------------------------------
# VMM export flags (acl_rt.h: ACL_RT_VMM_EXPORT_FLAG_*, ACL_RT_IPC_MEM_EXPORT_FLAG_*)
# ---------------------------------------------------------------------------
ACL_RT_VMM_EXPORT_FLAG_DEFAULT = 0x0
ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION = 0x1
# The IPC-memory spelling of the same bit; samples pass it to the VMM export call.
ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT = 0x0
ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION = 0x1

# ---------------------------------------------------------------------------
# IPC memory (acl_rt.h: ACL_RT_IPC_MEM_IMPORT_FLAG_*, aclrtIpcMemAttrType and its link values)
# ---------------------------------------------------------------------------
ACL_RT_IPC_MEM_IMPORT_FLAG_DEFAULT = 0x0
ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS = 0x1
ACL_RT_IPC_MEM_ATTR_ACCESS_LINK = 0
ACL_RT_IPC_MEM_ATTR_ACCESS_LINK_SIO = 0
ACL_RT_IPC_MEM_ATTR_ACCESS_LINK_HCCS = 1
ACL_RT_IPC_MEM_ATTR_ACCESS_LINK_UB_ONE_PORT_PATH = 2
ACL_RT_IPC_MEM_ATTR_ACCESS_LINK_UB_MULTI_PORT_PATH = 3

# ---------------------------------------------------------------------------
# aclrtMemSharedHandleType (acl_rt.h)
# ---------------------------------------------------------------------------
ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT = 0x1
ACL_MEM_SHARE_HANDLE_TYPE_FABRIC = 0x2

# ---------------------------------------------------------------------------
# aclrtMemHandleType (acl_rt.h)
# ---------------------------------------------------------------------------
ACL_MEM_HANDLE_TYPE_NONE = 0
ACL_MEM_HANDLE_TYPE_POSIX = 2

# ---------------------------------------------------------------------------
# aclrtMemAllocationType (acl_rt.h)
# ---------------------------------------------------------------------------
ACL_MEM_ALLOCATION_TYPE_PINNED = 0

# ---------------------------------------------------------------------------
# aclrtMemLocationType (acl_rt.h)
# ---------------------------------------------------------------------------
ACL_MEM_LOCATION_TYPE_HOST = 0
ACL_MEM_LOCATION_TYPE_DEVICE = 1
ACL_MEM_LOCATION_TYPE_UNREGISTERED = 2
ACL_MEM_LOCATION_TYPE_MANAGED = 3
ACL_MEM_LOCATION_TYPE_HOST_NUMA = 4

# ---------------------------------------------------------------------------
# aclrtMemAttr (acl_rt.h)
# ---------------------------------------------------------------------------
ACL_DDR_MEM = 0
ACL_HBM_MEM = 1
ACL_DDR_MEM_HUGE = 2
ACL_DDR_MEM_NORMAL = 3
ACL_HBM_MEM_HUGE = 4
ACL_HBM_MEM_NORMAL = 5
ACL_DDR_MEM_P2P_HUGE = 6
ACL_DDR_MEM_P2P_NORMAL = 7
ACL_HBM_MEM_P2P_HUGE = 8
ACL_HBM_MEM_P2P_NORMAL = 9
ACL_HBM_MEM_HUGE1G = 10
ACL_HBM_MEM_P2P_HUGE1G = 11
ACL_MEM_NORMAL = 12
ACL_MEM_HUGE = 13
ACL_MEM_HUGE1G = 14
ACL_MEM_P2P_NORMAL = 15
ACL_MEM_P2P_HUGE = 16
ACL_MEM_P2P_HUGE1G = 17

# ---------------------------------------------------------------------------
# aclrtMemGranularityOptions (acl_rt.h)
# ---------------------------------------------------------------------------
ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM = 0
ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1

# ---------------------------------------------------------------------------
# aclrtMemAccessFlags (acl_rt.h)
# ---------------------------------------------------------------------------
ACL_RT_MEM_ACCESS_FLAGS_NONE = 0x0
ACL_RT_MEM_ACCESS_FLAGS_READ = 0x1
ACL_RT_MEM_ACCESS_FLAGS_READWRITE = 0x3

# ---------------------------------------------------------------------------
# aclrtMemcpyKind (acl_rt.h)
# ---------------------------------------------------------------------------
ACL_MEMCPY_HOST_TO_HOST = 0
ACL_MEMCPY_HOST_TO_DEVICE = 1
ACL_MEMCPY_DEVICE_TO_HOST = 2
ACL_MEMCPY_DEVICE_TO_DEVICE = 3
ACL_MEMCPY_DEFAULT = 4
ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE = 5

# ---------------------------------------------------------------------------
# aclrtMemMallocPolicy (acl_rt.h): page type and P2P in the low byte, flags above it
# ---------------------------------------------------------------------------
ACL_MEM_MALLOC_HUGE_FIRST = 0
ACL_MEM_MALLOC_HUGE_ONLY = 1
ACL_MEM_MALLOC_NORMAL_ONLY = 2
ACL_MEM_MALLOC_HUGE_FIRST_P2P = 3
ACL_MEM_MALLOC_HUGE_ONLY_P2P = 4
ACL_MEM_MALLOC_NORMAL_ONLY_P2P = 5
ACL_MEM_MALLOC_HUGE1G_ONLY = 6
ACL_MEM_MALLOC_HUGE1G_ONLY_P2P = 7
ACL_MEM_TYPE_LOW_BAND_WIDTH = 0x0100
ACL_MEM_TYPE_HIGH_BAND_WIDTH = 0x1000
ACL_MEM_ACCESS_USER_SPACE_READONLY = 0x100000

# ---------------------------------------------------------------------------
# aclrtRunMode, aclrtStreamStatus (acl_rt.h) and the ACL version (acl.h)
# ---------------------------------------------------------------------------
ACL_DEVICE = 0
ACL_HOST = 1
ACL_STREAM_STATUS_COMPLETE = 0
ACL_STREAM_STATUS_NOT_READY = 1
ACL_MAJOR_VERSION = 1
ACL_MINOR_VERSION = 17
ACL_PATCH_VERSION = 0

# ---------------------------------------------------------------------------
# Host registration (aclrtHostRegisterType, acl_rt.h)
# ---------------------------------------------------------------------------
ACL_HOST_REGISTER_MAPPED = 0
ACL_HOST_REGISTER_IOMEMORY = 0x04
ACL_HOST_REGISTER_READONLY = 0x08

# ---------------------------------------------------------------------------
# Events (acl_rt.h): creation flags, record and wait flags, statuses, the IPC handle's size
# ---------------------------------------------------------------------------
ACL_EVENT_SYNC = 0x01
ACL_EVENT_CAPTURE_STREAM_PROGRESS = 0x02
ACL_EVENT_TIME_LINE = 0x08
ACL_EVENT_DEVICE_USE_ONLY = 0x10
ACL_EVENT_EXTERNAL = 0x20
ACL_EVENT_IPC = 0x40
ACL_EVENT_RECORD_DEFAULT = 0x0
ACL_EVENT_RECORD_EXTERNAL = 0x01
ACL_EVENT_WAIT_DEFAULT = 0x0
ACL_EVENT_WAIT_EXTERNAL = 0x01
ACL_EVENT_STATUS_COMPLETE = 0
ACL_EVENT_STATUS_NOT_READY = 1
ACL_EVENT_STATUS_RESERVED = 2
ACL_EVENT_RECORDED_STATUS_NOT_READY = 0
ACL_EVENT_RECORDED_STATUS_COMPLETE = 1
ACL_EVENT_WAIT_STATUS_COMPLETE = 0
ACL_EVENT_WAIT_STATUS_NOT_READY = 1
ACL_EVENT_WAIT_STATUS_RESERVED = 0xFFFF
ACL_IPC_EVENT_HANDLE_SIZE = 64

# ---------------------------------------------------------------------------
# Notifies (acl_rt.h): creation, export and import flags
# ---------------------------------------------------------------------------
ACL_NOTIFY_DEFAULT = 0x0
ACL_NOTIFY_DEVICE_USE_ONLY = 0x01
ACL_RT_NOTIFY_EXPORT_FLAG_DEFAULT = 0x0
ACL_RT_NOTIFY_EXPORT_FLAG_DISABLE_PID_VALIDATION = 0x02
ACL_RT_NOTIFY_IMPORT_FLAG_DEFAULT = 0x0
ACL_RT_NOTIFY_IMPORT_FLAG_ENABLE_PEER_ACCESS = 0x02

# ---------------------------------------------------------------------------
# Sizes used by the runtime
# ---------------------------------------------------------------------------
# sizeof(aclrtMemFabricHandle): uint8_t data[128]
FABRIC_HANDLE_SIZE = 128
# Allocation granularity: 2 MiB pages, 1 GiB pages for the *_HUGE1G attributes (SPEC.md §4 rule 1).
MIN_GRANULARITY = 2 * 1024 * 1024
HUGE1G_GRANULARITY = 1024**3

# ---------------------------------------------------------------------------
# Derived tables (built from the constants above so they cannot drift)
# ---------------------------------------------------------------------------
# aclrtMemAttr names in enum order (index == value).
MEM_ATTR_NAMES: tuple[str, ...] = (
    "ACL_DDR_MEM",
    "ACL_HBM_MEM",
    "ACL_DDR_MEM_HUGE",
    "ACL_DDR_MEM_NORMAL",
    "ACL_HBM_MEM_HUGE",
    "ACL_HBM_MEM_NORMAL",
    "ACL_DDR_MEM_P2P_HUGE",
    "ACL_DDR_MEM_P2P_NORMAL",
    "ACL_HBM_MEM_P2P_HUGE",
    "ACL_HBM_MEM_P2P_NORMAL",
    "ACL_HBM_MEM_HUGE1G",
    "ACL_HBM_MEM_P2P_HUGE1G",
    "ACL_MEM_NORMAL",
    "ACL_MEM_HUGE",
    "ACL_MEM_HUGE1G",
    "ACL_MEM_P2P_NORMAL",
    "ACL_MEM_P2P_HUGE",
    "ACL_MEM_P2P_HUGE1G",
)
_MEM_ATTRS: dict[str, int] = {name: int(globals()[name]) for name in MEM_ATTR_NAMES}

HUGE1G_ATTRS: frozenset[int] = frozenset(v for n, v in _MEM_ATTRS.items() if "HUGE1G" in n)
HUGE_ATTRS: frozenset[int] = frozenset(v for n, v in _MEM_ATTRS.items() if "HUGE" in n and "HUGE1G" not in n)
# The attributes the acl layer accepts for physical memory (its handler table): 0, 1, 8, 9 and 11 are refused.
PHYSICAL_MEM_ATTRS: frozenset[int] = frozenset({
    ACL_DDR_MEM_HUGE, ACL_DDR_MEM_NORMAL, ACL_HBM_MEM_HUGE, ACL_HBM_MEM_NORMAL, ACL_DDR_MEM_P2P_HUGE,
    ACL_DDR_MEM_P2P_NORMAL, ACL_HBM_MEM_HUGE1G, ACL_MEM_NORMAL, ACL_MEM_HUGE, ACL_MEM_HUGE1G, ACL_MEM_P2P_NORMAL,
    ACL_MEM_P2P_HUGE, ACL_MEM_P2P_HUGE1G,
})
# DDR attributes: host memory only (a DEVICE location with one of them is refused by the acl layer).
DDR_MEM_ATTRS: frozenset[int] = frozenset({
    ACL_DDR_MEM_HUGE, ACL_DDR_MEM_NORMAL, ACL_DDR_MEM_P2P_HUGE, ACL_DDR_MEM_P2P_NORMAL,
})


def _collect_error_names() -> dict[int, str]:
    """Map each error value to its constant name; an ACL_ERROR_RT_* name wins over any other spelling."""
    names: dict[int, str] = {ACL_SUCCESS: "ACL_SUCCESS"}
    for name, value in dict(globals()).items():
        if not name.startswith("ACL_ERROR") or not isinstance(value, int) or value == ACL_SUCCESS:
            continue
        current = names.get(value)
        if current is None or (name.startswith("ACL_ERROR_RT_") and not current.startswith("ACL_ERROR_RT_")):
            names[value] = name
    return names


# Every code defined above (0 maps to "ACL_SUCCESS").
ERROR_NAMES: dict[int, str] = _collect_error_names()

# Short English descriptions, used in messages next to the code's name.
ERROR_TEXT: dict[int, str] = {
    ACL_SUCCESS: "success",
    ACL_ERROR_INVALID_EXCEPTION_INFO: "the exception information is invalid",
    # general parameter / usage errors
    ACL_ERROR_INVALID_PARAM: "a parameter failed validation",
    ACL_ERROR_UNINITIALIZE: "ACL is not initialized; call acl.init() first",
    ACL_ERROR_REPEAT_INITIALIZE: "ACL is already initialized",
    ACL_ERROR_INVALID_FILE: "the file is invalid",
    ACL_ERROR_WRITE_FILE: "writing the file failed",
    ACL_ERROR_INVALID_FILE_SIZE: "the file size is invalid",
    ACL_ERROR_PARSE_FILE: "parsing the file failed",
    ACL_ERROR_FILE_MISSING_ATTR: "the file lacks a required attribute",
    ACL_ERROR_FILE_ATTR_INVALID: "a file attribute is invalid",
    ACL_ERROR_INVALID_DUMP_CONFIG: "the dump configuration is invalid",
    ACL_ERROR_INVALID_PROFILING_CONFIG: "the profiling configuration is invalid",
    ACL_ERROR_INVALID_MODEL_ID: "the model id is invalid",
    ACL_ERROR_DESERIALIZE_MODEL: "deserializing the model failed",
    ACL_ERROR_PARSE_MODEL: "parsing the model failed",
    ACL_ERROR_READ_MODEL_FAILURE: "reading the model failed",
    ACL_ERROR_MODEL_SIZE_INVALID: "the model size is invalid",
    ACL_ERROR_MODEL_MISSING_ATTR: "the model lacks a required attribute",
    ACL_ERROR_MODEL_INPUT_NOT_MATCH: "the model input does not match",
    ACL_ERROR_MODEL_OUTPUT_NOT_MATCH: "the model output does not match",
    ACL_ERROR_MODEL_NOT_DYNAMIC: "the model is not dynamic",
    ACL_ERROR_OP_TYPE_NOT_MATCH: "the operator type does not match",
    ACL_ERROR_OP_INPUT_NOT_MATCH: "the operator input does not match",
    ACL_ERROR_OP_OUTPUT_NOT_MATCH: "the operator output does not match",
    ACL_ERROR_OP_ATTR_NOT_MATCH: "an operator attribute does not match",
    ACL_ERROR_OP_NOT_FOUND: "the operator was not found",
    ACL_ERROR_OP_LOAD_FAILED: "loading the operator failed",
    ACL_ERROR_UNSUPPORTED_DATA_TYPE: "the data type is not supported",
    ACL_ERROR_FORMAT_NOT_MATCH: "the format does not match",
    ACL_ERROR_BIN_SELECTOR_NOT_REGISTERED: "no binary selector is registered",
    ACL_ERROR_KERNEL_NOT_FOUND: "the kernel was not found",
    ACL_ERROR_BIN_SELECTOR_ALREADY_REGISTERED: "a binary selector is already registered",
    ACL_ERROR_KERNEL_ALREADY_REGISTERED: "the kernel is already registered",
    ACL_ERROR_INVALID_QUEUE_ID: "the queue id is invalid",
    ACL_ERROR_REPEAT_SUBSCRIBE: "already subscribed",
    ACL_ERROR_STREAM_NOT_SUBSCRIBE: "the stream is not subscribed",
    ACL_ERROR_THREAD_NOT_SUBSCRIBE: "the thread is not subscribed",
    ACL_ERROR_WAIT_CALLBACK_TIMEOUT: "waiting for the callback timed out",
    ACL_ERROR_REPEAT_FINALIZE: "ACL is already finalized",
    ACL_ERROR_NOT_STATIC_AIPP: "the AIPP configuration is not static",
    ACL_ERROR_COMPILING_STUB_MODE: "the library was built in stub mode",
    ACL_ERROR_GROUP_NOT_SET: "the group is not set",
    ACL_ERROR_GROUP_NOT_CREATE: "the group is not created",
    ACL_ERROR_PROF_ALREADY_RUN: "profiling is already running",
    ACL_ERROR_PROF_NOT_RUN: "profiling is not running",
    ACL_ERROR_DUMP_ALREADY_RUN: "dump is already running",
    ACL_ERROR_DUMP_NOT_RUN: "dump is not running",
    # general resource / internal errors
    ACL_ERROR_BAD_ALLOC: "memory allocation failed",
    ACL_ERROR_API_NOT_SUPPORT: "the API is not supported",
    ACL_ERROR_INVALID_DEVICE: "the device is invalid",
    ACL_ERROR_MEMORY_ADDRESS_UNALIGNED: "the memory address is not aligned",
    ACL_ERROR_RESOURCE_NOT_MATCH: "the resources do not match",
    ACL_ERROR_INVALID_RESOURCE_HANDLE: "the resource handle is invalid",
    ACL_ERROR_FEATURE_UNSUPPORTED: "the feature is not supported",
    ACL_ERROR_PROF_MODULES_UNSUPPORTED: "the profiling modules are not supported",
    ACL_ERROR_STORAGE_OVER_LIMIT: "the storage limit was exceeded",
    ACL_ERROR_INTERNAL_ERROR: "internal error",
    ACL_ERROR_FAILURE: "the operation failed",
    ACL_ERROR_GE_FAILURE: "the graph engine failed",
    ACL_ERROR_RT_FAILURE: "the runtime failed",
    ACL_ERROR_DRV_FAILURE: "the driver failed",
    ACL_ERROR_PROFILING_FAILURE: "profiling failed",
    # runtime errors used by vmmshare
    ACL_ERROR_RT_PARAM_INVALID: "invalid parameter",
    ACL_ERROR_RT_INVALID_DEVICEID: "invalid device id",
    ACL_ERROR_RT_CONTEXT_NULL: "no current context; call acl.rt.set_device() first",
    ACL_ERROR_RT_ADDR_UNALIGNED: "the memory address is not aligned",
    ACL_ERROR_RT_INVALID_MEMORY_TYPE: "invalid memory type",
    ACL_ERROR_RT_INVALID_HANDLE: "invalid, freed or revoked handle",
    ACL_ERROR_RT_WAIT_TIMEOUT: "wait timed out",
    ACL_ERROR_RT_FEATURE_NOT_SUPPORT: "feature not supported",
    ACL_ERROR_RT_MEMORY_ALLOCATION: "out of memory",
    ACL_ERROR_RT_MEMORY_FREE: "freeing memory failed",
    ACL_ERROR_RT_NO_DEVICE: "no device available",
    ACL_ERROR_RT_RESOURCE_ALLOC_FAIL: "resource allocation failed",
    ACL_ERROR_RT_NO_PERMISSION: "permission denied",
    ACL_ERROR_RT_OVER_LIMIT: "a limit was exceeded",
    ACL_ERROR_RT_REPEATED_INIT: "already initialized",
    ACL_ERROR_RT_DEVICE_OOM: "the device is out of memory",
    ACL_ERROR_RT_TIMEOUT: "the driver timed out",
    ACL_ERROR_RT_INTERNAL_ERROR: "runtime internal error",
    ACL_ERROR_RT_IPC_ERROR: "inter-process communication error",
    ACL_ERROR_RT_DEV_SETUP_ERROR: "device setup failed",
    ACL_ERROR_RT_DRV_INTERNAL_ERROR: "driver internal error",
    ACL_ERROR_RT_SOCKET_CLOSE: "the connection was closed",
}


def error_name(code: int) -> str:
    """The constant name of `code` (e.g. "ACL_ERROR_RT_PARAM_INVALID"), or "UNKNOWN_<code>"."""
    return ERROR_NAMES.get(code, f"UNKNOWN_{code}")
