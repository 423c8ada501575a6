"""The broker's own memory per key (issue 31): many small objects cost it little each, in its
private memory and in the directory it maps. (It never maps the objects' blocks: their bytes
are not in its resident memory.)"""

from __future__ import annotations

import numpy as np

import tensorbroker as tb

KEYS = 20_000
PER_KEY = 3 << 10  # bytes of resident memory per key: about 1.4 KiB; 6.4 KiB before issue 31


def _resident(pid: int) -> int:
    """Private and shared resident bytes of `pid` (RssAnon + RssFile + RssShmem)."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return sum(int(fields[name].split()[0]) * 1024 for name in ("RssAnon", "RssFile", "RssShmem"))


def test_many_small_keys_cost_the_broker_little_memory_each() -> None:
    with tb.start_broker(memory="256MiB") as broker, tb.connect(broker.address) as c:
        one = np.ones(1, np.float32)
        c.put("warm", one)  # its first grants, segment and directory
        before = _resident(broker.pid)
        for i in range(KEYS):
            c.put(f"key-{i}", one, wait=False)
        c.flush()
        grown = (_resident(broker.pid) - before) / KEYS
        assert grown < PER_KEY, f"the broker grew by {grown:.0f} bytes per small key"
        assert c.stats()["objects"] == KEYS + 1
        assert c.get(f"key-{KEYS - 1}").numpy()[0] == 1.0


def test_puts_that_need_new_segments_are_granted_once_they_are_made() -> None:
    """Made on a thread while the loop serves the others (Note [growing] in
    server/store/arena.py): the loop takes it in and grants the put that waited for it."""
    big = 150 << 20  # two of them: more than the first chunk (256 MiB), made at start
    with tb.start_broker(memory="512MiB") as broker, tb.connect(broker.address) as c:
        assert c.stats()["segments"] == 1
        c.put("first", np.full(big, 1, np.uint8))
        held = c.get("first")  # (the next put cannot reuse its block)
        c.put("second", np.full(big, 2, np.uint8))
        c.put("small", np.ones(16, np.uint8))  # (its grants ahead, topped up meanwhile)
        assert c.stats()["segments"] == 2
        assert int(held.numpy()[-1]) == 1 and int(c.get("second").numpy()[-1]) == 2
        del held
