"""What dspark needs to know about an array or a tensor: its data pointer, its element
count and its dtype. Works on numpy arrays (and anything with ``__array_interface__``) and
torch CPU tensors, without importing either."""

from ._dspark import InvalidArgumentError, UnavailableError

# numpy dtype names (and ml_dtypes' bfloat16) -> dspark's Rust type names.
_NP = {
    "float32": "f32",
    "float64": "f64",
    "float16": "f16",
    "bfloat16": "bf16",
    "int8": "i8",
    "uint8": "u8",
    "int32": "i32",
    "uint32": "u32",
    "int64": "i64",
    "uint64": "u64",
}

# str(torch.dtype) -> dspark's Rust type names.
TORCH_DTYPES = {
    "torch.float32": "f32",
    "torch.float64": "f64",
    "torch.float16": "f16",
    "torch.bfloat16": "bf16",
    "torch.int8": "i8",
    "torch.uint8": "u8",
    "torch.int32": "i32",
    "torch.uint32": "u32",
    "torch.int64": "i64",
    "torch.uint64": "u64",
}


def is_tensor(x):
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


def describe(x, writable, what="buffer"):
    """Returns ``(pointer, count, dtype)`` of a contiguous CPU array or tensor, or raises
    ``InvalidArgumentError`` saying why it cannot be used in place."""
    if is_tensor(x):
        if x.device.type != "cpu":
            raise UnavailableError(
                f"dspark: {what} is a {x.device.type} tensor; dspark.Communicator takes CPU "
                "tensors and numpy arrays (CUDA tensors go through the torch backend)"
            )
        dt = TORCH_DTYPES.get(str(x.dtype))
        if dt is None:
            raise InvalidArgumentError(
                f"dspark: {what} has dtype {x.dtype}, which dspark does not reduce or move "
                f"(supported: {', '.join(sorted(TORCH_DTYPES))})"
            )
        if not x.is_contiguous():
            raise InvalidArgumentError(
                f"dspark: {what} is not contiguous (shape {tuple(x.shape)}, stride "
                f"{x.stride()}); pass x.contiguous() and copy the result back"
            )
        return x.data_ptr(), x.numel(), dt
    ai = getattr(x, "__array_interface__", None)
    if ai is None:
        raise InvalidArgumentError(
            f"dspark: {what} of type {type(x).__name__} is neither a numpy array nor a "
            "torch tensor"
        )
    ptr, readonly = ai["data"]
    if writable and readonly:
        raise InvalidArgumentError(f"dspark: {what} is read-only and dspark writes it")
    dtype = x.dtype
    if not dtype.isnative:
        raise InvalidArgumentError(f"dspark: {what} is not in native byte order")
    dt = _NP.get(dtype.name)
    if dt is None:
        raise InvalidArgumentError(
            f"dspark: {what} has dtype {dtype.name}, which dspark does not reduce or move "
            f"(supported: {', '.join(_NP)})"
        )
    if not x.flags["C_CONTIGUOUS"]:
        raise InvalidArgumentError(
            f"dspark: {what} is not C-contiguous; pass numpy.ascontiguousarray(x) and copy "
            "the result back"
        )
    return ptr, x.size, dt
