"""Seeded fuzzing of every op (tests/integration/fuzz.py): the broker answers each request
with a success or a plain error, never an internal one, stays small, gives back everything
the fuzzer's process held once it exits, and serves a normal client afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from support import wait_until

import tensorbroker as tb

FUZZER = os.path.join(os.path.dirname(__file__), "fuzz.py")


def _rss_mib(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) >> 10 for line in f if line.startswith(field + ":"))


def fuzz(broker: tb.BrokerProcess, seed: int, frames: int, timeout: float) -> None:
    before = _rss_mib(broker.pid)
    run = subprocess.run(
        [sys.executable, FUZZER, broker.address, str(seed), str(frames)],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout)
    assert summary["odd_count"] == 0, summary["odd"]
    assert summary["replies"] > frames // 2, summary  # most frames were answered
    assert broker.alive, f"the broker died (exit code {broker.returncode})"
    grew = _rss_mib(broker.pid, "VmHWM") - before
    assert grew < 200, f"the broker grew by {grew} MiB under {frames} fuzzed frames"
    with tb.connect(broker.address) as c:
        # the fuzzer's sessions ended with its process: everything they held is back
        assert wait_until(lambda: c.stats()["clients"] == 1, 10), c.stats()
        stats = c.stats()
        assert stats["pending"] == 0 and stats["leases"] == 0, stats
        value = np.arange(1000, dtype=np.float32)
        c.put("after-fuzz", value)
        assert np.array_equal(c.get("after-fuzz").numpy(), value)


def test_fuzzed_requests_of_every_op(fresh_broker: tb.BrokerProcess) -> None:
    fuzz(fresh_broker, seed=1, frames=5_000, timeout=120)


@pytest.mark.slow
def test_a_hundred_thousand_fuzzed_requests(fresh_broker: tb.BrokerProcess) -> None:
    fuzz(fresh_broker, seed=2, frames=100_000, timeout=900)
