"""Worker processes of the directory tests (tests/support.py CHILDREN). Each reports
through its queue and exits 0 only if its own checks held."""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np
from support import low_priority

import tensorbroker as tb

MiB = 1 << 20


def replace_many(address: str, times: int, out: Any) -> None:
    """Replace 'plain' and 'bundle' `times` times in all, every element = the version."""
    with tb.connect(address) as c:
        for i in range(times):
            if i % 2:
                version = c.put("bundle", {"a": np.full(64, i, np.float64),
                                           "b": np.full((8, 16), i, np.float64)})  # fmt: skip
            else:
                version = c.put("plain", np.full(256, i, np.float64))
            assert version == i // 2 + 1
        out.put(("writer", times))


def read_uniform(address: str, stop: Any, out: Any) -> None:
    """Get both keys in a tight loop: each tensor uniform, its value the put that made it
    (version v of 'plain' holds 2(v-1), of 'bundle' 2v-1), versions never going back.
    At a low priority: three readers at the writer's would starve it and the broker on 2
    cores (the 20,000 replacements took 9-11 s and 17-21 CPU-s so; 6 s and 12 CPU-s at
    nice 10, each reader still reading about 60,000 times)."""
    low_priority()
    seen = {"plain": 0, "bundle": 0}
    reads = 0
    with tb.connect(address) as c:
        while not stop.is_set():
            for key in seen:
                try:
                    got = c.get(key)
                except tb.NotFound:
                    continue
                tensors = got if isinstance(got, dict) else {"": got}
                version = next(iter(tensors.values())).version
                want = 2 * (version - 1) if key == "plain" else 2 * version - 1
                for t in tensors.values():
                    a = t.numpy()
                    assert a.min() == a.max() == want, (key, version, a.min(), a.max())
                    assert t.version == version
                assert version >= seen[key], (key, version, seen[key])
                seen[key] = version
                reads += 1
    out.put(("reader", reads))


def churn(address: str, seconds: float, out: Any) -> None:
    """Put and delete 1 MiB objects under four keys, each filled with a new value, so that
    the arena's memory is reused all the time."""
    puts = 0
    deadline = time.monotonic() + seconds
    with tb.connect(address) as c:
        while time.monotonic() < deadline:
            key = f"k{puts % 4}"
            try:
                c.put(key, np.full(MiB // 8, puts + 1, np.float64))
            except tb.CapacityError:  # readers hold the rest: let them go first
                time.sleep(0.001)
                continue
            puts += 1
            if puts % 2:
                c.delete(key)
    out.put(("churn", puts))


def hold_and_check(address: str, stop: Any, seed: int, out: Any) -> None:
    """Get churned objects, hold each a random short while, and check at letting go that
    none of its bytes changed: the memory was not reused under the read."""
    rng = random.Random(seed)
    checked = 0
    with tb.connect(address) as c:
        while not stop.is_set():
            try:
                t = c.get(f"k{rng.randrange(4)}")
            except tb.NotFound:
                continue
            assert isinstance(t, tb.Tensor)
            a = t.numpy()
            value = a[0]
            time.sleep(rng.random() * 0.003)
            assert a.min() == a.max() == value, "the object's bytes changed under its reader"
            del a, t
            checked += 1
    out.put(("holder", checked))


def hold_many(address: str, key: str, count: int, out: Any) -> None:
    """Get `key` `count` times, keep every array, and wait to be killed."""
    with tb.connect(address) as c:
        held = [c.get(key).numpy() for _ in range(count)]
        out.put(len(held))
        time.sleep(600)
