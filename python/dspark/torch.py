"""dspark as a ``torch.distributed`` backend: ``init_process_group(backend="dspark")``.

Registration needs no ``import dspark``: torch >= 2.14 finds :func:`register` through the
``torch.distributed.backends`` entry point, older torch through the ``torch.backends``
autoload hook. ``import dspark.torch`` registers explicitly.

How it plugs in (see the README's PyTorch section):

- torch >= 2.14: :class:`DsparkBackend`, a Python subclass of c10d's ``Backend`` (torch's
  ``PyBackend`` trampoline, as torch's own nccl4py backend), for a group that shares its
  devices with another backend (``cpu:dspark,cuda:nccl``). A group that is dspark's alone
  (``backend="dspark"``), and every group on older torch: :class:`DsparkProcessGroup`, a
  Python ``ProcessGroup`` with both generations of method names and its own group-name
  storage, which ``dist.all_reduce`` calls without torch's C++ dispatch and trampoline
  (about 8 µs less per call on torch 2.15; :func:`_route`). ``DSPARK_TORCH_ROUTE=backend|pg``
  forces one.
- Rendezvous: through the store torch hands the factory (a ``PrefixStore`` per group), never
  by binding ``MASTER_PORT``. ``new_group`` and several groups per process work: each group
  is its own dspark communicator with its own sequence numbers and mismatch checks.
- Work: every Work's ``get_future()`` completes with the tensor list (DDP requires it).
  Synchronous calls (``async_op=False``) run at once on the caller's thread with the GIL
  released; asynchronous ones run on the communicator's progress thread, or on the backend's
  thread that waits for them (which runs them rather than wake the progress thread), and
  complete in issue order (all_to_all on CUDA tensors completes before returning). The timeout of ``init_process_group(timeout=...)`` is every
  call's deadline (torch has no watchdog for Python backends: dspark's deadlines are the
  guard).
- Errors: dspark's classes, each raised through this backend as a subclass that is also
  the matching ``torch.distributed`` error (``DistBackendError``, ``DistNetworkError``,
  ``DistStoreError``; :func:`_torch_error`), a timeout's message with torch's "Timed out".
  ``Work.wait()`` raises an asynchronous operation's error. ``dist.monitored_barrier``
  names the ranks that did not arrive, as gloo's (:meth:`_Ops.monitored_barrier`).
- Asynchronous operations hold their tensors and the tensors' storages until they
  completed, so ``del`` or ``set_()`` of a tensor in flight is harmless. As with torch's
  own backends, growing a tensor in flight with ``resize_`` (which reallocates its storage
  in place) or using it before the Work completed is the caller's error.
- Tensors reach dspark as data pointers: no copies for contiguous tensors of float32,
  float64, float16, bfloat16, int8, uint8, int32, int64 (and uint32, uint64, bool, complex
  where an op makes sense for them). Non-contiguous tensors are copied to contiguous ones and
  back; never is wrong data sent.

The code is split by concern; every name is importable from here as before:
``_torch_args`` (op, dtype and timeout tables; tensors as buffers), ``_torch_errors``
(dspark's errors as torch's), ``_torch_work`` (Work objects and their completer thread),
``_torch_ops`` (a group's set-up, the path into dspark, barriers), ``_torch_collectives``
(each collective's argument handling), ``_torch_route`` (the two routes and the factory).
"""

import threading

import torch.distributed as dist

from . import _dspark  # noqa: F401 - as before, `dspark.torch._dspark`
from . import _flight
from ._buffers import TORCH_DTYPES  # noqa: F401
from ._dspark import InvalidArgumentError, UnavailableError  # noqa: F401
from ._torch_args import (  # noqa: F401
    _BOOL_OPS,
    _FAST_DTYPES,
    _FAST_OPS,
    _OPS,
    _RED,
    _UNSET_TIMEOUT,
    _UNSUPPORTED_OPS,
    NAME,
    _AllgatherOptions,
    _chain,
    _check_device,
    _fast_op_table,
    _flat,
    _input,
    _output,
    _premul_factor,
    _seconds,
)
from ._torch_errors import (  # noqa: F401
    _MAPPED,
    _STORE_MARK,
    _TORCH_BASES,
    _TORCH_CLASSES,
    _DistBackendError,
    _DistNetworkError,
    _DistStoreError,
    _torch_class,
    _torch_error,
)
from ._torch_work import (  # noqa: F401
    _LANES,
    _STOP_WAIT_S,
    _async_work,
    _AsyncWork,
    _Completer,
    _Done,
    _Failure,
    _Pending,
    _stop_completers,
    _unwrap,
)
from ._torch_ops import _Ops  # noqa: F401
from ._torch_route import (  # noqa: F401
    _HAS_PY_BACKEND,
    DsparkBackend,
    DsparkProcessGroup,
    _create,
    _group_backends,
    _probe_backend_route,
    _route,
)

__all__ = ["register", "info", "DsparkBackend", "DsparkProcessGroup", "NAME"]


def dump_flight_record(path=None):
    """Writes this rank's flight record of every dspark group in torch's flight-recorder
    format (what ``torchfrtrace`` reads) to ``path``, by default
    ``${TORCH_FR_DUMP_TEMP_FILE}<global rank>`` (``/tmp/nccl_trace_rank_<rank>``); returns
    the path. The on-demand counterpart of ``TORCH_FR_DUMP_ON_TIMEOUT`` (see
    ``dspark/_flight.py``); ``flight_record_bytes()`` gives the pickle instead."""
    return _flight.dump(path)


def write_flight_records(directory):
    """Writes this rank's dspark flight records (every communicator of every dspark group,
    dspark's own JSON format) into ``directory``; returns the files. With every rank's in one
    directory, ``dspark analyze directory`` says which rank the others wait for: the one that
    hung, or, in a job that is only slow, the one that starts its collectives last (a
    straggler) and by how much. Any thread, any time: it never waits for an operation."""
    return _flight.write_records(directory)


def flight_record_bytes():
    """This rank's flight record in torch's format, pickled: what
    ``torch._C._distributed_c10d._dump_fr_trace()`` returns for torch's own backends."""
    return _flight.dump_bytes()


def info(group=None):
    """The facts of the dspark communicator behind ``group`` (default: the world group), as
    :meth:`dspark.Communicator.info` gives them: the transport and why not a faster one, the
    path CUDA tensors take on every connection and why (``device_path``, ``device_paths``:
    ``shm/staged``, ``tcp/staged``, ``verbs/gdr-dmabuf``, ...), where all_reduce switches
    algorithm, CPU sharing, rendezvous and authentication. ``cuda_backend`` names the backend
    CUDA tensors of the group go to: ``"dspark"``, or another one (``cpu:dspark,cuda:nccl``:
    ``"nccl"``, and ``device_path`` is then the path dspark would take, not theirs), or
    ``None`` where the group has no CUDA backend. Raises ``ValueError`` where no device of
    the group is dspark's."""
    import torch

    g = dist.group.WORLD if group is None else group
    if g is None:
        raise ValueError("dspark.torch.info: no default process group (init_process_group first)")
    if g is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("dspark.torch.info: this rank is not a member of the group")

    def backend_of(device):
        try:
            return g._get_backend(torch.device(device))
        except (RuntimeError, ValueError, KeyError):  # no backend for that device
            return None

    backends = {d: backend_of(d) for d in ("cpu", "cuda")}
    ours = [b for b in backends.values() if hasattr(b, "dspark_info")]
    if not ours:
        raise ValueError(f"dspark.torch.info: group {g} has no dspark backend")
    facts = ours[0].dspark_info()
    cuda = backends["cuda"]
    if cuda is None:
        facts["cuda_backend"] = None
    elif hasattr(cuda, "dspark_info"):
        facts["cuda_backend"] = "dspark"
    else:
        name = getattr(cuda, "name", None)
        facts["cuda_backend"] = name() if callable(name) else type(cuda).__name__
    return facts


_registered = threading.Lock()


def register():
    """Registers backend ``"dspark"`` with torch.distributed (idempotent). torch calls this
    through the package's entry point; call it yourself only on torch without one."""
    with _registered:
        if hasattr(dist.Backend, NAME.upper()) and NAME.upper() in getattr(
            dist.Backend, "_plugins", {NAME.upper(): None}
        ):
            return
        dist.Backend.register_backend(
            NAME, _create, extended_api=True, devices=["cpu", "cuda"]
        )


register()
