"""The collectives' argument handling (part of :mod:`dspark.torch`): each of torch's
collective methods checks its tensors and turns them into dspark calls, which
:meth:`~dspark._torch_ops._Ops._go` runs."""

import warnings

import torch
import torch.distributed as dist

from . import _dspark
from ._dspark import InvalidArgumentError
from ._torch_args import (
    _FAST_DTYPES,
    _FAST_OPS,
    _UNSET_TIMEOUT,
    _AllgatherOptions,
    _chain,
    _check_device,
    _flat,
    _input,
    _output,
    _seconds,
)
from ._torch_errors import _torch_error
from ._torch_work import _async_work, _Done


# Reducing a multi-tensor list here before the call (the ops gloo takes for it).
_LOCAL_OPS = {"sum": torch.add, "prod": torch.mul, "min": torch.minimum, "max": torch.maximum}


def _same_shape(tensors, what):
    """gloo's rule for a multi-tensor list: every tensor of the first's shape and dtype;
    and dspark's: on its device (the list is reduced or copied in one place)."""
    t = tensors[0]
    if any(x.shape != t.shape or x.dtype != t.dtype for x in tensors[1:]):
        raise InvalidArgumentError(
            f"dspark: {what} of a list of {len(tensors)} tensors: they must all be "
            f"{t.dtype} of shape {tuple(t.shape)}, as the first (as gloo)"
        )
    if any(x.device != t.device for x in tensors[1:]):
        raise InvalidArgumentError(
            f"dspark: {what} of a list of {len(tensors)} tensors: they must all be on "
            f"{t.device}, as the first (dspark runs one device per process)"
        )


def _copy_into(tensors, buf):
    """A completion step: `buf`'s elements into each of `tensors` (a multi-tensor list's
    one result)."""
    def copy_out():
        for t in tensors:
            t.copy_(buf.view(t.shape))

    return copy_out


def _single(items, what, of):
    """gloo's rule for gather and scatter: one tensor (or list) per call, not a list of
    several (their first alone was used, the rest ignored). The root's output (gather) or
    input (scatter) lists are checked on the root only, as gloo does (the other ranks pass
    none): a root that refuses them leaves the others' sends or receives to time out."""
    if len(items) != 1:
        raise InvalidArgumentError(
            f"dspark: {what} takes a single-element {of} list, not {len(items)} (as gloo)"
        )


class _Collectives:
    """torch's collective methods (a part of :class:`~dspark._torch_ops._Ops`)."""

    # -- all_reduce --------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceOptions()
        # The common case (one contiguous CPU tensor, a plain op: every DDP bucket, every
        # dist.all_reduce) without the general path's bookkeeping: a handful of attribute
        # reads and one native call with plain ints.
        if len(tensors) == 1 and self._collect is None:
            t = tensors[0]
            op = _FAST_OPS.get(hash(opts.reduceOp))
            dt = _FAST_DTYPES.get(t.dtype)
            if (op is not None and dt is not None and t.is_cpu and not t.is_sparse
                    and t.is_contiguous()):
                td = opts.timeout
                timeout = None if td == _UNSET_TIMEOUT else _seconds(td)
                try:
                    if opts.asyncOp:
                        p = t.data_ptr()
                        # The storage too: see `_go`.
                        w = self._comm._start("all_reduce", _dspark._FAST_DTYPES[dt], p, p,
                                              t.numel(), (tensors, t.untyped_storage()),
                                              _dspark._FAST_OPS[op], 0, timeout)
                        return _async_work(self._completer, [w], tensors, None,
                                           timeout or self._deadline, (id(self._comm),))
                    self._all_reduce(t.data_ptr(), t.numel(), dt, op, timeout)
                except _dspark.Error as e:
                    raise _torch_error(e, timeout or self._deadline) from None
                self._sync_tensors[0] = t
                return self._sync_work
        if any(t.is_sparse for t in tensors):
            from ._sparse import all_reduce as sparse_all_reduce  # as gloo's

            return sparse_all_reduce(self, tensors, opts)
        if len(tensors) > 1:
            return self._allreduce_list(tensors, opts)
        return self._allreduce_each(tensors, opts)

    def _allreduce_each(self, tensors, opts):
        """Each tensor reduced across the ranks on its own (a coalesced call's tensors)."""
        calls, keep, fin = [], list(tensors), []
        for t in tensors:
            op, factor = self._op(opts.reduceOp, t.dtype, "allreduce")
            out = _output(t, "allreduce tensor", fin)
            src = out
            if factor is not None:
                src = out * factor
                keep.append(src)
            calls.append(("all_reduce", src, out, None, op, 0))
            keep.append(out)
        return self._go(opts, calls, keep, list(tensors), fin)

    def _allreduce_list(self, tensors, opts):
        """torch's multi-tensor form (one tensor per device, as gloo takes it on CPU): every
        tensor of the list, on every rank, is reduced into one result that each of them
        receives. Reduced here first, then across the ranks in one call."""
        _same_shape(tensors, "allreduce")
        op, factor = self._op(opts.reduceOp, tensors[0].dtype, "allreduce")
        local = _LOCAL_OPS.get(op)
        if factor is not None or local is None:
            raise InvalidArgumentError(
                f"dspark: allreduce of a list of {len(tensors)} tensors (torch's multi-tensor "
                "form, reduced across the list as gloo does) takes SUM, PRODUCT, MIN or MAX"
            )
        acc = _input(tensors[0], "allreduce tensor").clone()
        try:
            for t in tensors[1:]:
                acc = local(acc, t.reshape(acc.shape))
        except RuntimeError as e:  # a dtype torch cannot reduce here (uint32, ...)
            raise InvalidArgumentError(
                f"dspark: allreduce of a list of {len(tensors)} {acc.dtype} tensors: the "
                f"reduction across the list failed: {e}"
            ) from None
        acc = acc.contiguous()
        return self._go(opts, [("all_reduce", acc, acc, None, op, 0)], [acc, *tensors],
                        list(tensors), [_copy_into(tensors, acc)])

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._allreduce_each(tensors, opts)

    # -- broadcast ---------------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else dist.BroadcastOptions()
        root = self._root(opts.rootRank, "broadcast")
        if len(tensors) > 1:
            # torch's multi-tensor form, as gloo: the root's tensors[rootTensor] reaches every
            # tensor of the list on every rank (the root's other tensors too).
            _same_shape(tensors, "broadcast")
            k = int(opts.rootTensor)
            if not 0 <= k < len(tensors):
                raise InvalidArgumentError(
                    f"dspark: broadcast: rootTensor {k} of a list of {len(tensors)} tensors"
                )
            buf = _input(tensors[k], "broadcast tensor").clone().contiguous()
            return self._go(opts, [("broadcast", buf, buf, None, None, root)],
                            [buf, *tensors], list(tensors), [_copy_into(tensors, buf)])
        calls, keep, fin = [], list(tensors), []
        for t in tensors:
            out = _output(t, "broadcast tensor", fin)
            calls.append(("broadcast", out, out, None, None, root))
            keep.append(out)
        return self._go(opts, calls, keep, list(tensors), fin)

    # -- reduce ------------------------------------------------------------------------
    def reduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.ReduceOptions()
        root = self._root(opts.rootRank, "reduce")
        if len(tensors) != 1:
            raise InvalidArgumentError(
                f"dspark: reduce takes a single-element tensor list, not {len(tensors)} "
                "(as gloo)"
            )
        calls, keep, fin = [], list(tensors), []
        for t in tensors:
            op, factor = self._op(opts.reduceOp, t.dtype, "reduce")
            out = _output(t, "reduce tensor", fin) if self._r == root else _input(t, "reduce tensor")
            src = out if factor is None else out * factor
            calls.append(("reduce", src, out, None, op, root))
            keep += [out, src]
        return self._go(opts, calls, keep, list(tensors), fin)

    # -- all_gather --------------------------------------------------------------------
    def all_gather_single(self, output, input, opts=None):
        opts = opts if opts is not None else _AllgatherOptions()
        if output.numel() != input.numel() * self._n or output.dtype != input.dtype:
            raise InvalidArgumentError(
                f"dspark: all_gather_into_tensor: output has {output.numel()} {output.dtype} "
                f"elements, expected {input.numel()} {input.dtype} x group size {self._n}"
            )
        fin = []
        inp = _input(input, "all_gather input")
        out = _output(output, "all_gather output", fin)
        return self._go(
            opts,
            [("all_gather", inp, out, self._elems(inp), None, 0)],
            [input, output, inp, out],
            [output],
            fin,
        )

    _allgather_base = all_gather_single

    def allgather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else _AllgatherOptions()
        if len(inputs) > 1:
            return self._allgather_list(output_lists, inputs, opts)
        return self._allgather_each(output_lists, inputs, opts)

    def _allgather_list(self, output_lists, inputs, opts):
        """torch's multi-tensor form, as gloo: each rank gives its m inputs, and every output
        list (one per input) receives all n x m of them, rank by rank: ``outputs[i][r * m +
        j]`` is rank r's input j."""
        m = len(inputs)
        _same_shape(inputs, "allgather")
        t = inputs[0]
        if len(output_lists) != m or any(
            len(outs) != self._n * m or any(o.numel() != t.numel() or o.dtype != t.dtype
                                            for o in outs)
            for outs in output_lists
        ):
            raise InvalidArgumentError(
                f"dspark: allgather of a list of {m} inputs: expected {m} output lists of "
                f"{self._n * m} tensors of {t.numel()} {t.dtype} elements each (as gloo)"
            )
        inp = torch.cat([_input(x, "all_gather input").reshape(-1) for x in inputs])
        flat = torch.empty(inp.numel() * self._n, dtype=t.dtype, device=inp.device)
        k = t.numel()

        def copy_out():
            for outs in output_lists:
                for i, o in enumerate(outs):
                    o.copy_(flat[i * k:(i + 1) * k].view(o.shape))

        result = [o for outs in output_lists for o in outs]
        return self._go(opts, [("all_gather", inp, flat, self._elems(inp), None, 0)],
                        [output_lists, inputs, inp, flat], result, [copy_out])

    def _allgather_each(self, output_lists, inputs, opts):
        """Each input gathered on its own into its output list of n tensors (a coalesced
        call's inputs)."""
        calls, keep, fin = [], [output_lists, inputs], []
        for outs, t in zip(output_lists, inputs):
            if len(outs) != self._n or any(
                o.numel() != t.numel() or o.dtype != t.dtype for o in outs
            ):
                raise InvalidArgumentError(
                    f"dspark: all_gather: expected {self._n} output tensors of {t.numel()} "
                    f"{t.dtype} elements each"
                )
            inp = _input(t, "all_gather input")
            # On the input's device: a CUDA all_gather (DDP's parameter-shape check at
            # construction) must not get a CPU output.
            flat = torch.empty(t.numel() * self._n, dtype=t.dtype, device=inp.device)
            calls.append(("all_gather", inp, flat, self._elems(inp), None, 0))
            keep += [inp, flat]

            def copy_out(outs=outs, flat=flat, k=t.numel()):
                for i, o in enumerate(outs):
                    o.copy_(flat[i * k:(i + 1) * k].view(o.shape))

            fin.append(copy_out)
        # The Work's result and future value: the output tensors, as gloo's (a flat list).
        result = [o for outs in output_lists for o in outs]
        return self._go(opts, calls, keep, result, fin)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        # output_lists[rank][j] receives input j of that rank (the transpose of allgather's
        # layout, where outputs[j][rank] does).
        if len(output_lists) != self._n or any(len(o) != len(inputs) for o in output_lists):
            raise InvalidArgumentError(
                f"dspark: all_gather_coalesced: expected {self._n} output lists of "
                f"{len(inputs)} tensors each"
            )
        per_input = [[output_lists[r][j] for r in range(self._n)] for j in range(len(inputs))]
        return self._coalesced(opts, list(output_lists),
                               lambda: self._allgather_each(per_input, inputs, opts))

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else _AllgatherOptions()
        def issue():
            for o, i in zip(outputs, inputs):
                self.all_gather_single(o, i, opts)

        return self._coalesced(opts, list(outputs), issue)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # -- reduce_scatter ----------------------------------------------------------------
    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        if input.numel() != output.numel() * self._n or output.dtype != input.dtype:
            raise InvalidArgumentError(
                f"dspark: reduce_scatter_tensor: input has {input.numel()} {input.dtype} "
                f"elements, expected {output.numel()} {output.dtype} x group size {self._n}"
            )
        op, factor = self._op(opts.reduceOp, input.dtype, "reduce_scatter")
        fin = []
        inp = _input(input, "reduce_scatter input")
        if factor is not None:
            inp = inp * factor
        out = _output(output, "reduce_scatter output", fin)
        return self._go(
            opts,
            [("reduce_scatter", inp, out, self._elems(out), op, 0)],
            [input, output, inp, out],
            [output],
            fin,
        )

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        calls, keep, fin = [], [outputs, input_lists], []
        for out_t, ins in zip(outputs, input_lists):
            if len(ins) != self._n or any(
                i.numel() != out_t.numel() or i.dtype != out_t.dtype for i in ins
            ):
                raise InvalidArgumentError(
                    f"dspark: reduce_scatter: expected {self._n} input tensors of "
                    f"{out_t.numel()} {out_t.dtype} elements each"
                )
            op, factor = self._op(opts.reduceOp, out_t.dtype, "reduce_scatter")
            for i in ins:
                # CUDA too: the concatenation is queued on torch's current stream, the call
                # after it (`_go_cuda`), as all_gather's list form.
                _check_device(i, "reduce_scatter input", cuda=True)
            flat = torch.cat([i.reshape(-1) for i in ins])
            if factor is not None:
                flat.mul_(factor)
            out = _output(out_t, "reduce_scatter output", fin)
            calls.append(("reduce_scatter", flat, out, self._elems(out), op, 0))
            keep += [flat, out]
        return self._go(opts, calls, keep, list(outputs), fin)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        def issue():
            for o, i in zip(outputs, inputs):
                self.reduce_scatter_single(o, i, opts)

        return self._coalesced(opts, list(outputs), issue)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- all_to_all --------------------------------------------------------------------
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts if opts is not None else dist.AllToAllOptions()
        n = self._n
        if output.dtype != input.dtype:
            raise InvalidArgumentError(
                f"dspark: all_to_all_single: input is {input.dtype} but output is {output.dtype}"
            )
        _check_device(input, "all_to_all input", cuda=True)
        _check_device(output, "all_to_all output", cuda=True)
        if not input.is_contiguous() or not output.is_contiguous():
            # torch's own check, the same for every backend.
            raise InvalidArgumentError("dspark: all_to_all_single: Tensors must be contiguous")
        in_rows = input.size(0) if input.dim() else 1
        out_rows = output.size(0) if output.dim() else 1
        in_row = input.numel() // in_rows if in_rows else 0
        out_row = output.numel() // out_rows if out_rows else 0
        ins = list(input_split_sizes) or None
        outs = list(output_split_sizes) or None
        if ins is None:
            if in_rows % n:
                raise InvalidArgumentError(
                    f"dspark: all_to_all_single: {in_rows} input rows do not split into {n}"
                )
            ins = [in_rows // n] * n
        if outs is None:
            if out_rows % n:
                raise InvalidArgumentError(
                    f"dspark: all_to_all_single: {out_rows} output rows do not split into {n}"
                )
            outs = [out_rows // n] * n
        if (len(ins) != n or len(outs) != n or sum(ins) != in_rows or sum(outs) != out_rows
                or min(ins) < 0 or min(outs) < 0):
            raise InvalidArgumentError(
                f"dspark: all_to_all_single: split sizes {ins} / {outs} do not match "
                f"{in_rows} input / {out_rows} output rows and group size {n}"
            )
        in_counts = [s * in_row for s in ins]
        out_counts = [s * out_row for s in outs]
        return self._all_to_allv(opts, input.reshape(-1), in_counts, output.reshape(-1),
                                 out_counts, [output])

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.AllToAllOptions()
        if len(outputs) != self._n or len(inputs) != self._n:
            raise InvalidArgumentError(
                f"dspark: all_to_all: expected {self._n} input and output tensors"
            )
        dtype = inputs[0].dtype
        if any(t.dtype != dtype for t in list(inputs) + list(outputs)):
            raise InvalidArgumentError("dspark: all_to_all: tensors of different dtypes")
        for t in list(inputs) + list(outputs):
            _check_device(t, "all_to_all tensor", cuda=True)
        devices = {t.device for t in list(inputs) + list(outputs)}
        if len(devices) != 1:
            raise InvalidArgumentError(
                "dspark: all_to_all: one operation's tensors must all be on one device, not "
                + ", ".join(sorted(str(d) for d in devices))
            )
        flat_in = torch.cat([t.reshape(-1) for t in inputs])
        flat_out = torch.empty(sum(t.numel() for t in outputs), dtype=dtype,
                               device=inputs[0].device)

        def copy_out():
            off = 0
            for t in outputs:
                k = t.numel()
                t.copy_(flat_out[off:off + k].view(t.shape))
                off += k

        return self._all_to_allv(opts, flat_in, [t.numel() for t in inputs], flat_out,
                                 [t.numel() for t in outputs], list(outputs), [copy_out],
                                 keep=[inputs, outputs])

    def _all_to_allv(self, opts, flat_in, in_counts, flat_out, out_counts, result,
                     finishers=(), keep=()):
        """All-to-all of blocks of any size: `in_counts[j]` elements of `flat_in` (in rank
        order) to rank j, `out_counts[i]` elements of `flat_out` from rank i, in one dspark
        all_to_all_v (the pairwise all_to_all's rounds, the blocks as they are). Every
        all_to_all takes this path, equal blocks or not, so ranks whose split sizes differ in
        kind (none on one rank, uneven on another) run the same collective."""
        n, r = self._n, self._r
        if in_counts[r] != out_counts[r]:
            raise InvalidArgumentError(
                f"dspark: all_to_all: rank {r} sends {in_counts[r]} elements to itself but "
                f"receives {out_counts[r]}"
            )
        mult = 2 if flat_in.is_complex() else 1
        src, dt = _flat(flat_in)
        dst, _ = _flat(flat_out)
        async_op = getattr(opts, "asyncOp", True)
        timeout = _seconds(getattr(opts, "timeout", None))
        deadline = timeout or self._deadline
        if flat_in.device.type == "cuda" or flat_out.device.type == "cuda":
            return self._all_to_allv_cuda(src, dt, [c * mult for c in in_counts], dst,
                                          [c * mult for c in out_counts], result, finishers,
                                          async_op, timeout, deadline)
        # The storages too, as `_go` keeps them.
        held = (flat_in, flat_out, src, dst, src.untyped_storage(), dst.untyped_storage(),
                *keep)
        try:
            w = self._comm._all_to_all_v(dt, src.data_ptr(), [c * mult for c in in_counts],
                                         dst.data_ptr(), [c * mult for c in out_counts], held,
                                         timeout, not async_op)
        except _dspark.Error as e:
            raise _torch_error(e, deadline) from None
        if not async_op:
            for f in finishers:
                f()
            return _Done(result)
        return _async_work(self._completer, [w], result, _chain(list(finishers)), deadline,
                           (id(self._comm),))

    def _all_to_allv_cuda(self, src, dt, in_counts, dst, out_counts, result, finishers,
                          async_op, timeout, deadline):
        """all_to_all on CUDA tensors: dspark's device all_to_all_v (GPUDirect or
        host-staged, as the other device collectives), ordered on torch's current stream of
        the tensors' GPU. It runs to completion before returning, asynchronous calls too
        (their Work is complete at once): said by a RuntimeWarning."""
        if src.device != dst.device:
            raise InvalidArgumentError(
                f"dspark: all_to_all: input on {src.device}, output on {dst.device}: one "
                "operation's tensors must all be on one CUDA device"
            )
        dev = src.device
        # In place (all_to_all_single(t, t)), as on CPU: the blocks sent are a copy, taken on
        # the stream first.
        s0, d0 = src.data_ptr(), dst.data_ptr()
        s_len = src.numel() * src.element_size()
        d_len = dst.numel() * dst.element_size()
        if s_len and d_len and s0 < d0 + d_len and d0 < s0 + s_len:
            src = src.clone()
        if async_op:
            # A degraded path (no stream-ordered form yet), said through Python's warnings,
            # whose default filter shows it once per calling line.
            warnings.warn(
                "dspark: all_to_all on CUDA tensors runs to completion before it returns, "
                "also with async_op=True (its Work is complete at once): the exchange does "
                "not overlap the work queued after it on the host thread",
                RuntimeWarning,
                stacklevel=4,
            )
        stream = torch.cuda.current_stream(dev).cuda_stream
        try:
            self._comm._all_to_all_v_device(dt, src.data_ptr(), in_counts, dst.data_ptr(),
                                            out_counts, dev.index, stream, timeout)
        except _dspark.Error as e:
            raise _torch_error(e, deadline) from None
        # Copies into the outputs (all_to_all's list form): queued on the same stream.
        for f in finishers:
            f()
        return _Done(result)

    # -- gather / scatter --------------------------------------------------------------
    def gather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else dist.GatherOptions()
        root = self._root(opts.rootRank, "gather")
        _single(inputs, "gather", "input")
        if self._r == root:
            _single(output_lists, "gather", "output list")
        t = _input(inputs[0], "gather input")
        if self._r != root:
            return self._go(opts, [("coll_send", t, None, None, None, root)], [t], [])
        outs = output_lists[0]
        if len(outs) != self._n or any(o.numel() != t.numel() or o.dtype != t.dtype for o in outs):
            raise InvalidArgumentError(
                f"dspark: gather: expected {self._n} output tensors of {t.numel()} {t.dtype}"
            )
        calls, keep, fin = [], [t, outs], []
        for i, o in enumerate(outs):
            out = _output(o, "gather output", fin)
            keep.append(out)
            if i == root:
                fin.insert(0, lambda out=out: out.copy_(t.view(out.shape)))
            else:
                calls.append(("coll_recv", None, out, None, None, i))
        return self._go(opts, calls, keep, list(outs), fin)

    def scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else dist.ScatterOptions()
        root = self._root(opts.rootRank, "scatter")
        _single(outputs, "scatter", "output")
        if self._r == root:
            _single(input_lists, "scatter", "input list")
        fin = []
        out = _output(outputs[0], "scatter output", fin)
        if self._r != root:
            return self._go(opts, [("coll_recv", None, out, None, None, root)], [out, outputs],
                            list(outputs), fin)
        ins = input_lists[0]
        if len(ins) != self._n or any(i.numel() != out.numel() or i.dtype != out.dtype for i in ins):
            raise InvalidArgumentError(
                f"dspark: scatter: expected {self._n} input tensors of {out.numel()} {out.dtype}"
            )
        calls, keep = [], [out, outputs]
        for i, t in enumerate(ins):
            src = _input(t, "scatter input")
            keep.append(src)
            if i == root:
                fin.insert(0, lambda src=src: out.copy_(src.view(out.shape)))
            else:
                calls.append(("coll_send", src, None, None, None, i))
        return self._go(opts, calls, keep, list(outputs), fin)

    # -- point to point ----------------------------------------------------------------
    def send(self, tensors, dst, tag=0):
        dst = self._root(dst, "send")
        calls, keep = [], list(tensors)
        for t in tensors:
            src = _input(t, "send tensor")
            calls.append(("send", src, None, None, None, dst))
            keep.append(src)
        return self._go(None, calls, keep, list(tensors))

    def recv(self, tensors, src, tag=0):
        src = self._root(src, "recv")
        calls, keep, fin = [], list(tensors), []
        for t in tensors:
            out = _output(t, "recv tensor", fin)
            calls.append(("recv", None, out, None, None, src))
            keep.append(out)
        work = self._go(None, calls, keep, list(tensors), fin)
        if work is not None:
            work._src = src  # `source_rank()`, as gloo's: the rank it was posted for
        return work

    def recv_anysource(self, tensors, tag=0):
        from ._anysource import recv_anysource  # its Work reports the sender

        try:
            return recv_anysource(self, tensors)
        except _dspark.Error as e:
            raise _torch_error(e, self._deadline) from None

    recvAnysource = recv_anysource
