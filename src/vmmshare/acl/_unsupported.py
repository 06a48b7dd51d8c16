"""The pyACL calls vmmshare does not provide (kernels, events, notifies, tensors, ...): each exists, so code that
names it imports and runs, and returns ACL_ERROR_RT_FEATURE_NOT_SUPPORT (207000) in pyACL's own shape, with a
message naming the call; it never raises.

A shape is pyACL's outputs before `ret`, one letter each: ``i`` an int (0 on failure), ``f`` a float (0.0),
``o`` a dict or list (None), ``s`` a str (""). A shape starting with ``=`` is a call without `ret` in pyACL: it
returns the one value alone (its failure value), and the message says why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import constants as C
from ..errors import set_recent_error

_NEUTRAL: dict[str, Any] = {"i": 0, "f": 0.0, "o": None, "s": "", "n": None}

# acl.rt: name -> shape
RT: dict[str, str] = {
    # binaries and kernels
    "binary_load_from_file": "i", "binary_load_from_data": "i", "get_function_addr": "ii", "get_function_name": "s",
    "register_cpu_func": "i", "create_binary": "=i", "destroy_binary": "", "binary_load": "i", "binary_unload": "",
    "binary_get_function": "i", "launch_kernel": "", "kernel_args_init": "i", "kernel_args_init_by_user_mem": "",
    "kernel_args_get_mem_size": "i", "kernel_args_get_handle_mem_size": "i", "kernel_args_append": "i",
    "kernel_args_append_place_holder": "i", "kernel_args_get_place_holder_buffer": "i", "kernel_args_para_update": "",
    "kernel_args_finalize": "", "launch_kernel_with_config": "",
    # devices
    "set_device_sat_mode": "", "get_device_sat_mode": "i", "set_ts_device": "", "get_device_utilization_rate": "o",
    "query_device_status": "i", "device_task_abort": "", "get_device_info": "i",
    "device_get_stream_priority_range": "ii",
    "get_device_capability": "i", "get_device_res_limit": "i", "set_device_res_limit": "", "reset_device_res_limit": "",
    "get_devices_topo": "i", "device_peer_access_status": "i",
    # contexts
    "ctx_get_current_default_stream": "i", "get_overflow_status": "", "reset_overflow_status": "",
    "ctx_set_sys_param_opt": "", "ctx_get_sys_param_opt": "i", "set_sys_param_opt": "", "get_sys_param_opt": "i",
    "get_primary_ctx_state": "ii",
    # memory
    "mem_flush": "", "mem_invalidate": "", "memcpy2d": "", "memcpy2d_async": "", "malloc_with_cfg": "i",
    "malloc_for_task_scheduler": "i", "malloc_host_with_cfg": "i", "memcpy_async_with_condition": "",
    "host_register_v2": "",
    "get_memcpy_desc_size": "i", "set_memcpy_desc": "i", "memcpy_async_with_desc": "",
    "value_write": "", "value_wait": "", "cmo_async": "", "reduce_async": "", "get_mem_uce_info": "o",
    "mem_uce_repair": "",
    "allocator_create_desc": "=i", "allocator_destroy_desc": "", "allocator_set_obj_to_desc": "",
    "allocator_set_alloc_func_to_desc": "", "allocator_set_free_func_to_desc": "",
    "allocator_set_alloc_advise_func_to_desc": "", "allocator_set_get_addr_from_block_func_to_desc": "",
    "allocator_register": "", "allocator_unregister": "",
    # streams and events
    "create_stream_with_config": "i", "set_stream_overflow_switch": "", "get_stream_overflow_switch": "i",
    "set_stream_failure_mode": "", "stream_abort": "", "stream_get_id": "i", "get_stream_available_num": "i",
    "set_stream_attribute": "", "get_stream_attribute": "o", "get_stream_res_limit": "i", "set_stream_res_limit": "",
    "reset_stream_res_limit": "", "use_stream_res_in_current_thread": "", "unuse_stream_res_in_current_thread": "",
    "get_res_in_current_thread": "i",
    "reset_event": "", "query_event": "i",
    "query_event_wait_status": "i",
    "event_elapsed_time": "f", "event_get_timestamp": "i", "get_event_id": "i",
    "get_event_avail_num": "i", "process_report": "", "subscribe_report": "",
    "unsubscribe_report": "", "launch_callback": "", "get_thread_last_task_id": "i",
    # exceptions and timeouts
    "set_exception_info_callback": "", "get_error_code_from_exception_info": "=i",
    "get_task_id_from_exception_info": "=i", "get_stream_id_from_exception_info": "=i",
    "get_thread_id_from_exception_info": "=i", "get_device_id_from_exception_info": "=i", "set_op_wait_timeout": "",
    "set_op_execute_time_out": "", "set_op_execute_timeout_v2": "i", "get_op_timeout_interval": "i",
    "get_op_execute_timeout": "i",
    # notifies
    "get_notify_id": "i", "notify_batch_reset": "",
    # groups
    "set_group": "", "get_group_count": "i", "create_group_info": "=i", "destroy_group_info": "",
    "get_all_group_info": "", "get_group_info_detail": "o",
}

# acl: name -> shape
ACL: dict[str, str] = {
    "create_data_buffer": "=i", "destroy_data_buffer": "", "get_data_buffer_addr": "=i", "get_data_buffer_size": "=i",
    "get_data_buffer_size_v2": "=i", "update_data_buffer": "", "data_type_size": "=i", "create_tensor_desc": "=i",
    "destroy_tensor_desc": "=n", "get_tensor_desc_type": "=i", "get_tensor_desc_format": "=i",
    "get_tensor_desc_size": "=i", "get_tensor_desc_element_count": "=i", "get_tensor_desc_num_dims": "=i",
    "get_tensor_desc_dim": "=i", "get_tensor_desc_name": "=s", "set_tensor_desc_name": "=n",
    "trans_tensor_desc_format": "i", "set_tensor_storage_format": "", "set_tensor_storage_shape": "",
    "set_tensor_format": "", "set_tensor_shape": "", "set_tensor_origin_format": "", "set_tensor_dynamic_input": "",
    "set_tensor_origin_shape": "", "set_tensor_shape_range": "", "get_tensor_desc_address": "=i",
    "get_tensor_desc_by_index": "=i", "get_tensor_desc_dim_range": "o", "get_tensor_desc_dim_v2": "i",
    "set_tensor_place_ment": "", "set_tensor_const": "", "set_tensor_value_range": "",
    "get_cann_attribute_list": "oi", "get_cann_attribute": "i", "get_device_capability": "i",
    "get_cann_version": "o", "finalize_reference": "i", "get_version_str": "s",
}


def unsupported(module: str, name: str, shape: str) -> Callable[..., Any]:
    """The stand-in for pyACL's `module.name`: 207000 (or, for a call without `ret`, its failure value)."""
    bare = shape.startswith("=")
    outputs = tuple(_NEUTRAL[c] for c in shape.lstrip("="))
    why = (f"{module}.{name} is not supported by vmmshare, which provides the runtime's device, memory, stream and "
           "sharing calls (see docs/differences.md)")

    def call(*args: Any, **kwargs: Any) -> Any:
        set_recent_error(f"{name}: {why}", C.ACL_ERROR_RT_FEATURE_NOT_SUPPORT)
        if bare:
            return outputs[0]
        return (*outputs, C.ACL_ERROR_RT_FEATURE_NOT_SUPPORT) if outputs else C.ACL_ERROR_RT_FEATURE_NOT_SUPPORT

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"Not supported: {why}."
    return call


def stand_ins(module: str, table: dict[str, str]) -> dict[str, Callable[..., Any]]:
    return {name: unsupported(module, name, shape) for name, shape in table.items()}
