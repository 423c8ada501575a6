"""Weight sync across machines, against gloo's broadcast: bench/cluster_sync.py's comparison
for the outside check of issue 50, where each node is a machine of its own.

Each machine serves a broker of one cluster (`tensorbroker serve --node ... --cluster ...
--etcd ...`, the cluster guide) and runs one rank of this script next to it, rank 0 on the
trainer's machine:

    python bench/sync_hosts.py --rank 0 --world 4 --master 10.0.0.1:29500   # the trainer
    python bench/sync_hosts.py --rank 1 --world 4 --master 10.0.0.1:29500   # a reader (2, 3)

The ranks also form one gloo group at --master (torch.distributed), which carries the gloo
side and the readers' acknowledgements: every time is read on rank 0's clock, so the
machines' clocks need not agree. For each of --versions versions of a bf16 state_dict of
--mib MiB in --tensors tensors, first with tensorbroker, then with gloo:

    tensorbroker  rank 0 puts the state_dict as one bundle on its broker; each reader, in
                  `watch` on its own broker, has it, checks one value, and acknowledges
    gloo          rank 0 copies the state_dict into one flat bucket and broadcasts it (the
                  fastest way gloo offers); each reader acknowledges once it has it

blocked: rank 0's put, or its copy and broadcast. End to end: from rank 0 holding the new
state_dict until the last acknowledgement (a 4-byte gloo message after the transfer).
Rank 0 prints the table and writes it to --out. Set GLOO_SOCKET_IFNAME, and the brokers'
UCX_NET_DEVICES and UCX_TLS, as the machines need.

`--local N` runs it all on this host (bench/hosts.py), to try the script: the figures there
are bench/cluster_sync.py's to give. Usage:
python bench/sync_hosts.py (--rank R --world N --master HOST:PORT [--address ADDR] | --local N)
    [--mib 512] [--tensors 194] [--versions 9] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import hosts  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from cluster_sync import state_dict  # noqa: E402
from harness.report import emit  # noqa: E402

import tensorbroker as tb  # noqa: E402


def acknowledged(world: int, step: int) -> None:
    """Rank 0: wait for every reader's acknowledgement of version `step`."""
    for reader in range(1, world):
        seen = torch.zeros(1, dtype=torch.int32)
        dist.recv(seen, src=reader)
        if int(seen) != step:
            raise RuntimeError(f"rank {reader} acknowledged version {int(seen)}, not {step}")


def acknowledge(step: int) -> None:
    dist.send(torch.tensor([step], dtype=torch.int32), dst=0)


def with_tensorbroker(args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """Rank 0: blocked and end-to-end seconds per version; a reader: ([], [])."""
    blocked: list[float] = []
    ends: list[float] = []
    with tb.connect(args.address) as c:
        if args.rank == 0:
            with contextlib.suppress(tb.NotFound):  # (one an aborted run left)
                c.delete("sync_hosts")
            for step in range(1, args.versions + 1):
                sd = state_dict(args.mib, args.tensors, step)
                dist.barrier()  # (the readers are in their watch)
                began = time.perf_counter()
                c.put("sync_hosts", sd)
                blocked.append(time.perf_counter() - began)
                acknowledged(args.world, step)
                ends.append(time.perf_counter() - began)
                del sd
            c.delete("sync_hosts")
        else:
            versions = c.watch("sync_hosts", timeout=600)
            for step in range(1, args.versions + 1):
                dist.barrier()
                while True:
                    item = next(versions)  # (None: a delete)
                    seen = -1 if item is None else int(float(torch.from_dlpack(item["t0"])[-1]))
                    del item
                    if seen == step:
                        break
                acknowledge(step)
    return blocked, ends


def with_gloo(args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """As with_tensorbroker, for gloo's broadcast of one flat bucket."""
    flat = torch.empty(args.mib * 2**20 // 2, dtype=torch.bfloat16)
    blocked: list[float] = []
    ends: list[float] = []
    for step in range(1, args.versions + 1):
        sd = state_dict(args.mib, args.tensors, step) if args.rank == 0 else {}
        dist.barrier()
        began = time.perf_counter()
        if args.rank == 0:
            views = [t.view(-1) for t in sd.values()]
            torch.cat(views, out=flat[: sum(v.numel() for v in views)])
        dist.broadcast(flat, src=0)
        if args.rank == 0:
            blocked.append(time.perf_counter() - began)
            acknowledged(args.world, step)
            ends.append(time.perf_counter() - began)
        else:
            if float(flat[0]) != step:
                raise RuntimeError(f"rank {args.rank} has {float(flat[0])}, not version {step}")
            acknowledge(step)
        del sd
    return blocked, ends


def table(args: argparse.Namespace, ours: tuple[list[float], list[float]],
          gloo: tuple[list[float], list[float]]) -> list[str]:  # fmt: skip
    med = statistics.median
    ms = lambda xs: ", ".join(f"{x * 1e3:.0f}" for x in xs)  # noqa: E731

    def row(what: str, i: int, pick: Any) -> str:
        a, b = pick(ours[i]), pick(gloo[i])
        return f"| {what} | {a * 1e3:.0f} ms | {b * 1e3:.0f} ms | {a / b:.2f} |"

    first, rest = (lambda xs: xs[0]), (lambda xs: med(xs[1:]) if len(xs) > 1 else xs[0])
    return [
        f"# Weight sync to {args.world - 1} other nodes ({time.strftime('%Y-%m-%d %H:%M')}, "
        "bench/sync_hosts.py)", "",
        f"A {args.mib} MiB bf16 state_dict of {args.tensors} tensors, {args.versions} versions, "
        f"from rank 0 to {args.world - 1} readers, the ranks {hosts.where(args)}"
        + "; times on rank 0's clock, to the last reader's acknowledgement.", "",
        "| | tensorbroker | gloo broadcast (flat bucket) | ratio |", "|---|---|---|---|",
        row("trainer blocked, first version", 0, first),
        row("trainer blocked, the others (median)", 0, rest),
        row("end to end, last reader, first version", 1, first),
        row("end to end, last reader, the others (median)", 1, rest),
        "", f"Each version: tensorbroker blocked {ms(ours[0])} ms, end to end {ms(ours[1])} ms; "
        f"gloo blocked {ms(gloo[0])} ms, end to end {ms(gloo[1])} ms.", "",
    ]  # fmt: skip


def main() -> int:
    parser = hosts.parser(__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--tensors", type=int, default=194)
    parser.add_argument("--versions", type=int, default=9)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "cluster_sync_hosts.md"))
    args = hosts.checked(parser, parser.parse_args())
    if args.local is not None:
        more = ["--mib", str(args.mib), "--tensors", str(args.tensors), "--versions",
                str(args.versions), "--out", args.out]  # fmt: skip
        memory = f"{4 * args.mib}MiB"  # (a version read while the next is put)
        return hosts.local(__file__, args, memory, more)
    with hosts.group(args):
        ours = with_tensorbroker(args)
        gloo = with_gloo(args)
    if args.rank == 0:
        emit(args.out, table(args, ours, gloo))
    return 0


if __name__ == "__main__":
    sys.exit(main())
