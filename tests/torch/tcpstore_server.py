#!/usr/bin/env python3
"""torch's real c10d TCPStore, driven line by line by tests/store_torch.rs.

    tcpstore_server.py serve [--host H] [--port P] [--world-size N] [--libuv 0|1]
        Starts torch.distributed.TCPStore(H, P, N, is_master=True, wait_for_workers=False,
        use_libuv=...) (P 0: any free port) and uses the master's own client for commands.
    tcpstore_server.py client HOST PORT
        Connects to a running TCPStore as a torch client (is_master=False).

Prints one line `ready PORT TORCH_VERSION` once the store is up (or `noimport REASON` and exits
with 3 when torch cannot be imported), then answers each command read from stdin with one line,
`ok [RESULT]` or `err MESSAGE`, until stdin closes or `quit`. Values travel as hex; `-` is the
empty value. Keys contain no spaces.

    set KEY HEX                  store.set(KEY, bytes)
    get KEY                      -> ok HEX        store.get(KEY)
    set_after SECONDS KEY HEX    -> ok at once; a thread sets KEY SECONDS later
    add KEY DELTA COUNT          -> ok V1 V2 ...  COUNT times store.add(KEY, DELTA)
    check KEY...                 -> ok 1|0        store.check([KEY...])
    wait KEY...                  store.wait([KEY...])
    pset PREFIX KEY HEX          PrefixStore(PREFIX, store).set(KEY, bytes)
    pget PREFIX KEY              -> ok HEX        PrefixStore(PREFIX, store).get(KEY)
"""

import argparse
import sys
import threading
import time
from datetime import timedelta

TIMEOUT = timedelta(seconds=20)


def unhex(s):
    return b"" if s == "-" else bytes.fromhex(s)


def tohex(b):
    return b.hex() if b else "-"


def run(store, dist, line):
    words = line.split()
    cmd, args = words[0], words[1:]
    if cmd == "set":
        store.set(args[0], unhex(args[1]))
        return ""
    if cmd == "get":
        return tohex(store.get(args[0]))
    if cmd == "set_after":
        delay, key, value = float(args[0]), args[1], unhex(args[2])

        def later():
            time.sleep(delay)
            store.set(key, value)

        threading.Thread(target=later, daemon=True).start()
        return ""
    if cmd == "add":
        key, delta, count = args[0], int(args[1]), int(args[2])
        return " ".join(str(store.add(key, delta)) for _ in range(count))
    if cmd == "check":
        return "1" if store.check(args) else "0"
    if cmd == "wait":
        store.wait(args)
        return ""
    if cmd == "pset":
        dist.PrefixStore(args[0], store).set(args[1], unhex(args[2]))
        return ""
    if cmd == "pget":
        return tohex(dist.PrefixStore(args[0], store).get(args[1]))
    raise ValueError(f"unknown command {cmd!r}")


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--world-size", type=int, default=2)
    s.add_argument("--libuv", type=int, default=1)
    c = sub.add_parser("client")
    c.add_argument("host")
    c.add_argument("port", type=int)
    a = p.parse_args()

    try:
        import torch
        import torch.distributed as dist
    except Exception as e:  # noqa: BLE001 - any import failure means: no usable torch
        print(f"noimport {type(e).__name__}: {e}", flush=True)
        sys.exit(3)

    if a.mode == "serve":
        store = dist.TCPStore(
            a.host,
            a.port,
            a.world_size,
            True,
            timeout=TIMEOUT,
            wait_for_workers=False,
            use_libuv=bool(a.libuv),
        )
    else:
        store = dist.TCPStore(a.host, a.port, None, False, timeout=TIMEOUT, wait_for_workers=False)
    print(f"ready {store.port} {torch.__version__}", flush=True)

    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        if line == "quit":
            break
        try:
            out = run(store, dist, line)
            print(f"ok {out}".rstrip(), flush=True)
        except Exception as e:  # noqa: BLE001 - reported to the test, which decides
            msg = " ".join(f"{type(e).__name__}: {e}".split())
            print(f"err {msg}", flush=True)


if __name__ == "__main__":
    main()
