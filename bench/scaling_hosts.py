"""The cluster's cost per put across machines: bench/scaling.py's figures for the outside
check of issue 50 (4 and 16 brokers), where each broker is on a machine of its own.

Each machine serves a broker of one cluster (`tensorbroker serve --node ... --cluster ...
--etcd ...`, the cluster guide) and runs one rank of this script next to it, rank 0 where
the puts are made (bench/hosts.py: the ranks' gloo group paces them and carries each
broker's figures to rank 0):

    python bench/scaling_hosts.py --rank 0 --world 16 --master 10.0.0.1:29500
    python bench/scaling_hosts.py --rank 1 --world 16 --master 10.0.0.1:29500   # 2 .. 15

Each rank reads its own broker's CPU (`stats()["cpu_s"]`, all its threads) around:

    idle        --idle seconds of nothing: CPU per broker (a lone broker idles at 0.00%)
    put cost    --puts 4 KiB puts on rank 0's broker, one after another, to keys no other
                node reads or watches: their latency (against a broker of no cluster that
                rank 0 starts: bench/scaling.py's lone_put), and the CPU the *other* brokers
                spent per put above their idle CPU; new versions of 20 keys, then puts of
                new keys (all deleted at the end)

Issue 50's targets: the others' CPU per put at most 200 us, and at 16 nodes at most 1.25x
at 4; idle CPU per broker at most 0.5%; a put at most 2x a lone broker's. Rank 0 writes the
table to --out. Usage:
python bench/scaling_hosts.py (--rank R --world N --master HOST:PORT [--address ADDR] |
    --local N) [--puts 8000] [--idle 10] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import hosts  # noqa: E402
import numpy as np  # noqa: E402
import torch.distributed as dist  # noqa: E402
from harness.report import emit  # noqa: E402
from scaling import lone_put  # noqa: E402

import tensorbroker as tb  # noqa: E402

KEYS = 20  # the keys whose new versions are put
SETTLE = 0.5  # seconds after the puts for what they set off (announcements, reads)


def cpu(c: tb.Client) -> float:
    return float(c.stats()["cpu_s"])


def spent(c: tb.Client, idle: float, rank: int, puts: Callable[[], None]) -> float:
    """The CPU-seconds this rank's broker spent while rank 0 ran `puts`, and within SETTLE
    after, above its `idle` CPU-seconds a second."""
    dist.barrier()
    before, began = cpu(c), time.perf_counter()
    if rank == 0:
        puts()
    dist.barrier()
    time.sleep(SETTLE)
    return max(0.0, cpu(c) - before - idle * (time.perf_counter() - began))


def timed(c: tb.Client, key: Callable[[int], str], n: int, took: list[float]) -> Callable[[], None]:
    x = np.ones(4096, np.uint8)

    def puts() -> None:
        for i in range(n):
            t = time.perf_counter()
            c.put(key(i), x)
            took.append(time.perf_counter() - t)

    return puts


def measure(args: argparse.Namespace) -> list[list[float]]:
    """Each rank's [idle CPU share, CPU on the puts of new versions, on those of new keys,
    median put (rank 0's; 0 elsewhere)], by rank."""
    took: list[float] = []
    with tb.connect(args.address) as c:
        dist.barrier()
        time.sleep(1.0)  # (the ranks' connections settle)
        before = cpu(c)
        time.sleep(args.idle)
        idle = (cpu(c) - before) / args.idle
        if args.rank == 0:
            timed(c, lambda i: f"scale-{i}", KEYS, [])()
        time.sleep(SETTLE)  # (their claims heard)
        versions = spent(
            c, idle, args.rank, timed(c, lambda i: f"scale-{i % KEYS}", args.puts, took)
        )
        run = os.urandom(4).hex()  # (keys new to the cluster, whatever ran before)
        new = spent(c, idle, args.rank, timed(c, lambda i: f"new-{run}-{i}", args.puts, []))
        if args.rank == 0:  # (the keys put go: a real cluster keeps no trace of the run)
            for key in [f"scale-{i}" for i in range(KEYS)]:
                c.delete(key)
            for i in range(args.puts):
                c.delete(f"new-{run}-{i}")
    return hosts.gathered([idle, versions, new, statistics.median(took) if took else 0.0])


def table(args: argparse.Namespace, by_rank: list[list[float]], lone: float) -> list[str]:
    idle = [r[0] * 100 for r in by_rank]
    others = by_rank[1:]
    put = by_rank[0][3]
    per_put = sum(r[1] for r in others) / args.puts * 1e6
    per_new = sum(r[2] for r in others) / args.puts * 1e6
    lone_us, put_us = lone * 1e6, put * 1e6
    return [
        f"# The cluster's cost per put, {args.world} brokers "
        f"({time.strftime('%Y-%m-%d %H:%M')}, bench/scaling_hosts.py)", "",
        f"{args.puts} puts of 4 KiB on rank 0's broker to keys no other node reads; the "
        f"ranks {hosts.where(args)}. The others' CPU is above their idle CPU "
        "(`stats()['cpu_s']`).", "",
        "| brokers | idle CPU per broker | put (median) | other brokers' CPU per put "
        "| per put of a new key |", "|---|---|---|---|---|",
        f"| {args.world} | {statistics.mean(idle):.2f}% (max {max(idle):.2f}%) "
        f"| {put_us:.0f} us ({put / lone:.1f}x a lone broker's, {lone_us:.0f} us) "
        f"| {per_put:.0f} us | {per_new:.0f} us |", "",
    ]  # fmt: skip


def main() -> int:
    parser = hosts.parser(__doc__.split("\n\n")[0])
    parser.add_argument("--puts", type=int, default=8000)
    parser.add_argument("--idle", type=float, default=10.0)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "scaling_hosts.md"))
    args = hosts.checked(parser, parser.parse_args())
    if args.local is not None:
        more = ["--puts", str(args.puts), "--idle", str(args.idle), "--out", args.out]
        return hosts.local(__file__, args, "48MiB", more)
    with hosts.group(args):
        by_rank = measure(args)
    if args.rank == 0:
        emit(args.out, table(args, by_rank, lone_put(args.puts) / 1e6))
    return 0


if __name__ == "__main__":
    sys.exit(main())
