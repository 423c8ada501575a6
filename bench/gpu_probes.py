"""Probes of what the CUDA path assumes about interprocess events, on a real GPU.

Each probe runs real processes on cuda:0 and prints what it saw; the findings are written
into the notes of common/cudart.py, server/store/devices.py and client/cuda.py. They settle:

  1. early:  does cudaEventQuery in another process (the broker) see an event that a client
             recorded just now, behind a long kernel, as not ready (never as done early)?
  2. died:   what does cudaEventQuery answer for an event whose recorder was killed with
             the recorded work still queued? Can the event be recorded again afterwards?
  3. sealed: a producer killed after its seal, its copy still queued behind a long kernel:
             what does a reader of the object see, and does it hang?
  4. device: does a process that only uses cuda:1 make a context on cuda:0? (needs 2 GPUs)

    python3 bench/gpu_probes.py
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from typing import Any

SPAWN = mp.get_context("spawn")
CYCLES_PER_S = 2_000_000_000  # GPU clock cycles: about a second on an H100 (1.98 GHz)
N = 1 << 20
FLAGS = 0x2 | 0x4  # cudaEventDisableTiming | cudaEventInterprocess


def _rt() -> Any:
    from cupy.cuda import runtime

    return runtime


def _query(event: int) -> str:
    """'done', 'not ready', or the error."""
    try:
        status = int(_rt().eventQuery(event))
    except Exception as exc:  # CUDARuntimeError
        return f"error: {exc}"
    return {0: "done", 600: "not ready"}.get(status, f"status {status}")


def _record_behind_sleep(handle: bytes, seconds: float, reps: int, out: Any, go: Any) -> None:
    """Open the event, and `reps` times: a kernel of `seconds`, then record the event behind
    it on the same stream; say so at once (no synchronisation)."""
    import torch

    rt = _rt()
    torch.zeros(1, device="cuda:0")
    event = rt.ipcOpenEventHandle(handle)
    stream = torch.cuda.current_stream().cuda_stream
    for _ in range(reps):
        go.wait(60)
        go.clear()
        torch.cuda._sleep(int(seconds * CYCLES_PER_S))
        rt.eventRecord(event, stream)
        out.put(time.monotonic())
    time.sleep(600)  # killed by the parent, its recorded work possibly still queued


def probe_early() -> None:
    rt = _rt()
    event = rt.eventCreateWithFlags(FLAGS)
    handle = bytes(rt.ipcGetEventHandle(event))
    reps, seconds = 20, 0.05
    out, go = SPAWN.Queue(), SPAWN.Event()
    child = SPAWN.Process(target=_record_behind_sleep, args=(handle, seconds, reps, out, go))
    child.start()
    early, waits = 0, []
    for _ in range(reps):
        go.set()
        recorded = out.get(timeout=120)
        first = _query(event)
        early += first == "done"
        while _query(event) != "done":
            time.sleep(0.0002)
        waits.append(time.monotonic() - recorded)
    child.kill()
    child.join()
    print(f"1. early: {reps} records behind a {seconds * 1e3:.0f} ms kernel; the broker's first "
          f"query right after the record returned said 'done' {early} times; done after "
          f"{min(waits) * 1e3:.1f} to {max(waits) * 1e3:.1f} ms", flush=True)  # fmt: skip


def probe_died() -> None:
    rt = _rt()
    event = rt.eventCreateWithFlags(FLAGS)
    handle = bytes(rt.ipcGetEventHandle(event))
    out, go = SPAWN.Queue(), SPAWN.Event()
    child = SPAWN.Process(target=_record_behind_sleep, args=(handle, 3.0, 1, out, go))
    child.start()
    go.set()
    recorded = out.get(timeout=120)
    before, into = _query(event), time.monotonic() - recorded
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    killed = time.monotonic()
    seen: list[tuple[float, str]] = []
    while time.monotonic() - killed < 6.0:
        answer = _query(event)
        if not seen or seen[-1][1] != answer:
            seen.append((time.monotonic() - killed, answer))
        time.sleep(0.001)
    # Can the event be used again, by a new recorder?
    out2, go2 = SPAWN.Queue(), SPAWN.Event()
    again = SPAWN.Process(target=_record_behind_sleep, args=(handle, 0.5, 1, out2, go2))
    again.start()
    go2.set()
    recorded_again = out2.get(timeout=120)
    after_record = _query(event)
    while _query(event) != "done" and time.monotonic() - recorded_again < 5.0:
        time.sleep(0.001)
    later = f"{_query(event)} {time.monotonic() - recorded_again:.2f}s after it"
    again.kill()
    again.join()
    changes = ", ".join(f"{t:.3f}s: {a}" for t, a in seen)
    print(f"2. died: query before the kill ({into:.3f}s into a 3 s kernel): {before}; after "
          f"SIGKILL: {changes}; a new recorder's record behind a 0.5 s kernel: {after_record} "
          f"at once, {later}", flush=True)  # fmt: skip


def _sealing_producer(address: str, out: Any) -> None:
    import torch

    import tensorbroker as tb

    x = torch.full((N,), 7.0, device="cuda:0")
    with tb.connect(address) as c:
        c.put("warm", x)  # CuPy, the chunk and the events opened
        c.delete("warm")
        torch.cuda.synchronize()
        torch.cuda._sleep(3 * CYCLES_PER_S)  # the copy of the next put queues behind this
        version = c.put("k", x)
        out.put(version)
        time.sleep(600)


def _late_reader(address: str, out: Any) -> None:
    import tensorbroker as tb

    with tb.connect(address) as c:
        t = c.get("k", timeout=10)
        start = time.monotonic()
        total = float(t.torch().sum().item())
        out.put({"sum": total, "seconds": time.monotonic() - start})


def probe_sealed() -> None:
    import tensorbroker as tb

    with tb.start_broker(memory="64MiB", cuda_memory="0:64MiB") as b, tb.connect(b.address) as c:
        out = SPAWN.Queue()
        producer = SPAWN.Process(target=_sealing_producer, args=(b.address, out))
        producer.start()
        version = out.get(timeout=120)
        os.kill(producer.pid, signal.SIGKILL)
        producer.join()
        rout = SPAWN.Queue()
        reader = SPAWN.Process(target=_late_reader, args=(b.address, rout))
        reader.start()
        try:
            got = rout.get(timeout=30)
            seen = f"sum {got['sum']:.0f} (the producer's {7 * N}) after {got['seconds']:.3f}s"
        except Exception:
            seen = "no answer within 30 s: the read hangs"
        reader.kill()
        reader.join()
        if reader.exitcode == 1:  # its get raised: the broker had removed the object
            seen = "no object: the broker removed it when the producer died"
        if c.exists("k"):
            c.delete("k")
        time.sleep(0.5)
        used = c.stats()["devices"]["cuda:0"]["used_bytes"]
        print(
            f"3. sealed: put returned v{version}, producer SIGKILLed with its copy queued; "
            f"a reader saw {seen}; after delete, device used_bytes={used}",
            flush=True,
        )


def _only_cuda1(out: Any) -> None:
    import torch

    import tensorbroker as tb

    address = out.get()
    with tb.connect(address) as c:
        c.put("one", torch.ones(N, device="cuda:1"))
        float(c.get("one").torch().sum().item())
        out.put("done")
        time.sleep(600)


def probe_device() -> None:
    count = _rt().getDeviceCount()
    if count < 2:
        print(f"4. device: this machine has {count} GPU: a context on cuda:0 made by a process "
              "that only uses cuda:1 cannot be observed here", flush=True)  # fmt: skip
        return
    import tensorbroker as tb

    with tb.start_broker(memory="64MiB", cuda_memory="1:64MiB") as b:
        q = SPAWN.Queue()
        child = SPAWN.Process(target=_only_cuda1, args=(q,))
        child.start()
        q.put(b.address)
        time.sleep(0.5)
        q.get(timeout=120)
        apps = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv"],
            capture_output=True, text=True,
        ).stdout  # fmt: skip
        child.kill()
        child.join()
    mine = [line for line in apps.splitlines() if line.startswith(f"{child.pid},")]
    print(f"4. device: a process using only cuda:1 has contexts: {mine}", flush=True)


def main() -> int:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    for probe in (probe_early, probe_died, probe_sealed, probe_device):
        try:
            probe()
        except Exception as exc:  # one failed probe does not hide the others
            print(f"{probe.__name__} failed: {type(exc).__name__}: {exc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
