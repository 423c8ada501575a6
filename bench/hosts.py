"""What the benchmarks across machines share (bench/sync_hosts.py, bench/scaling_hosts.py):
one rank per machine, next to that machine's broker (a cluster found through etcd), the
ranks in one gloo group at --master (torch.distributed) that paces them and carries their
figures to rank 0, which writes the table; and `--local N`, which tries a script on this
host: an etcd, N brokers and N ranks.

    python bench/<script>.py --rank R --world N --master HOST:PORT [--address ADDR] ...
    python bench/<script>.py --local N ...
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from tests.support import free_port


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--rank", type=int)
    p.add_argument("--world", type=int)
    p.add_argument("--master", metavar="HOST:PORT", help="rank 0's address for the gloo group")
    p.add_argument("--address", help="this machine's broker (default: as clients find it)")
    p.add_argument("--local", type=int, metavar="N", help="N ranks and brokers on this host")
    p.add_argument("--one-host", action="store_true", help=argparse.SUPPRESS)
    return p


def checked(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """`args`, refused (argparse's exit) where the ranks' options cannot work."""
    if args.local is not None:
        if args.local < 2:
            p.error(f"--local {args.local}: at least 2")
        if any(v is not None for v in (args.rank, args.world, args.master, args.address)):
            p.error("--local N starts its own ranks and brokers: no --rank, --world, --master "
                    "or --address with it")  # fmt: skip
        return args
    if args.rank is None or args.world is None or args.master is None:
        p.error("--rank, --world and --master (or --local N)")
    if args.world < 2 or not 0 <= args.rank < args.world:
        p.error(f"--rank {args.rank} of --world {args.world}: 0 <= rank < world, world >= 2")
    return args


@contextlib.contextmanager
def group(args: argparse.Namespace) -> Iterator[None]:
    """This rank in the gloo group of all of them, left at the end."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://{args.master}", rank=args.rank, world_size=args.world
    )
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


def gathered(values: Sequence[float]) -> list[list[float]]:
    """Each rank's `values` (as many on every rank), by rank, on every rank."""
    mine = torch.tensor(list(values), dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [t.tolist() for t in every]


def where(args: argparse.Namespace) -> str:
    """Where the ranks ran, for the table."""
    if args.one_host:
        return f"all {args.world} on this one host (--local: a try of the script, not of machines)"
    return f"each of the {args.world} on a machine of its own, rank 0 on {os.uname().nodename}"


def local(script: str, args: argparse.Namespace, memory: str, more: Sequence[str]) -> int:
    """--local N: an etcd and N brokers on this host (UCX over TCP), and `script` run as N
    ranks, each next to one of them, with `more` options; the worst exit status."""
    os.environ.setdefault("UCX_TLS", "tcp")
    from scaling import cluster

    nodes = [f"h{i:02d}" for i in range(args.local)]
    with (
        tempfile.TemporaryDirectory(prefix="tb-hosts-") as folder,
        cluster(nodes, folder, memory) as brokers,
    ):
        master = f"127.0.0.1:{free_port()}"
        common = ["--world", str(len(nodes)), "--master", master, "--one-host", *more]
        ranks = [
            subprocess.Popen(
                [sys.executable, script, "--rank", str(r), "--address", b.address, *common]
            )
            for r, b in enumerate(brokers)
        ]
        try:  # (a rank that failed leaves the others waiting in gloo: they are stopped)
            while any(p.poll() is None for p in ranks):
                if any(p.poll() not in (None, 0) for p in ranks):
                    break
                time.sleep(0.2)
        finally:
            for p in ranks:
                if p.poll() is None:
                    p.kill()
                p.wait()
        return max(abs(p.returncode) for p in ranks)
