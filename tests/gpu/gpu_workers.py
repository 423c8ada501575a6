"""Worker processes of the GPU tests (spawned: CUDA does not survive fork). Each one reports
through its queue and exits 0 only if its own checks held."""

from __future__ import annotations

import os
import time
from typing import Any

import tensorbroker as tb

N = 1 << 20  # float32 elements: 4 MiB


def _no_sync_here() -> None:
    """Make every host synchronisation in this process fail loudly: a consumer must be ordered
    after its producer by events alone."""
    import torch

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a host synchronisation was called in the consumer")

    torch.cuda.synchronize = refuse  # type: ignore[assignment]
    torch.cuda.Stream.synchronize = refuse  # type: ignore[method-assign]
    torch.cuda.Event.synchronize = refuse  # type: ignore[method-assign]


def torch_producer(address: str, key: str, value: float, sleep_cycles: int, start: Any,
                   out: Any, done: Any) -> None:  # fmt: skip
    import torch

    x = torch.empty(N, device="cuda:0")
    with tb.connect(address) as c:
        c.put(f"{key}-warmup", x)  # CuPy imported, the chunk and events opened: not timed
        c.delete(f"{key}-warmup")
        start.wait(120)  # every reader is connected and waiting
        torch.cuda._sleep(sleep_cycles)  # a long kernel before the write, on the same stream
        x.fill_(value)
        t0 = time.monotonic()
        version = c.put(key, x)
        put_s = time.monotonic() - t0
        out.put({"version": version, "put_s": put_s, "pid": os.getpid()})
        done.wait(120)


def _ready(c: tb.Client, out: Any) -> None:
    c.ping()
    out.put({"ready": os.getpid()})


def torch_reader(address: str, key: str, out: Any) -> None:
    import torch

    torch.zeros(1, device="cuda:0")  # CUDA up before the producer starts
    _no_sync_here()
    with tb.connect(address) as c:
        _ready(c, out)
        t = c.get(key, timeout=60)
        x = t.torch()
        total = float(x.sum().item())  # .item() waits for this process's own stream only
        chunk = next(iter(c._transfer.devices._chunks.values()))  # the one chunk this test uses
        out.put({"sum": total, "ptr": x.data_ptr(), "data_ptr": t.data_ptr,
                 "chunk": chunk.address, "device": str(x.device)})  # fmt: skip


def jax_reader(address: str, key: str, out: Any) -> None:
    import jax.numpy as jnp

    jnp.zeros(1).block_until_ready()
    with tb.connect(address) as c:
        _ready(c, out)
        t = c.get(key, timeout=60)
        x = jnp.from_dlpack(t)
        out.put({"sum": float(x.sum()), "ptr": x.unsafe_buffer_pointer(), "data_ptr": t.data_ptr,
                 "device": str(x.devices())})  # fmt: skip


def cupy_reader(address: str, key: str, out: Any) -> None:
    import cupy

    cupy.zeros(1)
    with tb.connect(address) as c:
        _ready(c, out)
        t = c.get(key, timeout=60)
        x = t.cupy()
        out.put({"sum": float(x.sum()), "ptr": int(x.data.ptr), "data_ptr": t.data_ptr})


def slow_reader(address: str, key: str, sleep_cycles: int, go: Any, out: Any) -> None:
    """Read `key` in a kernel queued behind a long one, and let go before it has run."""
    import torch

    # Load the kernels first: with CUDA's lazy loading, the first launch of a kernel waits
    # for the device, so a first `* 2` behind the sleep would block here until it ended.
    float((torch.ones(1, device="cuda:0") * 2).sum().item())
    with tb.connect(address) as c:
        t = c.get(key, timeout=30)
        torch.cuda._sleep(sleep_cycles)
        doubled = t.torch() * 2  # runs after the sleep, on this process's stream
        del t
        time.sleep(0.2)  # the release (with its read-done event) reaches the broker
        busy = not torch.cuda.current_stream().query()  # the read is still to run
        go.set()  # the producer now deletes the key and puts over the same memory
        out.put({"sum": float(doubled.sum().item()), "busy_at_go": busy})


def overwriter(address: str, key: str, go: Any, out: Any) -> None:
    import torch

    with tb.connect(address) as c:
        other = torch.full((N,), 5.0, device="cuda:0")
        torch.cuda.synchronize()  # this process's own setup, before anything is timed
        c.ping()
        go.wait(60)
        c.delete(key)
        start = time.monotonic()
        c.put("other", other)  # fits only in the memory the slow reader is still reading
        waited = time.monotonic() - start
        torch.cuda.synchronize()  # the copy has landed before the reader's sum is taken
        out.put({"waited_s": waited})


def pipeline_source(address: str, items: int, out: Any) -> None:
    import torch

    with tb.connect(address) as c:
        q = c.queue("gpu/raw", maxsize=4)
        sums = []
        for i in range(items):
            x = torch.randn(256, 1024, device="cuda:0") + i
            sums.append(float(x.sum().item()))
            q.put(x)
        q.close()
        out.put({"sums": sums})


def pipeline_jax_stage(address: str, out: Any) -> None:
    import jax.numpy as jnp

    with tb.connect(address) as c:
        src, dst = c.queue("gpu/raw", maxsize=4), c.queue("gpu/doubled", maxsize=4)
        n = 0
        for item in src:
            dst.put(jnp.from_dlpack(item) * 2)
            del item
            n += 1
        dst.close()
        out.put({"n": n})


def pipeline_sink(address: str, out: Any) -> None:
    import torch

    with tb.connect(address) as c:
        sums = [float(torch.from_dlpack(item).sum().item()) for item in c.queue("gpu/doubled", 4)]
        out.put({"sums": sums})


def hold_and_wait(address: str, key: str, out: Any) -> None:
    """Take `key` on a stream and hold it until killed."""
    with tb.connect(address) as c:
        t = c.get(key, timeout=30)
        x = t.torch()
        out.put({"sum": float(x.sum().item())})
        time.sleep(600)


def put_behind_long_kernel(address: str, key: str, sleep_cycles: int, out: Any) -> None:
    """Put `key` with its copy queued behind a long kernel, say so, and wait to be killed."""
    import torch

    x = torch.full((N,), 7.0, device="cuda:0")
    with tb.connect(address) as c:
        c.put(f"{key}-warmup", x)
        c.delete(f"{key}-warmup")
        torch.cuda.synchronize()
        torch.cuda._sleep(sleep_cycles)
        out.put({"version": c.put(key, x)})
        time.sleep(600)
