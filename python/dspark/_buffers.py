"""What dspark needs to know about an array or a tensor: its data pointer, its element
count, its dtype, and the object that keeps that memory alive and in place.

Only three kinds of objects are accepted, each through a route whose pointer and length
come from the object's owner and not from anything a Python class can claim:

- torch tensors (``isinstance(x, torch.Tensor)``, CPU): ``data_ptr()`` and ``numel()``,
  checked to lie inside the tensor's ``untyped_storage()``; that storage is what is kept.
- objects implementing the buffer protocol (PEP 3118): numpy arrays, ``bytearray``,
  ``array.array``, ``memoryview``, ``bytes`` (read-only). A ``memoryview`` is taken of the
  object; its exporter (C code: numpy, CPython) fills in the pointer, the length, the
  element format and whether it is read-only, and the view is what is kept. While it is
  held the exporter refuses to move the memory (``bytearray`` and ``array.array`` raise
  ``BufferError`` on a resize; numpy refuses ``resize()`` of a referenced array).
- numpy arrays of ml_dtypes' ``bfloat16`` (which numpy cannot export): the same, through a
  ``uint16`` view of the array.

Anything else (an object that only offers ``__array_interface__``, a list, a CUDA array)
is refused with an exception that is both ``dspark.InvalidArgumentError`` and
``TypeError``; a buffer dspark cannot use (read-only where dspark writes, not
C-contiguous, an element format dspark does not reduce) with one that is both
``InvalidArgumentError`` and ``ValueError``. Neither numpy nor torch is imported here: an
object can only be one of theirs when its module is loaded.
"""

import sys

from ._dspark import InvalidArgumentError, UnavailableError, _buffer_address


class _NotABuffer(InvalidArgumentError, TypeError):
    """An object that is neither a torch tensor nor a buffer-protocol object."""


class _BadBuffer(InvalidArgumentError, ValueError):
    """A buffer or tensor dspark cannot use in place (read-only, strided, dtype)."""


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

# PEP 3118 / struct format letters -> (kind, whether the item size fixes the dspark type).
# Signed and unsigned integers of every C width map by their item size (`l` is 8 bytes on
# LP64, 4 on Windows; the exporter's itemsize is what counts); floats by letter.
_SIGNED = "bhilqn"
_UNSIGNED = "BHILQN"
_INTS = {1: "8", 4: "32", 8: "64"}
_FLOATS = {("e", 2): "f16", ("f", 4): "f32", ("d", 8): "f64"}
_NATIVE_ORDER = "@=<" if sys.byteorder == "little" else "@=>!"
_SUPPORTED = "float16, float32, float64, int8, uint8, int32, uint32, int64, uint64"


def _format_dtype(fmt, itemsize):
    """dspark's type name for a buffer's element format, or None."""
    if fmt and fmt[0] in "@=<>!":
        if fmt[0] not in _NATIVE_ORDER:
            return None
        fmt = fmt[1:]
    if len(fmt) != 1:
        return None
    if (fmt, itemsize) in _FLOATS:
        return _FLOATS[(fmt, itemsize)]
    bits = _INTS.get(itemsize)
    if bits is None:
        return None
    if fmt in _SIGNED:
        return "i" + bits
    if fmt in _UNSIGNED or fmt == "c":
        return "u" + bits
    return None


def is_tensor(x):
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _kind(x):
    return f"{type(x).__module__}.{type(x).__qualname__}"


def _tensor(x, writable, what):
    if x.device.type != "cpu":
        raise UnavailableError(
            f"dspark: {what} is a {x.device.type} tensor; dspark.Communicator takes CPU "
            "tensors and numpy arrays (CUDA tensors go through the torch backend)"
        )
    dt = TORCH_DTYPES.get(str(x.dtype))
    if dt is None:
        raise _BadBuffer(
            f"dspark: {what} has dtype {x.dtype}, which dspark does not reduce or move "
            f"(supported: {', '.join(sorted(TORCH_DTYPES))})"
        )
    if not x.is_contiguous():
        raise _BadBuffer(
            f"dspark: {what} is not contiguous (shape {tuple(x.shape)}, stride "
            f"{x.stride()}); pass x.contiguous() and copy the result back"
        )
    ptr, count = x.data_ptr(), x.numel()
    storage = x.untyped_storage()
    start, size = storage.data_ptr(), storage.nbytes()
    nbytes = count * x.element_size()
    # The pointer and length must lie inside the storage that is kept: a tensor subclass
    # (or a wrapper without storage) that claims another range is refused.
    if nbytes and not (start <= ptr and ptr + nbytes <= start + size):
        raise _BadBuffer(
            f"dspark: {what} ({_kind(x)}) claims {nbytes} bytes at {ptr:#x}, outside its "
            f"storage ({size} bytes at {start:#x})"
        )
    # The storage, not only the tensor: `set_()` or `del` on the tensor while a
    # non-blocking call runs leaves this storage, and its memory, alive.
    return ptr, count, dt, (x, storage)


def describe(x, writable, what="buffer"):
    """Returns ``(pointer, count, dtype, keep)`` of a contiguous CPU tensor or buffer:
    ``keep`` must be referenced for as long as dspark uses the pointer. Raises
    ``InvalidArgumentError`` (also a ``TypeError`` or ``ValueError``) saying why ``x``
    cannot be used in place."""
    if is_tensor(x):
        return _tensor(x, writable, what)
    try:
        view = memoryview(x)
    except TypeError:
        raise _NotABuffer(
            f"dspark: {what} is a {_kind(x)}, which is neither a torch tensor nor an "
            "object with the buffer protocol (a numpy array, bytearray, array.array, "
            "memoryview)"
        ) from None
    except (ValueError, BufferError) as e:
        view = _bfloat16_view(x)
        if view is None:
            raise _BadBuffer(f"dspark: {what} ({_kind(x)}) cannot be exported: {e}") from None
        dt = "bf16"
    else:
        dt = _format_dtype(view.format, view.itemsize)
        if dt is None:
            raise _BadBuffer(
                f"dspark: {what} ({_kind(x)}) has element format {view.format!r} of "
                f"{view.itemsize} bytes, which dspark does not reduce or move (supported: "
                f"{_SUPPORTED}, native byte order)"
            )
    if writable and view.readonly:
        raise _BadBuffer(f"dspark: {what} ({_kind(x)}) is read-only and dspark writes it")
    if not view.c_contiguous:
        raise _BadBuffer(
            f"dspark: {what} ({_kind(x)}) is not C-contiguous; pass "
            "numpy.ascontiguousarray(x) and copy the result back"
        )
    # The address comes from the view kept below (the exporter fills it in); a second
    # export of `x` could be other memory (a class whose `__buffer__` makes a new one).
    ptr = _buffer_address(view, writable)
    return ptr, view.nbytes // view.itemsize, dt, view


def _bfloat16_view(x):
    """A ``uint16`` memoryview of a numpy array of ml_dtypes' bfloat16, else None."""
    np = sys.modules.get("numpy")
    if np is None or not isinstance(x, np.ndarray):
        return None
    if x.dtype.name != "bfloat16" or x.dtype.itemsize != 2:
        return None
    try:
        return memoryview(np.ndarray.view(x, np.uint16))
    except (TypeError, ValueError, BufferError):
        return None
