"""tensorbroker demo: a PyTorch process -> a JAX process -> a NumPy process, through one broker.

    make demo        (or: .venv/bin/python -P demo/pipeline.py [--items N] [--mib M])

Starts a broker on the default address (or uses the one already serving there), runs three
stages in three processes, and prints what it proves: every item arrived with the right
checksum, and no hop copied (each consumer's array lies in the broker's shared memory).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from typing import Any

import numpy as np

import tensorbroker as tb
from tensorbroker.common.config import default_address


def in_shared_memory(ptr: int) -> bool:
    """Whether address `ptr` of this process lies in a /dev/shm mapping (the broker's)."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if start <= ptr < end:
                return len(parts) > 5 and parts[5].startswith("/dev/shm/tb-")
    return False


def torch_stage(address: str, items: int, n: int, report: Any) -> None:
    """Produce batches with PyTorch: batch i is i + arange(n) / n."""
    import torch

    with tb.connect(address) as c:
        start = time.perf_counter()
        for i in range(items):
            c.put(f"demo/batch/{i}", torch.arange(n, dtype=torch.float32) / n + i)
        report.put(("torch", items, time.perf_counter() - start, True))


def jax_stage(address: str, items: int, report: Any) -> None:
    """Transform with JAX: y = 2 * x + 1, read straight from shared memory."""
    import jax
    import jax.numpy as jnp

    double = jax.jit(lambda x: 2.0 * x + 1.0)
    zero_copy = True
    with tb.connect(address) as c:
        start = time.perf_counter()
        for i in range(items):
            t = c.get(f"demo/batch/{i}", timeout=60)
            x = jnp.from_dlpack(t)
            zero_copy &= x.unsafe_buffer_pointer() == t.data_ptr and in_shared_memory(t.data_ptr)
            c.put(f"demo/out/{i}", double(x))
            del x, t
            c.delete(f"demo/batch/{i}")
        report.put(("jax", items, time.perf_counter() - start, zero_copy))


def numpy_stage(address: str, items: int, n: int, report: Any) -> None:
    """Check with NumPy: every item's checksum, and where its bytes are."""
    zero_copy, good = True, 0
    with tb.connect(address) as c:
        start = time.perf_counter()
        for i in range(items):
            t = c.get(f"demo/out/{i}", timeout=60)
            y = np.from_dlpack(t)
            zero_copy &= y.ctypes.data == t.data_ptr and in_shared_memory(y.ctypes.data)
            expected = 2.0 * (np.arange(n, dtype=np.float32) / n + i) + 1.0
            good += bool(np.allclose(y, expected))
            del y, t
            c.delete(f"demo/out/{i}")
        report.put(("numpy", good, time.perf_counter() - start, zero_copy))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=200)
    ap.add_argument("--mib", type=float, default=4.0, help="size of each batch in MiB")
    args = ap.parse_args()
    n = int(args.mib * 2**20) // 4
    address = default_address()
    broker = None
    try:
        tb.connect(address, timeout=0.5).close()
        print(f"using the broker already serving {address}")
    except tb.BrokerUnavailable:
        broker = tb.start_broker(memory="1GiB", address=address)
        print(f"started a broker (pid {broker.pid}) on {address}")
    try:
        ctx = mp.get_context("spawn")
        report = ctx.Queue()
        stages = [
            ctx.Process(target=torch_stage, args=(address, args.items, n, report), name="torch"),
            ctx.Process(target=jax_stage, args=(address, args.items, report), name="jax"),
            ctx.Process(target=numpy_stage, args=(address, args.items, n, report), name="numpy"),
        ]
        print(f"pipeline: {args.items} batches of {args.mib:g} MiB, torch -> jax -> numpy, "
              "each stage its own process")  # fmt: skip
        for p in stages:
            p.start()
        results = {}
        for _ in stages:
            name, count, seconds, zero_copy = report.get(timeout=600)
            results[name] = (count, seconds, zero_copy)
        for p in stages:
            p.join(60)
        codes = [p.exitcode for p in stages]
    finally:
        if broker is not None:
            broker.stop()
    good, seconds, _ = results["numpy"]
    rows = [
        ("torch", f"put {args.items} batches", results["torch"][1], None),
        ("jax", "read, transformed, put", results["jax"][1], results["jax"][2]),
        ("numpy", "read and checked", seconds, results["numpy"][2]),
    ]
    for name, what, secs, zero_copy in rows:
        copies = "" if zero_copy is None else f"   zero-copy reads: {'yes' if zero_copy else 'NO'}"
        print(f"  {name:6} {what:26} {secs:6.2f} s{copies}")
    gib = args.items * args.mib / 1024 * 2
    print(
        f"proved: {good}/{args.items} items arrived with the right values; {gib:.2f} GiB crossed "
        "two process boundaries with one copy into shared memory per put and none on any read."
    )
    ok = codes == [0, 0, 0] and good == args.items and results["jax"][2] and results["numpy"][2]
    if not ok:
        print(f"FAILED: exit codes {codes}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
