"""Run the benchmarks: every scenario for every system, interleaved, several repetitions.

    python bench/run.py [--quick] [--reps N] [--sizes 4K,1M,1G] [--only tensorbroker,plasma]

Runs in the main virtual environment; each system is driven by a worker process
(bench/worker.py) with the Python its packages need (Plasma and Ray: bench/.venv-peers).
Writes bench/results/results.md, results.json, latency.png and bandwidth.png; worker logs go
to bench/results/raw/. `make bench` sets the environments up and runs this.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import machine, plot, report, targets  # noqa: E402
from harness.config import (  # noqa: E402
    BY_NAME,
    FULL_SIZES,
    PEERS_PYTHON,
    QUICK_SIZES,
    RAW_DIR,
    RESULTS_DIR,
    SYSTEMS,
    Settings,
)
from harness.plan import Cell, Results, cells, format_size, interleaved  # noqa: E402
from harness.progress import Progress  # noqa: E402
from harness.workers import Worker, WorkerFailed  # noqa: E402

UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """4K, 64KiB, 1M, 1GiB, 4096 -> bytes."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    number, unit = (text[:-1], text[-1]) if text and text[-1] in UNITS else (text, "")
    size = int(float(number) * UNITS[unit])
    if size < 4 or size % 4:
        raise argparse.ArgumentTypeError(f"{text!r}: sizes are whole float32 arrays (x4 bytes)")
    return size


def parse_args(argv: list[str] | None) -> tuple[Settings, bool]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    parser.add_argument("--reps", type=int, help="repetitions (default 5, quick 2)")
    parser.add_argument("--sizes", help="comma-separated sizes, e.g. 4K,1M,1G")
    parser.add_argument(
        "--replot", action="store_true", help="only redraw the PNGs from results/results.json"
    )
    parser.add_argument(
        "--only", help="comma-separated systems: " + ",".join(spec.name for spec in SYSTEMS)
    )
    args = parser.parse_args(argv)
    sizes: tuple[int, ...] = QUICK_SIZES if args.quick else FULL_SIZES
    if args.sizes:
        sizes = tuple(sorted({parse_size(s) for s in args.sizes.split(",") if s}))
    systems = tuple(spec.name for spec in SYSTEMS)
    if args.only:
        systems = tuple(s.strip() for s in args.only.split(",") if s.strip())
        unknown = [s for s in systems if s not in BY_NAME]
        if unknown:
            parser.error(f"unknown systems {unknown}; known: {', '.join(BY_NAME)}")
        if "tensorbroker" not in systems:
            systems = ("tensorbroker", *systems)  # every ratio is to tensorbroker
    reps = args.reps or (2 if args.quick else 5)
    if args.quick:
        quick = Settings(
            sizes, reps, budget=0.1, duration=0.3, keys=10000, systems=systems, quick=True
        )
        return quick, args.replot
    return Settings(sizes, reps, systems=systems), args.replot


def replot() -> int:
    """Redraw the figures of the last run from its results.json."""
    with open(os.path.join(RESULTS_DIR, "results.json")) as f:
        saved = json.load(f)
    results = Results.from_json(saved["rows"])
    sizes = ", ".join(format_size(s) for s in saved["settings"]["sizes"])
    cpu = saved["machine"]
    pngs = plot.write(results, RESULTS_DIR, f"{cpu['cpu']}, {cpu['cores']} cores; {sizes}")
    print("wrote " + ", ".join(os.path.relpath(p) for p in pngs), file=sys.stderr)
    return 0


def start_workers(settings: Settings, notes: list[str], workers: list[Worker]) -> None:
    """Start a worker per system (into `workers`, so that an interrupted start still stops
    them all) and wait until each is ready; drop those that fail, with a note."""
    os.makedirs(RAW_DIR, exist_ok=True)
    for name in settings.systems:
        spec = BY_NAME[name]
        if spec.peers_env and not os.path.exists(PEERS_PYTHON):
            notes.append(f"{spec.label}: skipped, {PEERS_PYTHON} is missing (`make bench`)")
            continue
        try:
            workers.append(Worker(spec, os.path.join(RAW_DIR, f"{name}.log")))
        except OSError as exc:
            notes.append(f"{spec.label}: could not start its worker ({exc})")
    for worker in list(workers):
        print(f"starting {worker.spec.label} ...", file=sys.stderr, flush=True)
        try:
            worker.wait_ready()
        except WorkerFailed as exc:
            notes.append(f"{worker.spec.label}: failed to start ({str(exc).splitlines()[-1]})")
            print(f"{exc}\n{worker.log_tail()}", file=sys.stderr)
            worker.stop(timeout=10.0)
            workers.remove(worker)


def measure(settings: Settings, workers: list[Worker], results: Results, notes: list[str]) -> None:
    by_name = {w.name: w for w in workers}
    plan = [cells(settings, rep) for rep in range(settings.reps)]
    total = sum(
        sum(1 for w in workers if cell.scenario in w.scenarios) for rep in plan for cell in rep
    )
    progress = Progress(total)
    dead: set[str] = set()
    try:
        for rep, rep_cells in enumerate(plan):
            for index, cell in enumerate(rep_cells):
                names = [w.name for w in workers if cell.scenario in w.scenarios]
                for name in interleaved(names, rep, index):
                    label = f"rep {rep + 1}/{settings.reps}: {cell.label()}, {BY_NAME[name].label}"
                    progress.show(label)
                    if name not in dead:
                        _measure_one(by_name[name], cell, settings, results, dead, progress)
                    progress.advance(label)
    finally:
        progress.close()
    for name in sorted(dead):
        notes.append(
            f"{BY_NAME[name].label}: the worker failed mid-run: {results.errors[name][-1]}"
        )


def _measure_one(
    worker: Worker,
    cell: Cell,
    settings: Settings,
    results: Results,
    dead: set[str],
    progress: Progress,
) -> None:
    try:
        reply = worker.request(cell.message(settings))
    except WorkerFailed as exc:
        dead.add(worker.name)
        results.errors[worker.name].append(f"{cell.label()}: {exc}")
        progress.message(f"{worker.spec.label} failed: {exc}\n{worker.log_tail(1500)}")
        worker.stop(timeout=10.0)
        return
    if reply.get("ok"):
        results.add(cell, worker.name, reply["metrics"])
        return
    error = str(reply.get("error", "")).strip().splitlines()
    message = f"{cell.label()}: {error[-1] if error else 'unknown error'}"
    if message not in results.errors[worker.name]:
        results.errors[worker.name].append(message)
        progress.message(f"{worker.spec.label}, {message}")


def leftovers(workers: list[Worker]) -> list[str]:
    """Files a run should not leave behind: segments of the brokers it started."""
    found: list[str] = []
    for worker in workers:
        pid = worker.info.get("broker_pid")
        if pid:
            found += glob.glob(f"/dev/shm/tb-{pid}-*")
    return found


def main(argv: list[str] | None = None) -> int:
    settings, only_replot = parse_args(argv)
    if only_replot:
        return replot()
    command = "python bench/run.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    started = time.monotonic()
    notes: list[str] = []
    gpu = machine.gpu_note()
    notes.append(
        f"GPU scenarios: {gpu}"
        if gpu
        else "GPU scenarios: a GPU is present but this harness has no GPU scenarios yet"
    )
    print(notes[-1], file=sys.stderr)
    facts = machine.describe()
    results = Results()
    workers: list[Worker] = []
    interrupted = False
    try:
        start_workers(settings, notes, workers)
        measure(settings, workers, results, notes)
    except KeyboardInterrupt:
        interrupted = True
        notes.append("interrupted (Ctrl-C): partial results")
        print("\ninterrupted: stopping the workers ...", file=sys.stderr)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the cleanup finish
        for worker in workers:
            worker.stop(timeout=10.0 if interrupted else 60.0)
        for path in leftovers(workers):
            notes.append(f"removed a leftover segment: {path}")
            os.unlink(path)
    facts["loadavg_end"] = os.getloadavg()
    infos = {w.name: w.info for w in workers}
    checked = targets.check(results, settings.sizes)
    elapsed = time.monotonic() - started
    md, js = report.write(
        results, checked, settings, facts, infos, notes, RESULTS_DIR, command.strip(), elapsed
    )
    sizes = ", ".join(format_size(s) for s in settings.sizes)
    pngs = plot.write(results, RESULTS_DIR, f"{facts['cpu']}, {facts['cores']} cores; {sizes}")
    with open(md) as f:
        print(f.read())
    print("wrote " + ", ".join(os.path.relpath(p) for p in (md, js, *pngs)), file=sys.stderr)
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
