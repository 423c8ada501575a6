"""Soak: many cycles through one broker leave nothing behind (`make test-all` runs these)."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
from support import CHILDREN

import tensorbroker as tb


def churn(address: str, worker: int, rounds: int, done: Any) -> None:
    rng = np.random.default_rng(worker)
    with tb.connect(address) as c:
        for i in range(rounds):
            size = int(rng.integers(1, 256 * 1024))
            key = f"soak/{worker}/{i % 7}"
            c.put(key, np.full(size, i % 251, np.uint8))
            t = c.get(key)
            if int(t.numpy()[size - 1]) != i % 251:
                raise AssertionError(f"{key}: read back the wrong bytes")
            del t
            if i % 3 == 0:
                c.delete(key)
        done.put(worker)


@pytest.mark.slow
def test_four_processes_churning_leave_no_memory_or_lease_behind() -> None:
    with tb.start_broker(memory="64MiB") as broker:
        done = CHILDREN.Queue()
        procs = [
            CHILDREN.Process(target=churn, args=(broker.address, w, 3000, done)) for w in range(4)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        assert [p.exitcode for p in procs] == [0] * 4
        with tb.connect(broker.address) as c:
            for key in c.keys():
                c.delete(key)
            gc.collect()
            stats = c.stats()
            assert stats["used_bytes"] == 0 and stats["leases"] == 0 and stats["pending"] == 0
            assert stats["clients"] == 1
            assert stats["segments"] == 1  # fragmentation never forced a second chunk
