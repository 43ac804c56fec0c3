"""dspark's errors as torch.distributed's (part of :mod:`dspark.torch`)."""

import torch.distributed as dist

from . import _dspark
from . import _flight

# dspark's errors as torch sees them: each class raised through this backend is also the
# torch.distributed error that names the same failure, where this torch has it (2.15:
# DistBackendError, DistNetworkError, DistStoreError; all RuntimeErrors), so code written
# for gloo or NCCL (`except dist.DistBackendError`) catches dspark's too, and
# `except dspark.TimeoutError` still works. The plain `dspark` module never imports torch:
# the subclasses live here, made once per (dspark class, torch classes).
_DistBackendError = getattr(dist, "DistBackendError", None)
_DistNetworkError = getattr(dist, "DistNetworkError", None)
_DistStoreError = getattr(dist, "DistStoreError", None)
_TORCH_BASES = {
    _dspark.TimeoutError: (_DistBackendError,),
    _dspark.PeerLostError: (_DistNetworkError, _DistBackendError),
    _dspark.IoError: (_DistNetworkError, _DistBackendError),
    _dspark.AbortedError: (_DistBackendError,),
    _dspark.MismatchError: (_DistBackendError,),
    _dspark.InternalError: (_DistBackendError,),
}
_TORCH_CLASSES = {}
_MAPPED = set()
# What the Rust side puts in the message of an error the rendezvous store raised.
_STORE_MARK = "rendezvous: store "


def _torch_class(cls, store):
    key = (cls, store)
    got = _TORCH_CLASSES.get(key)
    if got is None:
        bases = tuple(b for b in _TORCH_BASES.get(cls, ()) if b is not None)
        if store and _DistStoreError is not None:
            bases = (_DistStoreError, *bases)
        got = cls
        if bases:
            try:
                got = type(cls.__name__, (cls, *bases), {
                    "__module__": "dspark.torch",
                    "__doc__": f"{cls.__doc__} Also {', '.join(b.__name__ for b in bases)}.",
                })
                _MAPPED.add(got)
            except TypeError:  # a torch whose error classes cannot be mixed in: keep dspark's
                got = cls
        _TORCH_CLASSES[key] = got
    return got


def _torch_error(e, deadline_s=None, rendezvous=False):
    """`e` (a dspark error) as the class torch's conventions recognise (see above); a
    timeout's message also starts as torch's backends' do ("... Timed out waiting 1000ms",
    which torch's tests match with ``" (Timed out|closed|timeout) "``). `rendezvous`: `e`
    ended a group's creation, where a timeout means ranks did not all join, which gloo
    reports as the store's (``DistStoreError``). Anything else is returned as it is."""
    _flight.on_error(e)  # TORCH_FR_DUMP_ON_TIMEOUT: dump, and ask the other ranks to dump
    cls = type(e)
    if cls in _MAPPED or cls not in _TORCH_BASES:
        return e
    msg = str(e)
    store = _STORE_MARK in msg or (rendezvous and issubclass(cls, _dspark.TimeoutError))
    new_cls = _torch_class(cls, store)
    if new_cls is cls:
        return e
    if issubclass(cls, _dspark.TimeoutError):
        ms = f" {int(deadline_s * 1000)}ms" if deadline_s else ""
        msg = f"dspark: Timed out waiting{ms}: {msg}"
    new = new_cls(msg)
    new.__traceback__ = e.__traceback__
    return new
