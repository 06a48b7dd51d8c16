"""pyACL's names: every call of pyACL's acl, acl.rt and acl.util exists; those vmmshare does not provide return
207000 in pyACL's own shape with a message naming the call, never raising; dir() shows the API only."""

from __future__ import annotations

import inspect

import pytest

import vmmshare.acl as acl
from vmmshare.acl import _unsupported

NOT_SUPPORTED = 207000

# pyACL's acl.rt calls (its method table), and the acl.util ones
PYACL_RT = [
    "binary_load_from_file", "binary_load_from_data", "get_function_addr", "get_function_name", "register_cpu_func",
    "create_binary", "destroy_binary", "binary_load", "binary_unload", "binary_get_function", "launch_kernel",
    "kernel_args_init", "kernel_args_init_by_user_mem", "kernel_args_get_mem_size",
    "kernel_args_get_handle_mem_size", "kernel_args_append", "kernel_args_append_place_holder",
    "kernel_args_get_place_holder_buffer", "kernel_args_para_update", "kernel_args_finalize",
    "launch_kernel_with_config", "set_device", "reset_device", "reset_device_force", "get_device",
    "set_device_sat_mode", "get_device_sat_mode", "get_run_mode", "set_ts_device", "get_device_count",
    "create_context", "destroy_context", "set_context", "get_context", "ctx_get_current_default_stream",
    "get_overflow_status", "reset_overflow_status", "malloc", "free", "get_mem_info", "malloc_cached", "mem_flush",
    "mem_invalidate", "malloc_host", "free_host", "memcpy", "memcpy_async", "memset", "memset_async",
    "create_stream", "create_stream_with_config", "destroy_stream", "destroy_stream_force",
    "set_stream_overflow_switch", "get_stream_overflow_switch", "set_stream_failure_mode", "stream_query",
    "create_event", "create_event_with_flag", "create_event_ex_with_flag", "destroy_event", "synchronize_stream",
    "synchronize_stream_with_timeout", "process_report", "subscribe_report", "unsubscribe_report",
    "launch_callback", "synchronize_device", "record_event", "reset_event", "query_event", "query_event_status",
    "query_event_wait_status", "synchronize_event", "synchronize_event_with_timeout", "event_elapsed_time",
    "event_get_timestamp", "get_event_id", "get_event_avail_num", "stream_wait_event", "stream_get_id",
    "get_stream_available_num", "set_stream_attribute", "get_stream_attribute", "get_thread_last_task_id",
    "reduce_async", "set_exception_info_callback", "get_error_code_from_exception_info",
    "get_task_id_from_exception_info", "get_stream_id_from_exception_info", "get_thread_id_from_exception_info",
    "get_device_id_from_exception_info", "set_op_wait_timeout", "set_op_execute_time_out", "memcpy2d",
    "memcpy2d_async", "reserve_mem_address", "release_mem_address", "malloc_physical", "free_physical",
    "malloc_with_cfg", "malloc_for_task_scheduler", "malloc_host_with_cfg", "map_mem", "unmap_mem",
    "mem_export_to_shareable_handle", "device_get_bare_tgid", "mem_set_pid_to_shareable_handle",
    "mem_import_from_shareable_handle", "mem_get_allocation_granularity", "get_device_utilization_rate",
    "query_device_status", "ctx_set_sys_param_opt", "ctx_get_sys_param_opt", "set_sys_param_opt",
    "get_sys_param_opt", "malloc_align32", "allocator_create_desc", "allocator_destroy_desc",
    "allocator_set_obj_to_desc", "allocator_set_alloc_func_to_desc", "allocator_set_free_func_to_desc",
    "allocator_set_alloc_advise_func_to_desc", "allocator_set_get_addr_from_block_func_to_desc",
    "allocator_register", "allocator_unregister", "peek_at_last_error", "get_last_error",
    "synchronize_device_with_timeout", "cmo_async", "device_task_abort", "memcpy_async_with_condition",
    "stream_abort", "pointer_get_attributes", "host_register", "host_unregister", "get_memcpy_desc_size",
    "set_memcpy_desc", "memcpy_async_with_desc", "value_write", "value_wait", "device_can_access_peer",
    "device_enable_peer_access", "device_disable_peer_access", "ipc_mem_get_export_key", "ipc_mem_set_import_pid",
    "ipc_mem_import_by_key", "ipc_mem_close", "get_device_info", "device_get_stream_priority_range",
    "get_device_capability", "get_device_res_limit", "set_device_res_limit", "reset_device_res_limit",
    "get_devices_topo", "create_notify", "destroy_notify", "record_notify", "wait_and_reset_notify",
    "get_notify_id", "notify_batch_reset", "notify_get_export_key", "notify_set_import_pid", "notify_import_by_key",
    "get_stream_res_limit", "set_stream_res_limit", "reset_stream_res_limit", "use_stream_res_in_current_thread",
    "unuse_stream_res_in_current_thread", "get_res_in_current_thread", "get_primary_ctx_state",
    "get_logic_dev_id_by_user_dev_id", "get_user_dev_id_by_logic_dev_id", "get_logic_dev_id_by_phy_dev_id",
    "get_phy_dev_id_by_logic_dev_id", "set_op_execute_timeout_v2", "get_op_timeout_interval",
    "get_op_execute_timeout", "device_get_uuid", "device_peer_access_status", "host_register_v2",
    "host_get_device_pointer", "set_group", "get_group_count", "create_group_info", "destroy_group_info",
    "get_all_group_info", "get_group_info_detail", "get_mem_uce_info", "mem_uce_repair"
]
PYACL_UTIL = ["numpy_to_ptr", "numpy_contiguous_to_ptr", "ptr_to_numpy", "bytes_to_ptr", "ptr_to_bytes",
              "start_thread", "stop_thread"]
PYACL_TOP = [
    "init", "finalize", "get_version", "get_soc_name", "get_recent_err_msg", "float16_to_float", "float_to_float16",
    "create_data_buffer", "destroy_data_buffer", "get_data_buffer_addr", "get_data_buffer_size",
    "get_data_buffer_size_v2", "update_data_buffer", "data_type_size", "create_tensor_desc", "destroy_tensor_desc",
    "get_tensor_desc_type", "get_tensor_desc_format", "get_tensor_desc_size", "get_tensor_desc_element_count",
    "get_tensor_desc_num_dims", "get_tensor_desc_dim", "get_tensor_desc_name", "set_tensor_desc_name",
    "trans_tensor_desc_format", "app_log", "set_tensor_storage_format", "set_tensor_storage_shape",
    "set_tensor_format", "set_tensor_shape", "set_tensor_origin_format", "set_tensor_dynamic_input",
    "set_tensor_origin_shape", "set_tensor_shape_range", "get_tensor_desc_address", "get_tensor_desc_by_index",
    "get_tensor_desc_dim_range", "get_tensor_desc_dim_v2", "set_tensor_place_ment", "get_recent_err_msg",
    "set_tensor_const", "set_tensor_value_range", "get_cann_attribute_list", "get_cann_attribute",
    "get_device_capability", "get_cann_version", "finalize_reference", "get_version_str"
]


def test_every_pyacl_name_exists():
    assert len(PYACL_RT) == 190
    for module, names in ((acl.rt, PYACL_RT), (acl.util, PYACL_UTIL), (acl, PYACL_TOP)):
        missing = [n for n in names if not callable(getattr(module, n, None))]
        assert not missing, f"{module.__name__} lacks {missing}"


def test_dir_shows_the_api_only():
    for module in (acl.rt, acl.util):
        names = dir(module)
        assert names == sorted(module.__all__)
        assert all(callable(getattr(module, n)) for n in names)
        for internal in ("Any", "C", "runtime", "check_int", "annotations", "acl_call", "ctypes", "functools"):
            assert internal not in names
    top = dir(acl)
    assert {"rt", "util", "init", "ACL_SUCCESS", "ACL_MEM_SHARE_HANDLE_TYPE_FABRIC"} <= set(top)
    assert not {"json", "os", "AclError", "acl_call", "annotations", "recent_error"} & set(top)
    assert set(PYACL_RT) <= set(dir(acl.rt))
    assert "ipc_mem_set_attr" in dir(acl.rt) and "set_current_context" in dir(acl.rt)  # vmmshare's additions


STAND_INS = [(acl.rt, n, s) for n, s in _unsupported.RT.items()] + [(acl, n, s) for n, s in _unsupported.ACL.items()]


@pytest.mark.parametrize(("module", "name", "shape"), STAND_INS, ids=[f"{m.__name__}.{n}" for m, n, _ in STAND_INS])
def test_unsupported_calls_return_207000_in_pyacls_shape(module, name, shape):
    fn = getattr(module, name)
    for args in ((), (0,), (1, 2, 3), (None, "x", [1], {"a": 1})):
        acl.rt.get_last_error(0)
        got = fn(*args)
        msg = acl.get_recent_err_msg()
        assert name in msg and "not supported" in msg, msg
        if shape.startswith("="):  # pyACL gives the value alone, without ret
            assert not isinstance(got, tuple) and got in (0, None, "")
        elif shape:
            assert isinstance(got, tuple) and len(got) == len(shape) + 1 and got[-1] == NOT_SUPPORTED, got
            assert all(v in (0, 0.0, None, "") for v in got[:-1])
        else:
            assert got == NOT_SUPPORTED
        assert acl.rt.get_last_error(0) == NOT_SUPPORTED


def test_implemented_calls_are_acl_rts_own():
    """The calls written in acl/_device.py and the rest are acl.rt's: their module says so (introspection, the
    fuzzer and help() find them there)."""
    for name in acl.rt.__all__:
        fn = getattr(acl.rt, name)
        if name not in _unsupported.RT:
            assert fn.__module__ == "vmmshare.acl.rt", name
            assert inspect.signature(fn).parameters is not None
