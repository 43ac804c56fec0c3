#!/usr/bin/env bash
# Installs NVRTC (libnvrtc.so.12 + libnvrtc-builtins) from the PyPI wheel nvidia-cuda-nvrtc-cu12
# into a private virtual environment, so that the kernel compile test
# (tests/gpu_kernels_compile.rs) and `dspark doctor --compile-kernels` run on a machine without a
# GPU, a driver or a CUDA toolkit. Idempotent: a second run reuses the environment.
#
# Prints, as its LAST line of standard output, the directory to put on LD_LIBRARY_PATH:
#
#   export LD_LIBRARY_PATH="$(bash tests/gpu/install_nvrtc.sh | tail -n1)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
#
# Environment:
#   DSPARK_NVRTC_VENV     where the virtual environment lives
#                         (default: ${XDG_CACHE_HOME:-$HOME/.cache}/dspark/nvrtc-venv)
#   DSPARK_NVRTC_VERSION  pip version specifier (default: 12.8.*, matching cudarc's cuda-12080)
#   PYTHON                the interpreter (default: python3)
# Exit status: 0 with the directory printed; 1 (and a reason on stderr) when it cannot install.
set -euo pipefail

venv="${DSPARK_NVRTC_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/dspark/nvrtc-venv}"
spec="nvidia-cuda-nvrtc-cu12==${DSPARK_NVRTC_VERSION:-12.8.*}"
python="${PYTHON:-python3}"

find_libdir() {
    # The wheel installs nvidia/cuda_nvrtc/lib/libnvrtc.so.12 under site-packages.
    local f
    f="$(find "$venv" -path '*nvidia/cuda_nvrtc/lib/libnvrtc.so.12' -print -quit 2>/dev/null || true)"
    [ -n "$f" ] && dirname "$f"
}

if dir="$(find_libdir)" && [ -n "$dir" ] && ls "$dir"/libnvrtc-builtins.so.* >/dev/null 2>&1; then
    echo "install_nvrtc: already installed in $venv" >&2
    echo "$dir"
    exit 0
fi

if ! command -v "$python" >/dev/null 2>&1; then
    echo "install_nvrtc: $python not found; install Python 3 (with venv) first" >&2
    exit 1
fi
if [ ! -x "$venv/bin/pip" ]; then
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv" >&2 || {
        echo "install_nvrtc: '$python -m venv' failed (Debian: apt-get install python3-venv)" >&2
        exit 1
    }
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check "$spec" >&2 || {
    echo "install_nvrtc: pip install $spec failed" >&2
    exit 1
}
dir="$(find_libdir)"
if [ -z "$dir" ]; then
    echo "install_nvrtc: $spec installed but libnvrtc.so.12 not found under $venv" >&2
    exit 1
fi
echo "install_nvrtc: installed $spec in $venv" >&2
echo "$dir"
