"""What the numbers were measured on."""

from __future__ import annotations

import os
import platform
import sys
from typing import Any


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _version(module: str) -> str:
    try:
        imported = __import__(module)
        return str(getattr(imported, "__version__", "?"))
    except Exception as exc:  # a missing or broken package is a fact for the report
        return f"unavailable ({type(exc).__name__})"


def gpu_note() -> str | None:
    """None when a CUDA GPU is usable here, else why the GPU scenarios are skipped."""
    try:
        import torch

        if torch.cuda.is_available():
            return None
    except Exception:
        pass
    return "skipped: no GPU"


def describe() -> dict[str, Any]:
    shm = os.statvfs("/dev/shm")
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "ram_bytes": _mem_total(),
        "dev_shm_bytes": shm.f_blocks * shm.f_frsize,
        "kernel": f"{platform.system()} {platform.release()}",
        "python": sys.version.split()[0],
        "numpy": _version("numpy"),
        "torch": _version("torch"),
        "pyzmq": _version("zmq"),
        "tensorbroker": _version("tensorbroker"),
        "loadavg_start": os.getloadavg(),
    }
