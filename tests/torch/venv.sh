#!/usr/bin/env bash
# Installs PyTorch (the PyPI wheel, which runs on CPU), numpy, and what the Python tests use
# (maturin to build the dspark package, expecttest and pytest for torch's own distributed
# test suite) into a private virtual environment, then builds and installs the dspark
# package (`pip install ./python`) into it. Used by the tests that talk to torch's c10d
# TCPStore (tests/store_torch.rs), the launcher tests and the torch backend tests
# (tests/torch_backend.rs). Idempotent: an environment that already imports torch is reused;
# the dspark package is rebuilt every time (it is this checkout's code).
#
# Prints, as its LAST line of standard output, the path of the environment's python:
#
#   export DSPARK_TORCH_PYTHON="$(bash tests/torch/venv.sh | tail -n1)"
#
# The first run downloads about 3 GB and takes about 5.4 GB of disk (the wheel pulls the
# CUDA runtime wheels too; no GPU is needed to use it).
#
# Environment:
#   DSPARK_TORCH_VENV     where the virtual environment lives
#                         (default: $HOME/.cache/dspark/torch-venv)
#   DSPARK_TORCH_VERSION  torch version to install (default: 2.15.0)
#   PYTHON                the interpreter that creates the environment (default: python3)
#   DSPARK_SKIP_PACKAGE   set: do not (re)build the dspark package
# Exit status: 0 with the path printed; 1 (and a reason on stderr) when it cannot install.
set -euo pipefail

venv="${DSPARK_TORCH_VENV:-$HOME/.cache/dspark/torch-venv}"
version="${DSPARK_TORCH_VERSION:-2.15.0}"
python="${PYTHON:-python3}"
py="$venv/bin/python"

has_torch() {
    [ -x "$py" ] && "$py" -c 'import torch, numpy, torch.distributed as d; assert d.is_available()' \
        >/dev/null 2>&1
}

test_deps=(maturin expecttest pytest)

install_dspark() {
    "$py" -c 'import maturin, expecttest, pytest' >/dev/null 2>&1 || {
        echo "torch venv: installing ${test_deps[*]}" >&2
        "$venv/bin/pip" install --quiet --disable-pip-version-check "${test_deps[@]}" >&2 || {
            echo "torch venv: pip install ${test_deps[*]} failed" >&2
            exit 1
        }
    }
    if [ -z "${DSPARK_SKIP_PACKAGE:-}" ]; then
        echo "torch venv: building and installing the dspark package (pip install ./python)" >&2
        PATH="$venv/bin:$PATH" "$venv/bin/pip" install --quiet --disable-pip-version-check --no-build-isolation \
            "$(dirname "${BASH_SOURCE[0]}")/../../python" >&2 || {
            echo "torch venv: pip install ./python failed" >&2
            exit 1
        }
        "$py" -c 'import dspark.torch' >&2 || {
            echo "torch venv: the dspark package was installed but does not import" >&2
            exit 1
        }
    fi
}

if has_torch; then
    echo "torch venv: reusing $venv (torch $("$py" -c 'import torch; print(torch.__version__)'))" >&2
    install_dspark
    echo "$py"
    exit 0
fi

if ! command -v "$python" >/dev/null 2>&1; then
    echo "torch venv: $python not found; install Python 3 (with venv) first" >&2
    exit 1
fi
if [ ! -x "$venv/bin/pip" ]; then
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv" >&2 || {
        echo "torch venv: '$python -m venv $venv' failed (Debian: apt-get install python3-venv)" >&2
        exit 1
    }
fi
echo "torch venv: installing torch==$version and numpy into $venv (about 3 GB, a few minutes)" >&2
"$venv/bin/pip" install --quiet --disable-pip-version-check --no-cache-dir \
    "torch==$version" numpy >&2 || {
    echo "torch venv: pip install torch==$version numpy failed" >&2
    exit 1
}
if ! has_torch; then
    echo "torch venv: torch==$version installed in $venv but 'import torch.distributed' fails:" >&2
    "$py" -c 'import torch.distributed' >&2 || true
    exit 1
fi
echo "torch venv: installed torch $("$py" -c 'import torch; print(torch.__version__)') in $venv" >&2
install_dspark
echo "$py"
