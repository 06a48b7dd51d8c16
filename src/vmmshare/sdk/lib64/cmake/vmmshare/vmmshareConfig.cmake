# vmmshare's C interface as a CMake package: find_package(vmmshare) gives the imported targets vmmshare::ascendcl
# and vmmshare::acl_rt (headers included), and vmmshare_ROOT, the CANN-like root (what ASCEND_HOME_PATH names).
get_filename_component(vmmshare_ROOT "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
set(vmmshare_INCLUDE_DIRS "${vmmshare_ROOT}/include")
foreach(_vmmshare_lib ascendcl acl_rt)
  if(NOT TARGET vmmshare::${_vmmshare_lib})
    add_library(vmmshare::${_vmmshare_lib} SHARED IMPORTED)
    set_target_properties(vmmshare::${_vmmshare_lib} PROPERTIES
      IMPORTED_LOCATION "${vmmshare_ROOT}/lib64/lib${_vmmshare_lib}.so"
      IMPORTED_SONAME "lib${_vmmshare_lib}.so"
      INTERFACE_INCLUDE_DIRECTORIES "${vmmshare_INCLUDE_DIRS}")
  endif()
endforeach()
unset(_vmmshare_lib)
set(vmmshare_LIBRARIES vmmshare::ascendcl)
set(vmmshare_FOUND TRUE)
