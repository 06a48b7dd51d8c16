# vmmshare: source this file (bash or zsh) to build and run programs written for the Ascend runtime against
# vmmshare's C interface: it sets ASCEND_HOME_PATH and ASCEND_TOOLKIT_HOME to this folder and puts its libraries,
# CMake package and pkg-config file first on the search paths, keeping what was there.
if [ -n "${BASH_SOURCE:-}" ]; then
    _vmmshare_here="${BASH_SOURCE[0]}"
elif [ -n "${ZSH_VERSION:-}" ]; then
    eval '_vmmshare_here="${(%):-%x}"'
else
    _vmmshare_here=""
fi
if [ -z "$_vmmshare_here" ]; then
    echo "set_env.sh: source this file from bash or zsh (or set ASCEND_HOME_PATH to \$(vmmshare prefix))" >&2
else
    _vmmshare_root="$(cd "$(dirname "$_vmmshare_here")" && pwd -P)"
    export ASCEND_HOME_PATH="$_vmmshare_root"
    export ASCEND_TOOLKIT_HOME="$_vmmshare_root"
    export LD_LIBRARY_PATH="$_vmmshare_root/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export CMAKE_PREFIX_PATH="$_vmmshare_root/lib64/cmake${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
    export PKG_CONFIG_PATH="$_vmmshare_root/lib64/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
    unset _vmmshare_root
fi
unset _vmmshare_here
