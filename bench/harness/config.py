"""What a run measures: systems, the environment each runs in, sizes, settings."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_DIR = os.path.dirname(BENCH_DIR)
RESULTS_DIR = os.path.join(BENCH_DIR, "results")
RAW_DIR = os.path.join(RESULTS_DIR, "raw")
WORKER = os.path.join(BENCH_DIR, "worker.py")
PEERS_PYTHON = os.path.join(BENCH_DIR, ".venv-peers", "bin", "python")

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
FULL_SIZES = (4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 256 * MiB, 1 * GiB)
QUICK_SIZES = (4 * KiB, 1 * MiB, 64 * MiB)
CLIENTS = (1, 2, 4)


@dataclass(frozen=True)
class SystemSpec:
    name: str
    label: str  # column heading
    peers_env: bool  # runs in bench/.venv-peers (numpy<2) instead of the main venv
    floor: bool = False  # a reference, not a competitor

    @property
    def python(self) -> str:
        return PEERS_PYTHON if self.peers_env else sys.executable


SYSTEMS = (
    SystemSpec("tensorbroker", "tensorbroker", peers_env=False),
    SystemSpec("plasma", "Plasma", peers_env=True),
    SystemSpec("ray", "Ray", peers_env=True),
    SystemSpec("torch_queue", "torch.mp.Queue", peers_env=False),
    SystemSpec("mp_queue", "mp.Queue", peers_env=False),
    SystemSpec("zmq_pickle5", "ZMQ+pickle5", peers_env=False),
    SystemSpec("zmq_floor", "ZMQ msgpack (floor)", peers_env=False, floor=True),
    SystemSpec("copyto_floor", "np.copyto (floor)", peers_env=False, floor=True),
)
BY_NAME = {spec.name: spec for spec in SYSTEMS}
BASELINE = "tensorbroker"


@dataclass(frozen=True)
class Settings:
    sizes: tuple[int, ...] = FULL_SIZES
    reps: int = 5
    budget: float = 0.2  # seconds of timed iterations per latency measurement
    duration: float = 0.5  # seconds per throughput window
    clients: tuple[int, ...] = CLIENTS
    count: int = 1000  # objects stored for the memory figures
    keys: int = 20000  # 4-byte objects under keys of their own, for the memory per key
    systems: tuple[str, ...] = field(default=tuple(spec.name for spec in SYSTEMS))
    quick: bool = False
