"""Pipeline stages: code that runs in the child processes of test_pipelines
(tests/support.py CHILDREN).

Each stage reports through a multiprocessing queue and exits 0 only if it got to the end.
Batch i of a pipeline is `i + arange(n) / n` (float32); the transform is `2 * x + 1`.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from workers import shm_mapping

import tensorbroker as tb


def batch(i: int, n: int) -> np.ndarray[Any, Any]:
    return np.float32(i) + np.arange(n, dtype=np.float32) / np.float32(n)


def in_broker_memory(ptr: int) -> bool:
    return (shm_mapping(ptr) or "").startswith("/dev/shm/tb-")


# -- three stages: torch -> JAX -> NumPy -----------------------------------------------------


def torch_source(address: str, queue: str, items: int, n: int, maxsize: int) -> None:
    import torch

    with tb.connect(address) as c:
        q = c.queue(queue, maxsize=maxsize)
        for i in range(items):
            q.put({"x": torch.from_numpy(batch(i, n)), "index": torch.tensor([i])}, timeout=60)
        q.close()


def jax_transform(address: str, source: str, sink: str, maxsize: int, report: Any) -> None:
    import jax
    import jax.numpy as jnp

    transform = jax.jit(lambda x: 2.0 * x + 1.0)
    count, zero_copy = 0, True
    with tb.connect(address) as c:
        q_in, q_out = c.queue(source, maxsize=maxsize), c.queue(sink, maxsize=maxsize)
        for item in q_in:
            x = jnp.from_dlpack(item["x"])
            ptr = x.unsafe_buffer_pointer()
            zero_copy &= ptr == item["x"].data_ptr and in_broker_memory(ptr)
            q_out.put({"y": transform(x), "index": item["index"].numpy()}, timeout=60)
            count += 1
            del item, x
        q_out.close()
    report.put(("jax", count, zero_copy))


def numpy_sink(address: str, queue: str, n: int, report: Any) -> None:
    indices, bad, zero_copy = [], 0, True
    with tb.connect(address) as c:
        for item in c.queue(queue):
            y = np.from_dlpack(item["y"])
            zero_copy &= y.ctypes.data == item["y"].data_ptr and in_broker_memory(y.ctypes.data)
            i = int(item["index"].numpy()[0])
            indices.append(i)
            bad += not np.array_equal(y, 2 * batch(i, n) + 1)
            del item, y
    report.put(("numpy", indices, bad, zero_copy))


# -- many producers and consumers ------------------------------------------------------------


def numbered_producer(address: str, queue: str, producer: int, count: int) -> None:
    with tb.connect(address) as c:
        q = c.queue(queue)
        for seq in range(count):
            q.put(np.array([producer, seq], np.int64), timeout=60)


def collecting_consumer(address: str, queue: str, name: str, report: Any) -> None:
    """Take items until the queue is closed and drained; report them as (a, b) pairs."""
    seen = []
    with tb.connect(address) as c:
        for item in c.queue(queue):
            a, b = item.numpy().tolist()[:2]
            seen.append((a, b))
            del item
    report.put((name, seen))


def closing_producer(address: str, queue: str, count: int, report: Any) -> None:
    """Put `count` items, close, and check that one more put is refused."""
    with tb.connect(address) as c:
        q = c.queue(queue)
        for seq in range(count):
            q.put(np.array([0, seq], np.int64))
        q.close()
        try:
            q.put(np.array([0, count], np.int64))
        except tb.QueueClosed as exc:
            report.put(("producer", f"refused: {exc}"))
        else:
            report.put(("producer", "a put after close went through"))


# -- backpressure ----------------------------------------------------------------------------


def timed_producer(
    address: str, queue: str, maxsize: int, count: int, nbytes: int, report: Any, wait: bool = True
) -> None:
    """Put `count` items of `nbytes`; report when each put returned (CLOCK_MONOTONIC)."""
    returned = []
    with tb.connect(address) as c:
        q = c.queue(queue, maxsize=maxsize)
        for i in range(count):
            q.put(np.full(nbytes, i % 251, np.uint8), timeout=60, wait=wait)
            returned.append(time.monotonic())
        q.close()
    report.put(("producer", returned))


def slow_consumer(address: str, queue: str, delay: float, report: Any) -> None:
    """Take items one by one, `delay` seconds each; report when each was let go."""
    let_go, good = [], True
    with tb.connect(address) as c:
        for i, item in enumerate(c.queue(queue)):
            array = item.numpy()
            good &= bool(array[0] == array[-1] == i % 251)
            time.sleep(delay)
            let_go.append(time.monotonic())
            del item, array  # the release is sent after this moment
    report.put(("consumer", let_go, good))


def holding_consumer(address: str, queue: str, hold: int, holding: Any) -> None:
    """Take `hold` items, keep them, and wait to be killed."""
    c = tb.connect(address)
    q = c.queue(queue)
    kept = [q.get(timeout=60) for _ in range(hold)]
    holding.put([int(t.numpy()[1]) for t in kept])
    time.sleep(600)


# -- weight sync -----------------------------------------------------------------------------


def model_state(step: int) -> dict[str, Any]:
    """A small model's state_dict with every value set to `step`."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))
    return dict(model.state_dict())


def trainer(address: str, key: str, versions: int) -> None:
    """Publish `versions` versions of the state_dict bundle, a little apart."""
    with tb.connect(address) as c:
        for step in range(versions):
            c.put(key, model_state(step))
            time.sleep(0.02)


def weight_watcher(
    framework: str, address: str, key: str, names: list[str], last: int, report: Any
) -> None:
    """Follow `key` until step `last`; report (version, step, whole) for each version seen:
    whole if it has every tensor of `names` and every value in it is that step's."""
    seen = []
    with tb.connect(address) as c:
        for state in c.watch(key, timeout=60):
            if framework == "jax":
                import jax.numpy as jnp

                arrays = [np.asarray(jnp.from_dlpack(t)) for t in state.values()]
            else:
                import torch

                arrays = [torch.from_dlpack(t).numpy() for t in state.values()]
            step = float(arrays[0].flat[0])
            whole = sorted(state) == sorted(names) and all(bool((a == step).all()) for a in arrays)
            version = next(iter(state.values())).version
            seen.append((version, step, whole))
            del state, arrays
            if step == last:
                break
    report.put((framework, seen))


# -- asyncio stages (test_aio.py) ---------------------------------------------------------------


def delayed_puts(address: str, keys: list[str], delay: float) -> None:
    """After `delay` seconds, put each key as an array holding its index."""
    time.sleep(delay)
    with tb.connect(address) as c:
        for i, key in enumerate(keys):
            c.put(key, np.full(16, i, np.int64))


def async_relay(address: str, source: str, sink: str, report: Any) -> None:
    """An asyncio process: each item of `source`, doubled, into `sink`, until `source` closes;
    a ticker task reports how often the event loop ran meanwhile."""
    import asyncio

    async def run() -> int:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)

        ticker = asyncio.create_task(tick())
        async with tb.aio.connect(address) as c:
            inbox, outbox = await c.queue(source), await c.queue(sink, maxsize=4)
            async for item in inbox:
                await outbox.put(np.from_dlpack(item) * 2)
                del item
            await outbox.close()
        ticker.cancel()
        return ticks

    report.put(("relay", asyncio.run(run())))


def torch_sink(address: str, queue: str, report: Any) -> None:
    """Every item of `queue` as a torch tensor (zero copy), until it closes."""
    import torch

    seen = []
    with tb.connect(address) as c:
        for item in c.queue(queue):
            seen.append(torch.from_dlpack(item).tolist())
            del item
    report.put(("torch", seen))
