"""The two routes into torch (part of :mod:`dspark.torch`): :class:`DsparkBackend`, a c10d
``Backend`` (torch >= 2.14), and :class:`DsparkProcessGroup`, a Python ``ProcessGroup``;
:func:`_route` chooses per group, :func:`_create` is the factory torch calls."""

import os
import sys
import warnings

import torch
import torch.distributed as dist

from . import _flight
from ._dspark import UnavailableError
from ._torch_args import NAME
from ._torch_ops import _Ops


def _probe_backend_route():
    """Whether torch has the Python Backend trampoline (torch >= 2.14)."""
    try:
        from torch._C._distributed_c10d import Backend as C10DBackend

        class _Probe(C10DBackend):
            pass

        _Probe(0, 1)
        return True
    except Exception:  # noqa: BLE001 - "No constructor defined!" before 2.14
        return False


_HAS_PY_BACKEND = _probe_backend_route()

if _HAS_PY_BACKEND:
    from torch._C._distributed_c10d import Backend as _C10DBackend

    class DsparkBackend(_Ops, _C10DBackend):
        """dspark as a c10d ``Backend`` (torch >= 2.14)."""

        __module__ = "dspark.torch"

        def __init__(self, store, rank, size, timeout, group_id=None, comm=None):
            _C10DBackend.__init__(self, rank, size)
            self._setup(store, rank, size, timeout, group_id, comm)
            self._options = _C10DBackend.Options(NAME, timeout=self._timeout)

        @property
        def options(self):
            return self._options

        @property
        def supports_splitting(self):
            return False

        @property
        def supports_coalescing(self):
            return False

else:
    DsparkBackend = None


class DsparkProcessGroup(_Ops, dist.ProcessGroup):
    """dspark as a Python ``ProcessGroup`` (every group that is dspark's alone, and every
    group on torch before 2.14; :func:`_route`). Keeps its own group name and description: a pure-Python
    ``ProcessGroup`` has no backend to hold them, and FSDP2's DeviceMesh needs them."""

    __module__ = "dspark.torch"

    def __init__(self, store, rank, size, timeout, group_id=None):
        dist.ProcessGroup.__init__(self, rank, size)
        self._setup(store, rank, size, timeout, group_id)
        self._name = group_id or ""
        self._desc = ""

    def getGroupName(self):
        return self._name

    def setGroupName(self, name):
        self._name = name

    def _set_group_name(self, name):
        self._name = name

    @property
    def group_name(self):
        return self._name

    def getGroupDesc(self):
        return self._desc

    def setGroupDesc(self, desc):
        self._desc = desc

    def _set_group_desc(self, desc):
        self._desc = desc

    @property
    def group_desc(self):
        return self._desc

    def _get_backend(self, device=None):
        return self

    @property
    def _device_types(self):
        # torch's `dist.monitored_barrier` refuses a group without "cpu" here, and a group
        # that replaced torch's (this route) has no backends registered, so the list is
        # empty. Only that caller is told "cpu": the other readers of this list (object
        # collectives, the flight recorder's hook, shutdown) go on seeing what they always
        # saw, which is what they were written and tested against.
        f = sys._getframe(1)
        if (f.f_code.co_name == "monitored_barrier"
                and f.f_globals.get("__name__") == "torch.distributed.distributed_c10d"):
            return [torch.device("cpu")]
        return dist.ProcessGroup._device_types.__get__(self)

    def name(self):
        return NAME


def _group_backends():
    """The backend torch is creating this group with, per device (``{"cpu": "dspark",
    "cuda": "nccl"}``), read from the caller's ``backend_config``; None where it cannot be
    read (torch without that local: the caller then takes the Backend route, which is right
    for every backend string)."""
    f = sys._getframe(1)
    for _ in range(4):
        f = f.f_back
        if f is None:
            return None
        cfg = f.f_locals.get("backend_config")
        if cfg is not None and hasattr(cfg, "get_device_backend_map"):
            try:
                return {str(d): str(b).lower() for d, b in cfg.get_device_backend_map().items()}
            except Exception:  # noqa: BLE001 - a torch whose config differs: no answer
                return None
    return None


def _route():
    """``"backend"`` or ``"pg"``: how the group torch is creating plugs in.

    ``DSPARK_TORCH_ROUTE=backend|pg`` forces one. Otherwise: torch before 2.14 has only the
    ProcessGroup route. From 2.14 a group that is dspark's on every device takes the
    ProcessGroup route too: ``dist.all_reduce`` then calls dspark's Python method directly,
    where the Backend route goes through c10d's C++ ProcessGroup, its dispatcher and the
    Python trampoline back, about 8 µs more per call (torch 2.15, benches/torch_overhead.py).
    A group that shares its devices with another backend (``cpu:dspark,cuda:nccl``) must be
    a Backend: torch replaces the whole group with a ProcessGroup a factory returns.
    """
    forced = os.environ.get("DSPARK_TORCH_ROUTE", "").strip().lower()
    if forced == "pg" or not _HAS_PY_BACKEND:
        if forced == "backend":
            raise UnavailableError(
                "dspark: DSPARK_TORCH_ROUTE=backend needs torch >= 2.14 (a Python c10d "
                f"Backend); this is torch {torch.__version__}"
            )
        return "pg"
    if forced == "backend":
        return "backend"
    backends = _group_backends()
    if backends is None:
        # Degraded, not wrong: say so once.
        global _ROUTE_WARNED
        if not _ROUTE_WARNED:
            _ROUTE_WARNED = True
            warnings.warn(
                "dspark: could not read which backends this torch "
                f"({torch.__version__}) creates the group with; using c10d's Backend route, "
                "about 8 us more per call than the ProcessGroup route "
                "(DSPARK_TORCH_ROUTE=pg forces that one for groups that are dspark's alone)",
                RuntimeWarning,
                stacklevel=2,
            )
        return "backend"
    if all(b == NAME for b in backends.values()):
        return "pg"
    return "backend"


_ROUTE_WARNED = False


def _create(opts, backend_options=None):
    """The extended-API factory torch calls for every group this rank is in."""
    cls = DsparkBackend if _route() == "backend" else DsparkProcessGroup
    group = cls(
        opts.store,
        opts.group_rank,
        opts.group_size,
        getattr(opts, "timeout", None),
        getattr(opts, "group_id", None),
    )
    # init_process_group(device_id=...) bound torch's own group to a device before asking
    # for the backend; a group that replaces it keeps the binding.
    bound = getattr(getattr(opts, "process_group", None), "bound_device_id", None)
    if bound is not None and cls is DsparkProcessGroup:
        try:
            group.bound_device_id = bound
        except Exception:  # noqa: BLE001 - a torch without the setter: nothing to keep
            pass
    _flight.register(group, opts)  # TORCH_FR_*: torch's flight-recorder dumps
    return group
