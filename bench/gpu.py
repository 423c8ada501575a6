"""GPU benchmark: the two CUDA targets, each as a ratio to a floor measured in the same run.

    put bandwidth of a 1 GiB device tensor / a device-to-device copy of it    (target >= 0.95)
    get latency of a device object (cached handle) / a host object's get      (target <= 2)

A put is timed from the call until its copy has run (the producer's stream synchronised
afterwards: put itself returns at once); the floor is `dst.copy_(src)` on the same stream
with the same synchronisation. Gets are of 4 KiB objects, each taken on torch's current stream
and dropped, median of many. Then the weight-sync scenario (bench/weightsync.py): a 7B-shaped
bf16 state_dict republished to a torch and a JAX process, against torch's CUDA IPC handles.
Needs torch with CUDA, CuPy and JAX; says so and exits 2 otherwise.

    python3 bench/gpu.py [--reps 5] [--weightsync 7b,70b-slice] [--layers 10]
                            [--out bench/results/gpu.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import weightsync  # noqa: E402

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

    def timed_puts() -> float:  # the delete between puts is not part of a put
        times = []
        for _ in range(4):
            start = time.perf_counter()
            put()
            times.append(time.perf_counter() - start)
            c.delete("big")
        return statistics.median(times[1:])

    rows = []
    for rep in range(reps):  # interleaved, so drifts hit both alike
        rows.append((median_time(copy, 3), timed_puts()))
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
    parser.add_argument(
        "--weightsync", default="7b", help="weight-sync model(s), comma-separated: 7b, "
        "70b-slice (bench/weightsync.py); 'none' to skip",
    )  # fmt: skip
    parser.add_argument("--layers", type=int, help="layers of the 70b-slice (default 8)")
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

    # 16 GiB of the GPU: a client may hold an eighth of it in blocks granted ahead (Note
    # [grants]), so the 1 GiB put takes one (a broker serving 4 GiB would grant it none).
    with tb.start_broker(memory="512MiB", cuda_memory="0:16GiB") as b, tb.connect(b.address) as c:
        t_copy, t_put = measure_put(c, args.reps)
        torch.cuda.empty_cache()
        host, dev = measure_get(c, args.reps, args.gets)
    put_ratio, get_ratio = t_copy / t_put, dev / host
    report = "\n".join([
        "| measure | tensorbroker | floor | ratio | target | met |",
        "|---|---|---|---|---|---|",
        f"| put 1 GiB on cuda:0 | {t_put * 1e3:.2f} ms ({GIB / t_put / 1e9:.0f} GB/s) "
        f"| D2D copy {t_copy * 1e3:.2f} ms ({GIB / t_copy / 1e9:.0f} GB/s) "
        f"| {put_ratio:.2f} of the copy's bandwidth | >= 0.95 (issue 36) "
        f"| {'yes' if put_ratio >= 0.95 else 'no'} |",
        f"| get 4 KiB, cached handle | {dev * 1e6:.0f} us | host get {host * 1e6:.0f} us "
        f"| {get_ratio:.2f}x | <= 2 | {'yes' if get_ratio <= 2 else 'no'} |",
        "",
        f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; "
        f"{args.reps} repetitions.",
    ])  # fmt: skip
    print(report, flush=True)
    for model in [m for m in args.weightsync.split(",") if m and m != "none"]:
        rows = weightsync.run(model, args.layers if model != "7b" else None)
        report += "\n\n## Weight sync: " + model + "\n\n" + weightsync.report(rows)
        print(report.rpartition("## Weight sync")[2], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
