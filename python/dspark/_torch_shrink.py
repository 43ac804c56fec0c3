"""``dist.shrink_group`` for the dspark torch backend (both routes).

torch 2.15's ``shrink_group(ranks, group, shrink_flags)`` asks the group's backend for the
device (``pg._get_backend(device)``: on the ProcessGroup route the group itself, on the
Backend route the :class:`~dspark.torch.DsparkBackend`) whether it ``supports_shrinking``,
then calls ``shrink(sorted_excluded, flags, options)`` on every survivor and registers what
it returns as the cpu backend of a new ``ProcessGroup`` (so a shrunk group always takes the
Backend route), and destroys the old group.

Here: ``SHRINK_ABORT`` aborts the group's communicators first (what is in flight fails at
once); the group's dspark communicator shrinks (:meth:`dspark.Communicator.shrink`: the
survivors agree over their own connections with the group's deadline, also after a lost
peer or an abort; no store is needed, so a shrink works when the store's host is the rank
that died); the new communicator is wrapped in a :class:`~dspark.torch.DsparkBackend` with
its own point-to-point communicators (split from it), and a key prefix of the old store for
``dist.monitored_barrier``. dspark's errors come out as torch's (``DistBackendError`` ...).

torch 2.15 registers whatever a backend's ``shrink`` returns for the cpu as a *gloo* backend
(``_create_shrunk_process_group``), and DDP's logger then treats it as ProcessGroupGloo:
a segmentation fault in ``DistributedDataParallel(..., process_group=shrunk)``. So the first
shrink wraps that torch function once: a group whose new backend is dspark's is registered
again as a custom backend (its name "custom", as every dspark group on the Backend route).
"""

import torch.distributed as dist

from . import _dspark

# torch's flag values (torch.distributed.distributed_c10d.SHRINK_ABORT); read here so that a
# torch without them still imports this module.
SHRINK_ABORT = getattr(dist.distributed_c10d, "SHRINK_ABORT", 0x01)


def _register_as_custom():
    """Wraps torch's ``_create_shrunk_process_group`` (once) so that a group shrunk by dspark
    holds its backend as a custom one, not as gloo (see the module docs)."""
    c10d = dist.distributed_c10d
    orig = getattr(c10d, "_create_shrunk_process_group", None)
    if orig is None:
        # Another torch than the 2.15 this was written against: the shrunk group keeps
        # whatever backend type torch gives it (2.15 says gloo, and DDP's logger crashed on
        # that). Say so once, rather than fail later without a word.
        import warnings

        warnings.warn(
            "dspark: this torch has no distributed_c10d._create_shrunk_process_group; a group "
            "made by shrink_group is registered as torch decides (torch 2.15 registers it as "
            "gloo, which DDP's logger mishandles)",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    if getattr(orig, "_dspark_wrapped", False):
        return

    def create(new_backend, *args, **kwargs):
        pg = orig(new_backend, *args, **kwargs)
        from . import torch as dt

        if dt.DsparkBackend is not None and isinstance(new_backend, dt.DsparkBackend):
            import torch

            custom = dist.ProcessGroup.BackendType.CUSTOM
            device = getattr(pg, "bound_device_id", None) or torch.device("cpu")
            pg._register_backend(device, custom, new_backend)
            pg._set_default_backend(custom)
        return pg

    create._dspark_wrapped = True
    c10d._create_shrunk_process_group = create


def shrink(group, ranks_to_exclude, shrink_flags=0, opts=None):
    """The body of ``DsparkBackend.shrink`` / ``DsparkProcessGroup.shrink``."""
    from . import torch as dt

    if dt.DsparkBackend is None:
        raise dt.UnavailableError(
            "dspark: shrinking needs torch >= 2.14 (a Python c10d Backend to return)"
        )
    _register_as_custom()
    excluded = sorted(int(r) for r in ranks_to_exclude)
    if shrink_flags & SHRINK_ABORT:
        # Aborted first (what is in flight on any of the group's communicators fails at
        # once), once the ranks are known good: a refused call leaves the group as it was.
        n, me = group._comm.world_size, group._comm.rank
        if all(0 <= r < n for r in excluded) and me not in excluded:
            group.abort()
    try:
        comm = group._comm.shrink(excluded)
    except _dspark.Error as e:
        raise dt._torch_error(e, group._deadline) from None
    # Each shrink of this group gets its own key space in the store (monitored_barrier).
    n = getattr(group, "_shrinks", 0)
    group._shrinks = n + 1
    store = dist.PrefixStore(
        f"dspark-shrink/{n}/{','.join(map(str, excluded))}/", group._store
    )
    timeout = getattr(opts, "_timeout", None) or group._timeout
    return dt.DsparkBackend(store, comm.rank, comm.world_size, timeout, None, comm)
