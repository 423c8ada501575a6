"""The CUDA path end to end: real processes, real torch / JAX / CuPy on one GPU.

Skipped with the reason on a machine without a GPU (see conftest.py); `pytest -m cuda`
runs them where there is one.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import gpu_workers as w
import pytest
from support import CHILDREN, join_all, wait_until

import tensorbroker as tb

pytestmark = pytest.mark.cuda
SLEEP_1S = 2_000_000_000  # GPU clock cycles: about a second on a current data-centre GPU


def _run(target: Any, *args: Any) -> tuple[Any, Any]:
    out = CHILDREN.Queue()
    p = CHILDREN.Process(target=target, args=(*args, out), name=target.__name__)
    p.start()
    return p, out


@pytest.mark.jax_gpu
def test_torch_put_jax_and_cupy_get_zero_copy_after_a_long_kernel(
    gpu_broker: tb.BrokerProcess,
) -> None:
    start, done, out = CHILDREN.Event(), CHILDREN.Event(), CHILDREN.Queue()
    producer = CHILDREN.Process(
        target=w.torch_producer, args=(gpu_broker.address, "x", 3.0, SLEEP_1S, start, out, done)
    )
    producer.start()
    readers = [
        _run(f, gpu_broker.address, "x") for f in (w.torch_reader, w.jax_reader, w.cupy_reader)
    ]
    assert all("ready" in q.get(timeout=180) for _, q in readers)
    start.set()  # the producer's long kernel starts only now: every reader is waiting
    results = [q.get(timeout=120) for _, q in readers]
    put = out.get(timeout=120)
    done.set()
    join_all([producer] + [p for p, _ in readers])
    assert put["put_s"] < 0.25, f"put waited for the GPU ({put['put_s']:.2f}s)"
    for r in results:
        assert r["sum"] == 3.0 * w.N  # the final data: every reader waited for the write
        assert r["ptr"] == r["data_ptr"]  # zero copy: the library reads the broker's memory
    torch_result = results[0]
    assert torch_result["chunk"] <= torch_result["data_ptr"] < torch_result["chunk"] + (2 << 30)
    assert torch_result["device"] == "cuda:0"


def test_memory_is_not_reused_before_a_readers_kernels_finish() -> None:
    with tb.start_broker(memory="64MiB", cuda_memory="0:6MiB") as b, tb.connect(b.address) as c:
        import torch

        c.put("a", torch.full((w.N,), 1.0, device="cuda:0"))
        go = CHILDREN.Event()
        reader, reader_q = _run(w.slow_reader, b.address, "a", SLEEP_1S * 2, go)
        out = CHILDREN.Queue()
        writer = CHILDREN.Process(target=w.overwriter, args=(b.address, "a", go, out))
        writer.start()
        got = reader_q.get(timeout=120)
        waited = out.get(timeout=120)
        join_all([reader, writer])
        assert got["busy_at_go"]  # the writer was let go while the read was still to run
        assert got["sum"] == 2.0 * w.N  # not 10.0 * N: the new put did not land under the read
        assert waited["waited_s"] > 0.5  # the put waited in the broker for the read to finish


@pytest.mark.jax_gpu
def test_torch_jax_torch_pipeline_with_checksums(gpu_broker: tb.BrokerProcess) -> None:
    items = 100
    source, sq = _run(w.pipeline_source, gpu_broker.address, items)
    stage, tq = _run(w.pipeline_jax_stage, gpu_broker.address)
    sink, kq = _run(w.pipeline_sink, gpu_broker.address)
    sent, passed, got = sq.get(timeout=300), tq.get(timeout=300), kq.get(timeout=300)
    join_all([source, stage, sink])
    assert passed["n"] == items
    assert got["sums"] == pytest.approx([2 * s for s in sent["sums"]], rel=1e-4)
    with tb.connect(gpu_broker.address) as c:
        assert wait_until(lambda: c.stats()["devices"]["cuda:0"]["used_bytes"] == 0, 10)


def test_a_killed_reader_gives_its_lease_back_and_a_reader_outlives_its_producer(
    gpu_broker: tb.BrokerProcess,
) -> None:
    start, done, out = CHILDREN.Event(), CHILDREN.Event(), CHILDREN.Queue()
    start.set()
    producer = CHILDREN.Process(
        target=w.torch_producer, args=(gpu_broker.address, "k", 2.0, 0, start, out, done)
    )
    producer.start()
    out.get(timeout=120)
    done.set()
    join_all([producer])  # the producer is gone; its object and events are the broker's
    holder, hq = _run(w.hold_and_wait, gpu_broker.address, "k")
    assert hq.get(timeout=120)["sum"] == 2.0 * w.N
    with tb.connect(gpu_broker.address) as c:
        assert c.stats()["leases"] == 1
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(30)
        assert wait_until(lambda: c.stats()["leases"] == 0, 10)
        c.delete("k")
        assert wait_until(lambda: c.stats()["devices"]["cuda:0"]["used_bytes"] == 0, 10)


def test_an_object_whose_producer_died_before_its_copy_ran_is_removed(
    gpu_broker: tb.BrokerProcess,
) -> None:
    """Its write event will never complete (bench/gpu_probes.py): a reader would wait on the
    GPU forever, and the memory would never come back. The broker removes the object, and
    the memory and a new event serve the next put."""
    import torch

    producer, out = _run(w.put_behind_long_kernel, gpu_broker.address, "k", SLEEP_1S * 3)
    assert out.get(timeout=120)["version"] == 1
    os.kill(producer.pid, signal.SIGKILL)
    producer.join(30)
    with tb.connect(gpu_broker.address) as c:
        assert wait_until(lambda: not c.exists("k"), 10)
        assert wait_until(lambda: c.stats()["devices"]["cuda:0"]["used_bytes"] == 0, 10)
        for value in (4.0, 5.0):  # the memory and the events serve later puts and reads
            c.put("k", torch.full((w.N,), value, device="cuda:0"))
            assert float(c.get("k").torch().sum().item()) == value * w.N


def test_gpu_replicas_between_two_brokers() -> None:
    """Issue 33: a GPU object put on node a is read on node b from a replica in b's GPU
    memory, moved by NIXL from VRAM to VRAM (two brokers on one GPU: UCX's CUDA IPC)."""
    import importlib.util

    if not any(importlib.util.find_spec(p) for p in ("nixl_cu13", "nixl_cu12", "nixl")):
        pytest.skip("the cluster needs NIXL: pip install nixl-cu13 --no-deps (or nixl-cu12)")
    import contextlib

    import torch
    from support import free_port

    ports = {n: free_port() for n in "ab"}
    with contextlib.ExitStack() as stack:
        clients = {}
        for n in "ab":
            peers = ",".join(f"tcp://127.0.0.1:{p}" for m, p in ports.items() if m != n)
            options = ["--node", n, "--cluster", f"tcp://127.0.0.1:{ports[n]}",
                       "--peers", peers, "--insecure-tcp"]  # fmt: skip
            broker = tb.start_broker(memory="64MiB", cuda_memory="0:64MiB", options=options)
            stack.enter_context(broker)
            clients[n] = stack.enter_context(tb.connect(broker.address))
        a, b = clients["a"], clients["b"]
        fresh = lambda c: all(p["fresh"] for p in c.stats()["cluster"]["peers"].values())  # noqa: E731
        assert wait_until(lambda: fresh(a) and fresh(b), 20)
        x = torch.arange(1 << 20, dtype=torch.float32, device="cuda:0")
        a.put("w", x)
        assert wait_until(lambda: b.exists("w"), 10)
        got = b.get("w", timeout=30)
        assert got.device == "cuda:0"
        assert torch.equal(torch.from_dlpack(got), x)
        figures = b.stats()
        assert figures["cluster"]["bytes_received"] >= x.nbytes
        assert figures["devices"]["cuda:0"]["used_bytes"] >= x.nbytes  # the replica, on b's GPU
        del got


def test_vmm_chunks_are_read_by_another_process_from_a_passed_descriptor() -> None:
    """Issue 36: with --cuda-handles vmm a client maps the GPU memory from a descriptor the
    broker passed over its lane, not a legacy IPC handle."""
    import torch

    with tb.start_broker(
        memory="64MiB", cuda_memory="0:64MiB", options=["--cuda-handles", "vmm"]
    ) as b:
        with tb.connect(b.address) as c:
            c.put("x", torch.full((w.N,), 3.0, device="cuda:0"))
            assert c.stats()["devices"]["cuda:0"]["handles"] == "vmm"
        reader, out = _run(w.cupy_reader, b.address, "x")
        assert "ready" in out.get(timeout=180)
        result = out.get(timeout=120)
        join_all([reader])
        assert result["sum"] == 3.0 * w.N
