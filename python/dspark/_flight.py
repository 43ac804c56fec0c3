"""torch's flight recorder for ``backend="dspark"``.

dspark's communicators record their last operations themselves (``DSPARK_FR_ENTRIES``;
``Communicator::flight_record``). Under torch this module turns those records into torch's
flight-recorder dump — the pickle that ``torchfrtrace`` reads, version ``2.10`` as torch
2.15 writes it, one file per rank named ``${TORCH_FR_DUMP_TEMP_FILE}<global rank>`` — and
honours torch's variables:

* ``TORCH_FR_BUFFER_SIZE`` (or ``TORCH_NCCL_TRACE_BUFFER_SIZE``): entries kept (and
  written); ``0`` turns recording off. Read at group creation (``python/src/lib.rs`` gives it
  to the communicators as ``DSPARK_FR_ENTRIES`` when that is not set).
* ``TORCH_FR_DUMP_ON_TIMEOUT`` (or ``TORCH_NCCL_DUMP_ON_TIMEOUT``) ``=1``: when an operation
  of a dspark group fails (timeout, lost peer, mismatch, abort) this rank writes its dump and
  asks every other rank, through the world group's store, to write theirs; each rank looks
  for that signal every second (as NCCL's heartbeat monitor does), so a rank that never
  joined the call — the one the dumps are for — writes its dump too. The failing rank's
  error waits until every rank has written its own, at most
  ``TORCH_FR_WAIT_TIMEOUT_DUMP_MILSEC`` (or ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC``; 15 s):
  otherwise the launcher, ending the job on that error, ended the other ranks first.
* ``TORCH_FR_DUMP_TEMP_FILE``: the files' prefix (default ``/tmp/nccl_trace_rank_``).

On demand: :func:`dump` (``dspark.torch.dump_flight_record()``) writes this rank's file, and
:func:`dump_bytes` returns the pickle, as ``torch._C._distributed_c10d._dump_fr_trace`` does
for torch's own backends.

Each entry is one dspark call: ``profiling_name`` ``c10d:all_reduce`` (``c10d:send 0->1``,
``c10d:recv 1<-0``), sizes flattened (``[[count]]``: dspark sees elements, not shapes),
dtypes as torch spells them, and the state ``scheduled`` (queued), ``started`` (running, or
failed) or ``completed``.
"""

import json
import os
import pickle
import threading
import time
import weakref
from datetime import timedelta

VERSION = "2.10"
_SIGNAL_KEY = "dspark_fr_dump_signal"
_DONE_KEY = "dspark_fr_dumped_"
_POLL_S = 1.0

_DTYPES = {
    "float": "Float",
    "double": "Double",
    "half": "Half",
    "bfloat16": "BFloat16",
    "int8": "Char",
    "uint8": "Byte",
    "int32": "Int",
    "uint32": "UInt32",
    "int64": "Long",
    "uint64": "UInt64",
}
_STATES = {"queued": "scheduled", "started": "started", "failed": "started",
           "completed": "completed"}

_lock = threading.Lock()
_groups = []  # (weakref to the backend, pg name, desc, global ranks), creation order
_dumped = False
_watcher = None


def _env_int(*names, default):
    for n in names:
        v = os.environ.get(n, "").strip()
        if v:
            try:
                return int(v)
            except ValueError:
                return default
    return default


def buffer_size():
    """``TORCH_FR_BUFFER_SIZE`` (torch's default 2000; 0: off)."""
    return _env_int("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", default=2000)


def dump_on_failure():
    """Whether ``TORCH_FR_DUMP_ON_TIMEOUT`` (or ``TORCH_NCCL_DUMP_ON_TIMEOUT``) asks for
    dumps when an operation fails."""
    for n in ("TORCH_FR_DUMP_ON_TIMEOUT", "TORCH_NCCL_DUMP_ON_TIMEOUT"):
        v = os.environ.get(n, "").strip().lower()
        if v:
            return v in ("1", "true", "yes", "on")
    return False


def prefix():
    return os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or "/tmp/nccl_trace_rank_"


def register(group, opts):
    """Remembers a dspark group torch created (``opts``: the factory's options)."""
    if buffer_size() <= 0:
        return
    ranks = list(getattr(opts, "global_ranks_in_group", None) or range(opts.group_size))
    name = str(getattr(opts, "group_id", None) or "0")
    desc = "default_pg" if name == "0" else "undefined"
    with _lock:
        _groups.append((weakref.ref(group), name, desc, ranks))
        if dump_on_failure():
            _start_watcher()


def _live():
    with _lock:
        out = [(g(), n, d, r) for g, n, d, r in _groups]
    return [(g, n, d, r) for g, n, d, r in out if g is not None]


def _global_rank():
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            return dist.get_rank()
    except Exception:  # noqa: BLE001 - outside torch: group 0's rank
        pass
    for g, _, _, ranks in _live():
        return ranks[g._r] if g._r < len(ranks) else g._r
    return 0


def _entries(group, pg_id, name, desc, ranks, limit):
    """torch's entries of one group, from its communicators' records."""
    records = []
    for c in group._comms():
        try:
            text = c._c.flight_record_json() if hasattr(c, "_c") else c.flight_record_json()
        except Exception:  # noqa: BLE001 - a closed communicator: nothing to add
            continue
        if text:
            records.append(json.loads(text))
    out = []
    last_coll = 0
    merged = []
    for rec in records:
        merged += rec.get("entries", [])
    merged.sort(key=lambda e: e.get("started_unix_ns") or 0)
    me = group._r
    timeout_ms = int(getattr(group, "_deadline", 0) * 1000)
    for e in merged:
        if e.get("seq") is None:
            continue
        coll = e["collective"]
        count = int(e.get("count") or 0)
        n = len(ranks)
        p2p = coll in ("send", "recv", "send_recv")
        if coll == "send":
            pname, ins, outs = f"send {me}->{e['peer']}", [[count]], []
        elif coll == "recv":
            pname, ins, outs = f"recv {me}<-{e['peer']}", [], [[count]]
        elif coll == "send_recv":
            pname, ins, outs = f"send {me}->{e['peer']}", [[count]], []
        elif coll == "all_gather":
            pname, ins, outs = coll, [[count]], [[count * n]]
        elif coll == "reduce_scatter":
            pname, ins, outs = coll, [[count * n]], [[count]]
        elif coll == "all_to_all" and count == 2**64 - 1:
            # An all_to_all_v (counts per peer): its sizes differ from rank to rank and are
            # not recorded.
            pname, ins, outs = coll, [], []
        elif coll == "all_to_all":
            pname, ins, outs = coll, [[count * n]], [[count * n]]
        elif coll == "barrier":
            pname, ins, outs = coll, [], []
        else:
            pname, ins, outs = coll, [[count]], [[count]]
        if not p2p:
            last_coll = e["seq"]
        dt = _DTYPES.get(e.get("dtype") or "", e.get("dtype") or "Byte")
        started = int(e.get("started_unix_ns") or 0)
        ended = e.get("ended_unix_ns")
        state = _STATES.get(e.get("state"), "started")
        entry = {
            "record_id": (e["seq"] - 1) if not p2p else max(last_coll - 1, 0),
            "pg_id": pg_id,
            "process_group": (name, desc),
            "collective_seq_id": e["seq"] if not p2p else last_coll,
            "p2p_seq_id": e["seq"] if p2p else 0,
            "op_id": e["seq"],
            "profiling_name": f"c10d:{pname}",
            "time_created_ns": started,
            "input_sizes": ins,
            "input_dtypes": [dt] * len(ins),
            "output_sizes": outs,
            "output_dtypes": [dt] * len(outs),
            "state": state,
            "time_discovered_started_ns": started,
            "time_discovered_completed_ns": int(ended) if state == "completed" and ended else 0,
            "retired": state == "completed",
            "timeout_ms": timeout_ms,
            "is_p2p": p2p,
            "frames": [],
            "thread_id": 0,
            "thread_name": "dspark",
            # dspark's own facts, which torch's tools ignore.
            "dspark": {k: e.get(k) for k in ("algorithm", "transport", "path", "failure")},
        }
        if ended and state == "completed":
            entry["duration_ms"] = (int(ended) - started) / 1e6
        out.append(entry)
    out.sort(key=lambda x: x["record_id"])
    return out[-limit:] if limit > 0 else []


def dump_dict():
    """This rank's flight record in torch's format (a dict)."""
    limit = buffer_size()
    pg_config, pg_status, entries = {}, {}, []
    for pg_id, (g, name, desc, ranks) in enumerate(_live()):
        pg_config[name] = {"name": name, "desc": desc, "ranks": str(ranks)}
        es = _entries(g, pg_id, name, desc, ranks, limit)
        colls = [x for x in es if not x["is_p2p"]]
        done = [x["collective_seq_id"] for x in colls if x["state"] == "completed"]
        pg_status[str(pg_id)] = {
            "last_enqueued_collective": max((x["collective_seq_id"] for x in colls), default=-1),
            "last_started_collective": max(
                (x["collective_seq_id"] for x in colls if x["state"] != "scheduled"), default=-1
            ),
            "last_completed_collective": max(done, default=-1),
        }
        entries += es
    entries.sort(key=lambda x: x["time_created_ns"])
    return {
        "version": VERSION,
        "comm_lib_version": "dspark",
        "pg_config": pg_config,
        "pg_status": pg_status,
        "entries": entries,
    }


def dump_bytes():
    """This rank's flight record in torch's format, pickled (what
    ``torch._C._distributed_c10d._dump_fr_trace`` returns for torch's own backends)."""
    return pickle.dumps(dump_dict())


def dump(path=None):
    """Writes this rank's dump to ``path`` (default ``${TORCH_FR_DUMP_TEMP_FILE}<rank>``);
    returns the path."""
    if path is None:
        path = f"{prefix()}{_global_rank()}"
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(dump_bytes())
    os.replace(tmp, path)
    return path


def write_records(directory):
    """Writes the dspark flight record of every communicator of every dspark group into
    ``directory`` (dspark's own format, as ``DSPARK_FR_DUMP`` on a failure), for
    ``dspark analyze directory``; returns the files."""
    paths = []
    for g, _, _, _ in _live():
        for c in g._comms():  # dspark.Communicator or the native one: both write
            p = c.write_flight_record(os.fspath(directory))
            if p:
                paths.append(p)
    return paths


def _dump_once(why):
    global _dumped
    with _lock:
        if _dumped:
            return None
        _dumped = True
    try:
        p = dump()
    except Exception as e:  # noqa: BLE001 - a dump must not hide the failure
        print(f"dspark: flight record dump ({why}) failed: {e}", flush=True)
        return None
    print(f"dspark: flight record ({why}) written to {p}", flush=True)
    # Said to the rank that asked, which waits for every rank's (`_wait_for_the_others`).
    store = _signal_store()
    if store is not None:
        try:
            store.set(_DONE_KEY + str(_global_rank()), p)
        except Exception:  # noqa: BLE001 - the store is gone: nobody waits
            pass
    return p


def dump_wait_s():
    """How long the rank whose operation failed waits for the other ranks' records before
    its error goes on (``TORCH_FR_WAIT_TIMEOUT_DUMP_MILSEC``, or torch's older
    ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC``; 15 s by default, as torch's). It goes on as soon
    as every rank has written its own."""
    ms = _env_int("TORCH_FR_WAIT_TIMEOUT_DUMP_MILSEC", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC",
                  default=15000)
    return max(ms, 0) / 1000.0


def _dumping_ranks():
    """The global ranks that look for the signal: those of this rank's dspark groups (a rank
    in none, a gloo-only rank, never writes a record)."""
    ranks = set()
    for _, _, _, r in _live():
        ranks.update(r)
    return sorted(ranks) or [_global_rank()]


def _wait_for_the_others(store):
    """Waits (at most `dump_wait_s`) until every rank has written its record: the rank that
    never joined the call looks for the signal once a second, and a launcher ends it once
    this rank's error ends this process (torchrun does within a second), so without the
    wait its record (the one `torchfrtrace` needs) was never written. One wait on the store
    for all the keys (every failing rank waits, and a poll of N keys by N ranks would load
    the store the job shares), then one look at which are missing."""
    limit = dump_wait_s()
    if limit <= 0:
        return
    ranks = _dumping_ranks()
    keys = [_DONE_KEY + str(r) for r in ranks]
    try:
        store.wait(keys, timedelta(seconds=limit))
        return
    except Exception:  # noqa: BLE001 - timed out (or the store is gone: the check says)
        pass
    try:
        missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
    except Exception:  # noqa: BLE001 - the store went away: nobody will say more
        return
    if missing:
        print(f"dspark: flight record: rank(s) {missing} wrote no record within {limit:g} s "
              "(TORCH_FR_WAIT_TIMEOUT_DUMP_MILSEC): dead, or stuck where Python cannot run",
              flush=True)


def _signal_store():
    for g, name, _, _ in _live():
        if name == "0":
            return g._store
    live = _live()
    return live[0][0]._store if live else None


def on_error(e):
    """An operation failed with dspark error ``e``: dump and tell the other ranks, when
    ``TORCH_FR_DUMP_ON_TIMEOUT`` asks."""
    if not _groups or not dump_on_failure() or buffer_size() <= 0:
        return
    from . import _dspark

    if not isinstance(e, (_dspark.TimeoutError, _dspark.PeerLostError, _dspark.MismatchError,
                          _dspark.AbortedError)):
        return
    if _dump_once(type(e).__name__) is None:
        return
    store = _signal_store()
    if store is not None:
        try:
            store.set(_SIGNAL_KEY, str(_global_rank()))
        except Exception as err:  # noqa: BLE001 - the store is gone: the others are on their own
            print(f"dspark: flight record: could not ask the other ranks to dump through the "
                  f"store ({err}); only this rank's record was written", flush=True)
            return
        _wait_for_the_others(store)


def _watch():
    while True:
        time.sleep(_POLL_S)
        if _dumped or not _live():
            return
        store = _signal_store()
        if store is None:
            return
        try:
            if store.check([_SIGNAL_KEY]):
                _dump_once("rank " + store.get(_SIGNAL_KEY).decode() + " asked")
                return
        except Exception:  # noqa: BLE001 - the store went away: the job is over
            return


def _start_watcher():
    global _watcher
    if _watcher is None or not _watcher.is_alive():
        _watcher = threading.Thread(target=_watch, name="dspark-fr-watch", daemon=True)
        _watcher.start()
