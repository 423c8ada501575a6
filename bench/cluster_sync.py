"""Weight sync across nodes: a trainer's bf16 state_dict to readers on three other nodes,
tensorbroker against torch.distributed's gloo broadcast, in one run, on this host.

    tensorbroker   4 brokers found through etcd (UCX over TCP, as between machines); the
                   trainer on node a puts the state_dict as one bundle, readers on b, c and
                   d follow it with `watch`, each through its own node's broker
    gloo           4 processes in one gloo group (TCP loopback); rank 0 broadcasts the
                   state_dict as one flat bucket (the fastest way gloo offers)

For each version: the trainer's time blocked (tensorbroker: the put; gloo: rank 0's copy
of the state_dict into its flat bucket, then its broadcast), and end to end, from the
trainer holding the new state_dict (just before the put, or the copy into the bucket) to the
last reader having the whole version (its checksum of one tensor taken): the first
version's, and the median of the others'. Also gloo's broadcast alone (from its bucket
filled), which was the gloo row until 2026-12-02 20:15: it leaves out a copy that
tensorbroker's put makes and counts.
With --link RATE[,RATE...] (root and iproute2), each node is in a network namespace of its
own, its link limited to RATE each way (bench/netns.py): as between machines whose NICs,
not this host's two shared cores, bound the transfers. Written to
bench/results/cluster_sync.md (cluster_sync_link.md with --link). Usage:
python bench/cluster_sync.py [--mib 512] [--tensors 194] [--versions 9] [--link 4gbit,10gbit]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("UCX_TLS", "tcp")

import netns  # noqa: E402
from harness.report import emit  # noqa: E402
from scaling import cluster  # noqa: E402

import tensorbroker as tb  # noqa: E402
from tests.support import free_port  # noqa: E402

READERS = ("b", "c", "d")


def state_dict(mib: int, tensors: int, step: int) -> dict[str, Any]:
    import torch

    numel = mib * 2**20 // 2 // tensors
    return {f"t{i}": torch.full((numel,), step, dtype=torch.bfloat16) for i in range(tensors)}


# -- tensorbroker -------------------------------------------------------------------------------


def tb_reader(node: str, address: str, versions: int, ready: Any, out: Any) -> None:
    import torch

    with tb.connect(address) as c:
        ready.put(node)
        for item in c.watch("weights", timeout=300):
            step = int(float(torch.from_dlpack(item["t0"])[-1]))
            out.put((node, step, time.time()))
            del item
            if step >= versions:
                return


def run_tensorbroker(
    mib: int, tensors: int, versions: int, ips: dict[str, str] | None = None
) -> tuple[list[float], list[float], float]:
    """Blocked and end-to-end seconds per version, and the copies node a's broker sent (`ips`:
    each broker in its node's network namespace, netns.machines)."""
    ctx = mp.get_context("spawn")
    nodes, memory = ["a", *READERS], f"{4 * mib}MiB"  # (the next version while one is read)
    with tempfile.TemporaryDirectory(prefix="tb-sync-") as folder, contextlib.ExitStack() as st:
        brokers = dict(
            zip(nodes, st.enter_context(cluster(nodes, folder, memory, ips=ips)), strict=True)
        )
        trainer = st.enter_context(tb.connect(brokers["a"].address))
        ready, out = ctx.Queue(), ctx.Queue()
        procs = [ctx.Process(target=tb_reader, args=(n, brokers[n].address, versions, ready, out))
                 for n in READERS]  # fmt: skip
        for p in procs:
            p.start()
        for _ in READERS:
            ready.get(timeout=120)
        time.sleep(0.5)  # (the watches are parked)
        sent0 = trainer.stats()["cluster"]["bytes_sent"]
        blocked, ends = [], []
        for step in range(1, versions + 1):
            sd = state_dict(mib, tensors, step)
            began = time.time()
            trainer.put("weights", sd)
            blocked.append(time.time() - began)
            got = {}
            while len(got) < len(READERS):
                node, seen, t = out.get(timeout=300)
                if seen == step:
                    got[node] = t
            ends.append(max(got.values()) - began)
            del sd
        sent = (trainer.stats()["cluster"]["bytes_sent"] - sent0) / (mib * 2**20) / versions
        for p in procs:
            p.join(60)
    return blocked, ends, sent


# -- gloo ------------------------------------------------------------------------------------------


def gloo_rank(
    rank: int, port: int, mib: int, tensors: int, versions: int, out: Any,
    ips: dict[str, str] | None = None,
) -> None:  # fmt: skip
    master = "127.0.0.1"
    if ips is not None:  # (before torch starts a thread: setns moves the calling one only)
        netns.enter(["a", *READERS][rank])
        os.environ["GLOO_SOCKET_IFNAME"], master = netns.DEVICE, ips["a"]
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank,
                            world_size=1 + len(READERS))  # fmt: skip
    numel = mib * 2**20 // 2
    flat = torch.empty(numel, dtype=torch.bfloat16)
    for step in range(1, versions + 1):
        dist.barrier()
        began = time.time()
        if rank == 0:  # the state_dict copied into one flat bucket, then broadcast
            sd = state_dict(mib, tensors, step)
            began = time.time()  # (as tensorbroker's: the trainer holds a state_dict)
            torch.cat(
                [t.view(-1) for t in sd.values()], out=flat[: sum(t.numel() for t in sd.values())]
            )
            out.put(("began", step, began, time.time()))
        dist.broadcast(flat, src=0)
        done = time.time()
        out.put((rank, step, done, float(flat[0])))
    dist.barrier()
    dist.destroy_process_group()


def run_gloo(
    mib: int, tensors: int, versions: int, ips: dict[str, str] | None = None
) -> tuple[list[float], list[float], list[float]]:
    """Blocked and end-to-end seconds per version, from before the flat bucket is filled, and
    end to end from after (the broadcast alone); `ips`: as run_tensorbroker's."""
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=gloo_rank, args=(r, port, mib, tensors, versions, out, ips))
             for r in range(1 + len(READERS))]  # fmt: skip
    for p in procs:
        p.start()
    began: dict[int, float] = {}
    bucketed: dict[int, float] = {}  # step -> when its flat bucket was filled
    done: dict[int, dict[int, float]] = {}
    for _ in range(versions * (2 + len(READERS))):
        msg = out.get(timeout=600)
        if msg[0] == "began":
            began[msg[1]], bucketed[msg[1]] = msg[2], msg[3]
        else:
            rank, step, t, value = msg
            assert value == step, (rank, step, value)
            done.setdefault(step, {})[rank] = t
    for p in procs:
        p.join(60)
    steps = range(1, versions + 1)
    blocked = [done[s][0] - began[s] for s in steps]
    last = {s: max(t for r, t in done[s].items() if r != 0) for s in steps}
    return blocked, [last[s] - began[s] for s in steps], [last[s] - bucketed[s] for s in steps]


def sync(
    mib: int, tensors: int, versions: int, rate: str | None
) -> tuple[tuple[list[float], list[float], list[float]], tuple[list[float], list[float], float]]:
    """gloo's figures (run_gloo) and tensorbroker's (run_tensorbroker), one after the other,
    on loopback (`rate` None) or on links of `rate` each way (netns.machines)."""
    with contextlib.ExitStack() as st:
        ips = None
        if rate is not None:
            os.environ["UCX_NET_DEVICES"] = netns.DEVICE  # (not lo: it is each namespace's)
            ips = st.enter_context(netns.machines(["a", *READERS], rate))
        print(f"cluster sync{'' if rate is None else ' at ' + rate}: gloo ...", flush=True)
        gloo = run_gloo(mib, tensors, versions, ips)
        print(f"cluster sync{'' if rate is None else ' at ' + rate}: tensorbroker ...", flush=True)
        return gloo, run_tensorbroker(mib, tensors, versions, ips)


def table(
    gloo: tuple[list[float], list[float], list[float]], ours: tuple[list[float], list[float], float]
) -> list[str]:
    """The rows of one run, and each version's figures."""
    (g_blocked, g_ends, g_bcast), (t_blocked, t_ends, sent) = gloo, ours
    med = statistics.median
    ms = lambda xs: ", ".join(f"{x * 1e3:.0f}" for x in xs)  # noqa: E731

    def row(what: str, ours: float, gloo: float) -> str:
        return f"| {what} | {ours * 1e3:.0f} ms | {gloo * 1e3:.0f} ms | {ours / gloo:.2f} |"

    return [
        "| | tensorbroker | gloo broadcast (flat bucket) | ratio |", "|---|---|---|---|",
        row("trainer blocked, first version", t_blocked[0], g_blocked[0]),
        row("trainer blocked, the others (median)", med(t_blocked[1:]), med(g_blocked[1:])),
        row("end to end, last reader, first version", t_ends[0], g_ends[0]),
        row("end to end, last reader, the others (median)", med(t_ends[1:]), med(g_ends[1:])),
        row("end to end against gloo's broadcast alone (its bucket already filled), the "
            "others (median)", med(t_ends[1:]), med(g_bcast[1:])),
        "", f"Each version: tensorbroker blocked {ms(t_blocked)} ms, end to end {ms(t_ends)} ms; "
        f"gloo blocked {ms(g_blocked)} ms, end to end {ms(g_ends)} ms, its broadcast alone "
        f"{ms(g_bcast)} ms. Node a's broker sent {sent:.2f} copies a version.", "",
    ]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--tensors", type=int, default=194)
    parser.add_argument("--versions", type=int, default=9)
    parser.add_argument("--link", help="each node's link each way, as tc says it (4gbit; "
                        "several: 4gbit,10gbit), the nodes in network namespaces of their "
                        "own (root and iproute2: bench/netns.py), instead of loopback")  # fmt: skip
    parser.add_argument("--out")
    args = parser.parse_args()
    rates = [None] if args.link is None else args.link.split(",")
    out = args.out or os.path.join(
        HERE, "results", "cluster_sync.md" if args.link is None else "cluster_sync_link.md"
    )
    if args.link is not None and not netns.available():
        print("cluster sync --link: skipped, it needs root and iproute2 (ip, tc)", flush=True)
        return 0
    cores = os.cpu_count()
    lines = [
        f"# Weight sync to 3 other nodes ({time.strftime('%Y-%m-%d %H:%M')}, "
        f"bench/cluster_sync.py{'' if args.link is None else ' --link ' + args.link}, "
        f"{cores} cores)", "",
        f"A {args.mib} MiB bf16 state_dict of {args.tensors} tensors, {args.versions} versions; "
        + ("every process on this one host, bytes over TCP loopback (UCX_TLS=tcp; gloo's TCP). "
           if args.link is None else
           f"every process on this one host (its {cores} cores shared), each node in a "
           "network namespace of its own whose link is limited each way to the rate below "
           "(bench/netns.py: as machines with NICs of that speed), bytes over TCP (UCX_TLS="
           "tcp; gloo's TCP). ") +
        "The first version is the cold one (every process's memory touched for the first "
        "time, connections made); a training loop syncs the others. Both clocks start with "
        "the trainer holding the new state_dict: gloo's includes its copy into the flat "
        "bucket, as tensorbroker's includes the put's copy into shared memory.", "",
    ]  # fmt: skip
    for rate in rates:
        gloo, ours = sync(args.mib, args.tensors, args.versions, rate)
        if rate is not None:
            lines += [f"## Links of {rate} each way", ""]
        lines += table(gloo, ours)
    emit(out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
