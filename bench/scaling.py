"""The cluster's control plane as it grows: N brokers on this host, the nodes of one cluster
found through etcd (UCX over TCP), default options. For N in --nodes:

    idle        each broker's CPU, doing nothing, over --idle seconds (a lone broker: 0.00%)
    put cost    4 KiB puts on node 0, one after another, to keys no client on another node
                reads or watches: the put's latency, and the CPU the *other* brokers spent
                per put above their idle CPU (what every put costs the rest of the
                cluster): new versions of 20 keys, then puts of new keys

Written to bench/results/scaling.md. On one 2-core host the brokers compete for the same
cores: the figures are the cost, not what N machines would see as latency. Usage:
python bench/scaling.py [--nodes 2,4,8,16] [--puts 8000] [--idle 10] [--serve OPTIONS]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("UCX_TLS", "tcp")

import netns  # noqa: E402
from harness.report import emit  # noqa: E402

import tensorbroker as tb  # noqa: E402
from tensorbroker.common.curve import make_keys  # noqa: E402
from tensorbroker.server.cluster.local_etcd import local_etcd  # noqa: E402
from tests.support import free_port  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """CPU seconds process `pid` has used (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


@contextlib.contextmanager
def cluster(
    nodes: list[str], folder: str, memory: str = "48MiB", more: Sequence[str] = (),
    ips: dict[str, str] | None = None,
) -> Iterator[list[tb.BrokerProcess]]:  # fmt: skip
    """An etcd and a broker for each of `nodes`, found through it (each of `memory`, served
    with `more` options), all up (bench/cluster_sync.py's too). With `ips` (netns.machines),
    each broker runs in its node's network namespace, at its address there, with keys."""
    n = len(nodes)
    host = "127.0.0.1" if ips is None else netns.HOST
    with (
        local_etcd(os.path.join(folder, "etcd"), free_port, host) as url,
        contextlib.ExitStack() as st,
    ):
        secure = ["--insecure-tcp"]
        if ips is not None:  # (without keys a cluster stays on loopback)
            _, secret = make_keys(os.path.join(folder, "keys"), "cluster")
            secure = ["--curve-secret", secret, "--curve-clients", os.path.join(folder, "keys")]
        brokers = []
        for node in nodes:
            ip = "127.0.0.1" if ips is None else ips[node]
            options = ["--node", node, "--cluster", f"tcp://{ip}:{free_port()}",
                       "--etcd", url, *secure, *more]  # fmt: skip
            with netns.spawning_in(None if ips is None else node):
                brokers.append(st.enter_context(tb.start_broker(memory=memory, options=options)))
        clients = [st.enter_context(tb.connect(b.address)) for b in brokers]
        deadline = time.monotonic() + 60 + 5 * n
        while not all(_ready(c, n - 1) for c in clients):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{n} brokers did not all come up")
            time.sleep(0.2)
        for c in clients:
            c.close()
        yield brokers


def _ready(c: tb.Client, others: int) -> bool:
    peers = c.stats()["cluster"]["peers"]
    return len(peers) == others and all(p["state"] == "up" for p in peers.values())


def measure(n: int, puts: int, idle: float, more: list[str]) -> dict[str, float]:
    with (
        tempfile.TemporaryDirectory(prefix="tb-scaling-") as folder,
        cluster([f"n{i:02d}" for i in range(n)], folder, more=more) as bs,
    ):
        time.sleep(1.0)  # (the joins' traffic settles)
        before = [cpu_seconds(b.pid) for b in bs]
        time.sleep(idle)
        idle_pct = [(cpu_seconds(b.pid) - t) / idle * 100 for b, t in zip(bs, before, strict=True)]
        others_idle = sum(idle_pct[1:]) / 100  # CPU-seconds a second, doing nothing
        x = np.ones(4096, np.uint8)
        with tb.connect(bs[0].address) as c:
            for i in range(20):
                c.put(f"scale-{i}", x)
            time.sleep(0.5)
            took: list[float] = []
            spent = _others_spent(bs[1:], others_idle, lambda i: c.put(f"scale-{i % 20}", x),
                                  puts, took)  # fmt: skip
            new = _others_spent(bs[1:], others_idle, lambda i: c.put(f"new-{i}", x), puts, [])
    return {
        "idle_mean": statistics.mean(idle_pct), "idle_max": max(idle_pct),
        "put_us": statistics.median(took) * 1e6, "others_cpu_us": spent / puts * 1e6,
        "new_cpu_us": new / puts * 1e6,
    }  # fmt: skip


def _others_spent(
    others: list[tb.BrokerProcess], idle: float, put: Callable[[int], object], puts: int,
    took: list[float],
) -> float:  # fmt: skip
    """The CPU-seconds `others` spent on `puts` calls of `put` (each timed into `took`), and
    on what they set off within 0.5 s after, above their `idle` CPU-seconds a second."""
    before, began = [cpu_seconds(b.pid) for b in others], time.perf_counter()
    for i in range(puts):
        t = time.perf_counter()
        put(i)
        took.append(time.perf_counter() - t)
    time.sleep(0.5)  # (the announcements and reads of the last puts)
    spent = sum(cpu_seconds(b.pid) - t for b, t in zip(others, before, strict=True))
    return max(0.0, spent - idle * (time.perf_counter() - began))


def lone_put(puts: int) -> float:
    x = np.ones(4096, np.uint8)
    with tb.start_broker(memory="48MiB") as b, tb.connect(b.address) as c:
        took = []
        for i in range(puts):
            began = time.perf_counter()
            c.put(f"scale-{i % 20}", x)
            took.append(time.perf_counter() - began)
    return statistics.median(took) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="2,4,8,16")
    parser.add_argument("--puts", type=int, default=8000)
    parser.add_argument("--idle", type=float, default=10.0)
    parser.add_argument("--serve", default="", help="more serve options, e.g. '--prefetch 0'")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "scaling.md"))
    args = parser.parse_args()
    more = args.serve.split()
    lone = lone_put(args.puts)
    rows = []
    for n in (int(x) for x in args.nodes.split(",")):
        print(f"scaling bench: {n} brokers ...", flush=True)
        r = measure(n, args.puts, args.idle, more)
        rows.append(
            f"| {n} | {r['idle_mean']:.2f}% (max {r['idle_max']:.2f}%) | {r['put_us']:.0f} us "
            f"({r['put_us'] / lone:.1f}x a lone broker's) | {r['others_cpu_us']:.0f} us | "
            f"{r['new_cpu_us']:.0f} us |"
        )
    stamp = time.strftime("%Y-%m-%d %H:%M")
    lines = [
        f"# The cluster as it grows ({stamp}, bench/scaling.py, {os.cpu_count()} cores)", "",
        f"4 KiB puts on node 0 to keys no other node reads, {args.puts} of them; a lone "
        f"broker's put: {lone:.0f} us (median). Options: {args.serve or 'the defaults'}. "
        "The other brokers' CPU is above their idle CPU (measured just before): of puts to "
        "20 keys put before (a new version of a key), and of puts to new keys (each heard "
        "of by its two homes: Note [homes]).", "",
        "| brokers | idle CPU per broker | put (median) | other brokers' CPU per put | "
        "per put of a new key |",
        "|---|---|---|---|---|", *rows, "",
    ]  # fmt: skip
    emit(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
