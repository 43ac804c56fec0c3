"""The torch glue's arguments (part of :mod:`dspark.torch`): torch's ReduceOps and dtypes as
dspark's, timeouts as seconds, and tensors as the contiguous buffers dspark reads and writes
(copies in and back for non-contiguous ones)."""

import torch
import torch.distributed as dist

from . import _dspark
from ._buffers import TORCH_DTYPES
from ._dspark import InvalidArgumentError, UnavailableError

NAME = "dspark"

_RED = dist.ReduceOp.RedOpType
_OPS = {
    _RED.SUM: "sum",
    _RED.PRODUCT: "prod",
    _RED.MIN: "min",
    _RED.MAX: "max",
    _RED.AVG: "avg",
}
_UNSUPPORTED_OPS = {
    getattr(_RED, n): n for n in ("BAND", "BOR", "BXOR") if hasattr(_RED, n)
}
_UNSET_TIMEOUT = dist.AllreduceOptions().timeout
# torch.distributed re-exports AllgatherOptions from 2.9 on; 2.8 has it only in _c10d.
_AllgatherOptions = getattr(dist, "AllgatherOptions", None) or getattr(
    torch._C._distributed_c10d, "AllgatherOptions"
)
# The fast path's tables (`allreduce`): torch dtype -> index into the native module's
# `_FAST_DTYPES`, and the code of a plain ReduceOp -> index into its `_FAST_OPS`. The op's
# code is read as `hash(opts.reduceOp)`: c10d's ReduceOp hashes to its RedOpType's value,
# which costs one C call where `opts.reduceOp.op` makes an enum object and hashing that
# calls back into pybind (0.9 us against 0.25 us a call). Checked here for every plain op;
# a torch where it does not hold gets an empty table, i.e. the general path.
_FAST_DTYPES = {
    getattr(torch, name): _dspark._FAST_DTYPES.index(code)
    for name, code in (
        ("float32", "f32"), ("float64", "f64"), ("float16", "f16"), ("bfloat16", "bf16"),
        ("int8", "i8"), ("uint8", "u8"), ("int32", "i32"), ("int64", "i64"),
    )
}


def _fast_op_table():
    table = {}
    for kind, name in _OPS.items():
        try:
            code = int(kind)
            if hash(dist.ReduceOp(kind)) != code:
                return {}
        except Exception:  # noqa: BLE001 - an unexpected torch: no fast path
            return {}
        table[code] = _dspark._FAST_OPS.index(name)
    return table


_FAST_OPS = _fast_op_table()
# bool: OR for sum and max, AND for product and min (what NCCL and Gloo compute).
_BOOL_OPS = {"sum": "max", "max": "max", "prod": "min", "min": "min"}


def _seconds(td):
    """A timedelta (or None) as seconds, None when unset (torch uses -1 ms for unset)."""
    if td is None:
        return None
    s = td.total_seconds() if hasattr(td, "total_seconds") else float(td)
    return s if s > 0 else None


# ---------------------------------------------------------------------------- buffers


def _flat(t):
    """The dspark view of a contiguous tensor: (tensor actually passed, dtype name)."""
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    elif t.is_complex():
        t = torch.view_as_real(t)
    dt = TORCH_DTYPES.get(str(t.dtype))
    if dt is None:
        raise InvalidArgumentError(
            f"dspark: tensors of dtype {t.dtype} are not supported (float32, float64, "
            "float16, bfloat16, int8, uint8, int32, int64, uint32, uint64, bool, complex)"
        )
    return t, dt


def _check_device(t, what, cuda=False):
    """CPU tensors everywhere; CUDA tensors where the operation has a device path (`_go`'s,
    ordered on torch's current stream, and all_to_all's)."""
    if t.device.type == "cpu" or (cuda and t.device.type == "cuda"):
        return
    raise UnavailableError(
        f"dspark: {what} is on {t.device}; this dspark torch backend runs this operation "
        "on CPU tensors only" + ("" if t.device.type != "cuda" else
        " (CUDA tensors: all_reduce, broadcast, reduce, all_gather, reduce_scatter, "
        "all_to_all, send/recv and the coalesced forms)") + ". Use "
        "init_process_group(backend=\"cpu:dspark,cuda:nccl\") to keep CUDA tensors on "
        "NCCL."
    )


def _input(t, what):
    """A contiguous tensor holding t's data (t itself when it is contiguous)."""
    _check_device(t, what, cuda=True)
    return t if t.is_contiguous() else t.contiguous()


def _output(t, what, finishers):
    """A contiguous tensor that receives t's result; registers a copy back when t is not
    contiguous."""
    _check_device(t, what, cuda=True)
    if t.is_contiguous():
        return t
    tmp = t.contiguous()
    finishers.append(lambda: t.copy_(tmp))
    return tmp


def _chain(finishers):
    if not finishers:
        return None

    def run():
        for f in finishers:
            f()

    return run


def _premul_factor(red):
    """The factor of a PREMUL_SUM ReduceOp (`dist._make_nccl_premul_sum(f)`): an attribute
    on newer torch; on older ones (2.8) only in the op's pickled state, `(op, factor)`."""
    factor = getattr(red, "factor", None)
    if factor is None:
        try:
            state = red.__getstate__()
            factor = state[1] if isinstance(state, tuple) and len(state) > 1 else None
        except Exception:
            factor = None
    return factor
