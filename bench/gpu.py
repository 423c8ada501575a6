"""GPU benchmark: the two CUDA targets, each as a ratio to a floor measured in the same run.

    put bandwidth of a 1 GiB device tensor / a device-to-device copy of it    (target >= 0.8)
    get latency of a device object (cached handle) / a host object's get      (target <= 2)

A put is timed from the call until its copy has run (the producer's stream synchronised
afterwards: put itself returns at once); the floor is `dst.copy_(src)` on the same stream
with the same synchronisation. Gets are of 4 KiB objects, each taken on torch's current stream
and dropped, median of many. Needs torch with CUDA and CuPy; says so and exits 2 otherwise.

    .venv/bin/python -P bench/gpu.py [--reps 5] [--out bench/results/gpu.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

GIB = 1 << 30


def median_time(fn, reps: int, warmup: int = 1) -> float:  # type: ignore[no-untyped-def]
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_put(c, reps: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Median seconds of a 1 GiB device-to-device copy and of a put of the same tensor."""
    import torch

    src = torch.rand(GIB // 4, device="cuda:0")
    dst = torch.empty_like(src)
    stream = torch.cuda.current_stream()

    def copy() -> None:
        dst.copy_(src)
        stream.synchronize()

    def put() -> None:
        c.put("big", src)
        stream.synchronize()
        c.delete("big")

    rows = []
    for rep in range(reps):  # interleaved, so drifts hit both alike
        rows.append((median_time(copy, 3), median_time(put, 3)))
        print(f"put rep {rep + 1}/{reps}: copy {rows[-1][0] * 1e3:.2f} ms, "
              f"put {rows[-1][1] * 1e3:.2f} ms", flush=True)  # fmt: skip
    return statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)


def measure_get(c, reps: int, gets: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Median seconds of a 4 KiB get taken into torch: a host object's, a device object's."""
    import numpy as np
    import torch

    c.put("host", np.ones(1024, np.float32))
    c.put("dev", torch.ones(1024, device="cuda:0"))

    def get(key: str) -> None:
        torch.from_dlpack(c.get(key))

    lat: dict[str, list[float]] = {"host": [], "dev": []}
    for _ in range(reps):
        for key in lat:
            lat[key].append(median_time(lambda k=key: get(k), gets // reps, warmup=10))
    return statistics.median(lat["host"]), statistics.median(lat["dev"])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--gets", type=int, default=2000)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    try:
        import cupy  # noqa: F401
        import torch
    except ImportError as exc:
        print(f"bench/gpu.py needs torch with CUDA and CuPy: {exc}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device here", file=sys.stderr)
        return 2
    import tensorbroker as tb

    with tb.start_broker(memory="512MiB", cuda_memory="0:4GiB") as b, tb.connect(b.address) as c:
        t_copy, t_put = measure_put(c, args.reps)
        torch.cuda.empty_cache()
        host, dev = measure_get(c, args.reps, args.gets)
    put_ratio, get_ratio = t_copy / t_put, dev / host
    report = "\n".join([
        "| measure | tensorbroker | floor | ratio | target | met |",
        "|---|---|---|---|---|---|",
        f"| put 1 GiB on cuda:0 | {t_put * 1e3:.2f} ms ({GIB / t_put / 1e9:.0f} GB/s) "
        f"| D2D copy {t_copy * 1e3:.2f} ms ({GIB / t_copy / 1e9:.0f} GB/s) "
        f"| {put_ratio:.2f} of the copy's bandwidth | >= 0.8 "
        f"| {'yes' if put_ratio >= 0.8 else 'no'} |",
        f"| get 4 KiB, cached handle | {dev * 1e6:.0f} us | host get {host * 1e6:.0f} us "
        f"| {get_ratio:.2f}x | <= 2 | {'yes' if get_ratio <= 2 else 'no'} |",
        "",
        f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; "
        f"{args.reps} repetitions.",
    ])  # fmt: skip
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
