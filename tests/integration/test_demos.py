"""`make cluster-demo` as a user runs it (smaller): etcd, three brokers on temporary addresses
of its own, a trainer and two readers. Slow (`make test-all`): about 10 s on 2 cores."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nixl_cu12", reason="the cluster needs NIXL: make test installs nixl-cu12")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_cluster_demo_syncs_whole_versions_to_every_reader() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "demo" / "cluster.py"), "--steps", "3", "--mib", "8"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "cluster demo: OK" in run.stdout
    assert run.stdout.count("each whole: yes; ended on the last: yes") == 2, run.stdout
