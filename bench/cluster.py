"""The cluster section of `make bench`: brokers on this host as nodes of one cluster, the
bytes over UCX's TCP transport (UCX_TLS=tcp), against the raw floors measured in the same
run. Written to bench/results/cluster.md.

    first get of 256 MiB on another node    vs  one raw NIXL READ of 256 MiB, two processes,
                                            each just before it (agents made as the brokers')
    CPU of a raw NIXL WRITE of 256 MiB      vs  that of a raw READ (both processes' CPU):
                                            why a lent version is pushed (Note [pushes];
                                            no target)
    first get of 4 KiB on another node      vs  one raw ZeroMQ round trip, tcp loopback
      (--prefetch 64KiB: read there as it was announced, Note [prefetch], the get made
      once that read ended; and, with the default --prefetch 0, pulled at the get)
    second get of 4 KiB there (its replica) vs  a get on the node that put it
    puts of 4 KiB on a node (its peer told)  vs  the same on a lone broker
    one 64 MiB version read on 3 nodes      vs  its size: what its owner's broker sent
    a queue item to a consumer waiting on another node, and a stream of 1 MiB items to
    another node                            vs  the same with both on one node

Each figure is the median of REPS tries (a fresh key for each first get). Usage:
python bench/cluster.py [--reps N] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import zmq

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("UCX_TLS", "tcp")

from harness.report import emit  # noqa: E402

import tensorbroker as tb  # noqa: E402
from tensorbroker.server.cluster.transfers import new_agent  # noqa: E402
from tests.support import free_port  # noqa: E402

MiB = 2**20


@contextlib.contextmanager
def cluster(
    nodes: list[str], memory: str, more: tuple[str, ...] = ()
) -> Iterator[dict[str, tb.Client]]:
    """Brokers on this host as the nodes of one cluster, each served with `more` options."""
    ports = {n: free_port() for n in nodes}  # (below the ephemeral range: tests/support.py)
    with contextlib.ExitStack() as stack:
        clients = {}
        for n in nodes:
            peers = ",".join(f"tcp://127.0.0.1:{p}" for m, p in ports.items() if m != n)
            options = ["--node", n, "--cluster", f"tcp://127.0.0.1:{ports[n]}",
                       "--peers", peers, "--insecure-tcp", *more]  # fmt: skip
            broker = stack.enter_context(tb.start_broker(memory=memory, options=options))
            clients[n] = stack.enter_context(tb.connect(broker.address))
        deadline = time.monotonic() + 20
        while not all(
            all(p["state"] == "up" for p in c.stats()["cluster"]["peers"].values())
            for c in clients.values()
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not come up within 20 s")
            time.sleep(0.05)
        while not all(  # each peer's offers readable (a beat answered: links.py, `fresh`)
            all(p["fresh"] for p in c.stats()["cluster"]["peers"].values())
            for c in clients.values()
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster's beats were not answered within 20 s")
            time.sleep(0.05)
        yield clients


def _known(c: tb.Client, key: str) -> None:
    deadline = time.monotonic() + 10
    while not c.exists(key):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{key!r} never reached the other node")
        time.sleep(0.001)


def _offers_read(c: tb.Client) -> int:
    return int(c.stats()["cluster"]["pulled"].get("offered", 0))


def _median(f: Callable[[int], float], reps: int) -> float:
    return statistics.median(f(i) for i in range(reps))


# -- the floors ----------------------------------------------------------------------------------


def _cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def _nixl_target(size: int, pipe: Any) -> None:
    agent = new_agent("target")
    buf = np.ones(size, np.uint8)
    agent.register_memory([(buf.ctypes.data, size, 0, "")], "DRAM")
    pipe.send((bytes(agent.get_agent_metadata()), buf.ctypes.data))
    while pipe.recv() == "cpu":  # until the reader is done
        pipe.send(_cpu())


@contextlib.contextmanager
def raw_nixl(size: int) -> Iterator[Callable[[str], tuple[float, float]]]:
    """A function making one NIXL transfer of `size` bytes with another process, READ (from
    it) or WRITE (to it), and giving its seconds and the CPU seconds both processes spent.
    Both agents are made as a broker makes its own (transfers.new_agent), their progress
    threads paced as a broker's: NIXL's default agent spins its thread, a core each (3.0
    CPU-s in 3 s idle), and beside two of them the brokers measured got half the 2 cores,
    and took 135 ms for a first get that took 62-78 ms beside paced ones. The reader looks
    whether its transfer ended every 0.2 ms, as a broker's mover does."""
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    target = ctx.Process(target=_nixl_target, args=(size, theirs))
    target.start()
    try:
        metadata, remote = mine.recv()
        agent = new_agent("reader")
        dst = np.zeros(size, np.uint8)
        agent.register_memory([(dst.ctypes.data, size, 0, "")], "DRAM")
        agent.add_remote_agent(metadata)

        def theirs_cpu() -> float:
            mine.send("cpu")
            return float(mine.recv())

        def once(op: str) -> tuple[float, float]:
            cpu = _cpu() + theirs_cpu()
            began = time.perf_counter()
            local = agent.get_xfer_descs([(dst.ctypes.data, size, 0)], "DRAM")
            far = agent.get_xfer_descs([(remote, size, 0)], "DRAM")
            handle = agent.initialize_xfer(op, local, far, "target")
            agent.transfer(handle)
            while agent.check_xfer_state(handle) == "PROC":
                time.sleep(0.0002)
            agent.release_xfer_handle(handle)
            took = time.perf_counter() - began
            return took, _cpu() + theirs_cpu() - cpu

        once("READ"), once("WRITE")  # the connection is made on the first
        yield once
    finally:
        mine.send("done")
        target.join(30)


def read_against_write(
    once: Callable[[str], tuple[float, float]], reps: int
) -> tuple[float, float]:
    """The CPU seconds of both processes for a raw NIXL READ and for a WRITE of as many bytes
    (medians, alternated): why a version lent in host memory is pushed by its lender rather
    than read (Note [pushes] in server/cluster/pushes.py: UCX's TCP has no zero-copy get; a
    READ comes back as messages, copied out of UCX's receive segment; a WRITE is received
    in place)."""
    reads, writes = [], []
    for _ in range(reps):
        reads.append(once("READ")[1])
        writes.append(once("WRITE")[1])
    return statistics.median(reads), statistics.median(writes)


def raw_zmq_round_trip(reps: int) -> float:
    """Seconds for one small ZeroMQ request and reply over tcp loopback (the median)."""
    ctx = zmq.Context()
    rep, req = ctx.socket(zmq.REP), ctx.socket(zmq.REQ)
    port = rep.bind_to_random_port("tcp://127.0.0.1")
    req.connect(f"tcp://127.0.0.1:{port}")

    def echo() -> None:
        for _ in range(reps + 1):
            rep.send(rep.recv())

    thread = threading.Thread(target=echo)
    thread.start()

    def once(_: int) -> float:
        began = time.perf_counter()
        req.send(b"x" * 64)
        req.recv()
        return time.perf_counter() - began

    once(0)
    t = _median(once, reps)
    thread.join()
    req.close(0)
    rep.close(0)
    ctx.term()
    return t


# -- tensorbroker ----------------------------------------------------------------------------------


def first_get(a: tb.Client, b: tb.Client, size: int, reps: int, prefetched: bool = False) -> float:
    """The first get on b of a version put on a (`prefetched`: once b read it as it was
    announced; else once b knows of it)."""
    return _median(_first_gets(a, b, size, prefetched), reps)


def _first_gets(a: tb.Client, b: tb.Client, size: int, prefetched: bool) -> Callable[[int], float]:
    x = np.ones(size, np.uint8)

    def once(i: int) -> float:
        key = f"first-{size}-{i}"
        read = _offers_read(b)
        a.put(key, x)
        _known(b, key)
        while prefetched and _offers_read(b) == read:
            time.sleep(0.001)
        began = time.perf_counter()
        item = b.get(key)
        t = time.perf_counter() - began
        del item
        a.delete(key)
        return t

    return once


def first_get_beside(
    a: tb.Client, b: tb.Client, size: int, reps: int, floor: Callable[[], float]
) -> tuple[float, float, float]:
    """First gets on b of `size` bytes put on a, each right after one `floor` (a raw read of
    as many bytes): the medians of both and of their ratios (floor / get). Interleaved, a
    busier host slows both alike."""
    get, pairs = _first_gets(a, b, size, False), []
    for i in range(reps):
        pairs.append((floor(), get(i)))
    return (statistics.median(g for _, g in pairs), statistics.median(f for f, _ in pairs),
            statistics.median(f / g for f, g in pairs))  # fmt: skip


def repeat_get(c: tb.Client, key: str, reps: int) -> float:
    c.get(key)

    def once(_: int) -> float:
        began = time.perf_counter()
        item = c.get(key)
        t = time.perf_counter() - began
        del item
        return t

    return _median(once, reps)


def repeat_put(c: tb.Client, reps: int) -> float:
    """Seconds per put of 4 KiB (the median), over 20 keys: small puts in a loop."""
    x = np.ones(4096, np.uint8)
    for i in range(20):
        c.put(f"put-{i}", x)

    def once(i: int) -> float:
        began = time.perf_counter()
        c.put(f"put-{i % 20}", x)
        return time.perf_counter() - began

    return _median(once, reps)


def queue_handoff(producer: tb.Client, consumer: tb.Client, name: str, reps: int) -> float:
    """Seconds from a put of a 4 KiB item to its consumer, already waiting, having it (the
    median): a consumer parked ahead."""
    got: list[float] = []
    ready = threading.Event()

    def consume() -> None:
        q = consumer.queue(name)
        ready.set()
        for _ in range(reps + 1):
            item = q.get(timeout=30)
            got.append(time.perf_counter())
            del item

    thread = threading.Thread(target=consume)
    thread.start()
    ready.wait()
    q, x, times = producer.queue(name), np.ones(4096, np.uint8), []
    for i in range(reps + 1):
        time.sleep(0.02)  # the consumer waits again
        began = time.perf_counter()
        q.put(x)
        while len(got) <= i:
            time.sleep(0.0001)
        times.append(got[i] - began)
    thread.join()
    return statistics.median(times[1:])


def queue_stream(producer: tb.Client, consumer: tb.Client, name: str, n: int) -> float:
    """Items per second of a stream of `n` 1 MiB items through a queue of at most 8 in
    flight, from the producer's first put to the consumer's last item: streaming."""

    def consume() -> None:
        for item in consumer.queue(name, maxsize=8):
            del item

    thread = threading.Thread(target=consume)
    thread.start()
    q, x = producer.queue(name, maxsize=8), np.ones(MiB, np.uint8)
    began = time.perf_counter()
    for _ in range(n):
        q.put(x)
    q.close()
    thread.join()
    return n / (time.perf_counter() - began)


def fan_out(size: int) -> float:
    """What the owner's broker sent for one version read on 3 other nodes at once, in
    multiples of its size."""
    nodes = ["a", "b", "c", "d"]
    with cluster(nodes, f"{size // MiB * 2 + 64}MiB") as cs:
        cs["a"].put("shard", np.ones(size, np.uint8))
        readers = [cs[n] for n in nodes[1:]]
        for r in readers:
            _known(r, "shard")
        threads = [threading.Thread(target=r.get, args=("shard",)) for r in readers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return float(cs["a"].stats()["cluster"]["bytes_sent"]) / size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "cluster.md"))
    args = parser.parse_args()
    reps = args.reps
    big = 256 * MiB
    print("cluster bench: the floors ...", flush=True)
    rtt = raw_zmq_round_trip(reps * 20)
    print("cluster bench: two nodes ...", flush=True)
    with cluster(["a", "b"], "700MiB", ("--prefetch", "64KiB")) as cs, raw_nixl(big) as raw:
        a, b = cs["a"], cs["b"]
        big_get, nixl, big_ratio = first_get_beside(a, b, big, reps, lambda: raw("READ")[0])
        read_cpu, write_cpu = read_against_write(raw, reps)
        small_get = first_get(a, b, 4096, reps, prefetched=True)
        a.put("small", np.ones(4096, np.uint8))
        _known(b, "small")
        replica = repeat_get(b, "small", reps * 20)
        local = repeat_get(a, "small", reps * 20)
        put_there = repeat_put(a, reps * 20)
        print("cluster bench: queues ...", flush=True)
        handoff_there = queue_handoff(a, b, "handoff-ab", reps * 3)
        handoff_here = queue_handoff(a, a, "handoff-aa", reps * 3)
        stream_there = queue_stream(a, b, "stream-ab", 200)
        stream_here = queue_stream(a, a, "stream-aa", 200)
    with cluster(["a", "b"], "64MiB", ("--prefetch", "0")) as cs:
        pulled_get = first_get(cs["a"], cs["b"], 4096, reps)
    print("cluster bench: fan-out ...", flush=True)
    sent = fan_out(64 * MiB)
    lone = tb.start_broker(memory="64MiB")
    try:
        with tb.connect(lone.address) as c:
            put_lone = repeat_put(c, reps * 20)
    finally:
        lone.stop()
    rows = [
        ("first get of 256 MiB on another node", f"{big_get * 1e3:.1f} ms",
         f"raw NIXL READ {nixl * 1e3:.1f} ms (each just before)", big_ratio,
         "bandwidth, at least 0.8x"),
        ("CPU of a raw NIXL WRITE of 256 MiB (both processes)", f"{write_cpu * 1e3:.0f} ms",
         f"a raw NIXL READ {read_cpu * 1e3:.0f} ms", write_cpu / read_cpu,
         "(none: why lent versions are pushed)"),
        ("first get of 4 KiB on another node (read there as announced)",
         f"{small_get * 1e6:.0f} us", f"raw ZeroMQ round trip {rtt * 1e6:.0f} us",
         small_get / rtt, "at most 3x"),
        ("first get of 4 KiB on another node, pulled at the get (--prefetch 0)",
         f"{pulled_get * 1e6:.0f} us", f"raw ZeroMQ round trip {rtt * 1e6:.0f} us",
         pulled_get / rtt, "(none)"),
        ("second get of 4 KiB there (replica)", f"{replica * 1e6:.1f} us",
         f"local get {local * 1e6:.1f} us", replica / local, "at most 2x"),
        ("put of 4 KiB on a node of the cluster (its peer told)", f"{put_there * 1e6:.0f} us",
         f"a lone broker {put_lone * 1e6:.0f} us", put_there / put_lone, "(none)"),
        ("64 MiB read on 3 nodes at once", f"owner sent {sent:.2f}x", "its size", sent,
         "at most 2x"),
        ("queue: a 4 KiB item to a consumer waiting on another node",
         f"{handoff_there * 1e6:.0f} us", f"both on one node {handoff_here * 1e6:.0f} us",
         handoff_there / handoff_here, "(none)"),
        ("queue: a stream of 1 MiB items to another node", f"{stream_there:.0f} items/s",
         f"both on one node {stream_here:.0f} items/s", stream_here / stream_there, "(none)"),
    ]  # fmt: skip
    lines = [
        "# Cluster (UCX over TCP loopback, brokers on one host)",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {os.cpu_count()} CPUs, medians of "
        f"{reps} tries (first gets: a fresh key each; the 256 MiB row's ratio: the median of "
        "each get's against the raw read just before it), same run.",
        "",
        "| pattern | tensorbroker | floor | ratio | target |",
        "|---|---|---|---|---|",
        *(f"| {p} | {t} | {f} | {r:.2f} | {g} |" for p, t, f, r, g in rows),
        "",
    ]
    emit(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
