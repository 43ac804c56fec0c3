"""``dist.all_reduce`` of sparse COO tensors for the dspark torch backend, as gloo does it:
each rank's tensor is coalesced, every rank's indices and values are gathered, and the sum
is their concatenation, coalesced, copied into each rank's tensor (whose number of stored
elements changes to the result's).

Three all_gathers on the group's communicator: the shapes (so that ranks whose tensors
disagree all raise the same error instead of one waiting), then the indices and the values,
each padded to the largest count of stored elements. SUM only (gloo's sparse all_reduce has
no other operator). The call completes before it returns; its Work is a completed one.
"""

import zlib

import torch

from . import _dspark

# Dimensions a sparse tensor may have here (the shapes travel in a fixed-size record).
_MAX_DIMS = 64


def _op_name(red):
    """A ReduceOp's name (`ReduceOp.RedOpType.MAX` prints as `RedOpType.MAX`)."""
    return str(red).split(".")[-1]


def all_reduce(ops, tensors, opts):
    """`allreduce` of `tensors` (sparse COO, CPU) on `ops` (a dspark `_Ops`)."""
    from . import torch as _t  # the backend module (imports this one lazily)

    red = getattr(opts.reduceOp, "op", opts.reduceOp)
    if red != torch.distributed.ReduceOp.SUM:
        raise _dspark.InvalidArgumentError(
            f"dspark: allreduce of a sparse tensor sums (as gloo's); {_op_name(red)} is not "
            "supported"
        )
    timeout = _t._seconds(getattr(opts, "timeout", None))
    try:
        for t in tensors:
            _one(ops, t, timeout, _t)
    except _dspark.Error as e:
        raise _t._torch_error(e, timeout or ops._deadline) from None
    return _t._Done(list(tensors))


def _one(ops, t, timeout, _t):
    if not t.is_sparse:
        raise _dspark.InvalidArgumentError(
            "dspark: allreduce takes all sparse tensors or none (a strided one came with a "
            "sparse one)"
        )
    if t.device.type != "cpu":
        raise _dspark.UnavailableError(
            f"dspark: allreduce of a sparse tensor runs on CPU; this one is on {t.device}"
        )
    if t.dim() > _MAX_DIMS:
        raise _dspark.InvalidArgumentError(
            f"dspark: allreduce of a sparse tensor of {t.dim()} dimensions (at most {_MAX_DIMS})"
        )
    comm, n = ops._comm, ops._n
    c = t.coalesce()
    idx, vals = c._indices().contiguous(), c._values().contiguous()
    nnz = c._nnz()
    # The shapes: sparse and dense dimensions, stored elements, sizes, value type.
    meta = torch.zeros(4 + _MAX_DIMS, dtype=torch.int64)
    meta[0], meta[1], meta[2], meta[3] = t.sparse_dim(), t.dense_dim(), nnz, _dtype_code(t)
    meta[4:4 + t.dim()] = torch.tensor(list(t.shape), dtype=torch.int64)
    metas = _gather(comm, meta, n, timeout, _t).view(n, -1)
    for r in range(n):
        if not torch.equal(metas[r, [0, 1, 3]], meta[[0, 1, 3]]) or not torch.equal(
            metas[r, 4:], meta[4:]
        ):
            raise _dspark.InvalidArgumentError(
                f"dspark: allreduce of sparse tensors: rank {ops._r} has "
                f"{_describe(meta)} but rank {r} has {_describe(metas[r])}"
            )
    counts = metas[:, 2].tolist()
    most = max(counts)
    if most == 0:
        t.copy_(c)
        return
    sd = t.sparse_dim()
    dense = list(vals.shape[1:])
    pi = torch.zeros((sd, most), dtype=torch.int64)
    pi[:, :nnz] = idx
    pv = torch.zeros([most] + dense, dtype=vals.dtype)
    pv[:nnz] = vals
    all_i = _gather(comm, pi.contiguous(), n, timeout, _t).view(n, sd, most)
    all_v = _gather(comm, pv, n, timeout, _t).view([n, most] + dense)
    indices = torch.cat([all_i[r, :, : counts[r]] for r in range(n)], dim=1)
    values = torch.cat([all_v[r, : counts[r]] for r in range(n)], dim=0)
    out = torch.sparse_coo_tensor(indices, values, t.shape, dtype=t.dtype).coalesce()
    t.copy_(out)


def _gather(comm, x, n, timeout, _t):
    """all_gather of the contiguous CPU tensor `x` on `comm`: n copies' worth, rank order."""
    out = torch.empty([n * x.numel()], dtype=x.dtype)
    send, dt = _t._flat(x.reshape(-1))
    recv, _ = _t._flat(out)
    comm._run("all_gather", dt, send.data_ptr(), recv.data_ptr(), send.numel(), None, 0,
              timeout)
    return out


def _dtype_code(t):
    """The value type as a number every rank computes alike."""
    return zlib.crc32(str(t.dtype).encode()) & 0x7FFF_FFFF


def _describe(meta):
    sd, dd = int(meta[0]), int(meta[1])
    sizes = [int(v) for v in meta[4:4 + sd + dd]]
    return (f"a sparse tensor of size {sizes} ({sd} sparse, {dd} dense dimensions, value "
            f"type #{int(meta[3])})")
