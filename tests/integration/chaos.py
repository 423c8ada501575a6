"""Workers of the recovery tests (children of tests/support.py's fork server): clients that
keep working while their broker is killed and restarted under them, and check everything
they were told.

Each logs what it relies on and reports one dict through `out`: the errors it saw that are
not documented (must stay empty), and what it put, took and verified.
"""

from __future__ import annotations

import random
import time
import zlib
from typing import Any

import numpy as np

import tensorbroker as tb
from tests.support import low_priority

KEYS = 6  # per worker
DOCUMENTED = (tb.BrokerUnavailable, tb.Timeout, tb.NotFound)


def _payload(rng: random.Random, tag: int) -> np.ndarray[Any, Any]:
    n = rng.choice([16, 1000, 30_000, 200_000])
    data = np.frombuffer(rng.randbytes(n), np.uint8).copy()
    data[:8] = np.frombuffer(tag.to_bytes(8, "little"), np.uint8)
    return data


def crc(a: Any) -> int:
    return zlib.crc32(np.ascontiguousarray(np.asarray(a)).view(np.uint8))


def keyed(address: str, worker: int, stop: Any, out: Any) -> None:
    """Put, replace, delete and read its own keys; after every step, each key it put and
    did not delete must be there at the version the put returned, byte-identical."""
    low_priority()
    rng = random.Random(worker)
    expected: dict[str, tuple[int, int]] = {}  # key -> (version, crc) as the put returned
    unknown: set[str] = set()  # a call raised: the next put tells again
    errors: list[str] = []
    puts = verified = 0
    with tb.connect(address, reconnect_timeout=60) as c:
        while not stop.is_set() and len(errors) < 5:
            key = f"w{worker}-{rng.randrange(KEYS)}"
            try:
                if rng.random() < 0.15 and key in expected:
                    c.delete(key)
                    expected.pop(key)
                else:
                    value = _payload(rng, puts)
                    expected[key] = (c.put(key, value), crc(value))
                    unknown.discard(key)
                    puts += 1
                for k, (version, check) in expected.items():
                    if k in unknown:
                        continue
                    got = c.get(k)
                    if (got.version, crc(got.numpy())) != (version, check):
                        errors.append(f"{k}: v{got.version} crc {crc(got.numpy())}, "
                                      f"expected v{version} crc {check}")  # fmt: skip
                    verified += 1
            except DOCUMENTED as exc:
                if "restarted" not in str(exc) and not isinstance(exc, tb.NotFound):
                    errors.append(f"{type(exc).__name__}: {exc}")
                unknown.add(key)  # a delete that may or may not have been done
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
        for k in expected:  # the test deletes them at the end
            unknown.discard(k)
    out.put({"worker": worker, "errors": errors, "puts": puts, "verified": verified})


def produce(address: str, worker: int, stop: Any, out: Any) -> None:
    """Put numbered items into the queue; logs the numbers whose put returned."""
    with tb.connect(address, reconnect_timeout=60) as c:
        sent, errors = _put_numbered(c.queue("chaos", maxsize=16), worker * 1_000_000, stop)
    out.put({"worker": worker, "errors": errors, "sent": sent})


def cast(address: str, stop: Any, out: Any) -> None:
    """The same into the broadcast queue "cast", then close it."""
    with tb.connect(address, reconnect_timeout=60) as c:
        q = c.broadcast("cast", maxsize=8)
        sent, errors = _put_numbered(q, 0, stop)
        q.close()
    out.put({"worker": "cast", "errors": errors, "sent": sent})


def consume(address: str, worker: int, out: Any) -> None:
    """Take items until the queue is closed and drained; logs the numbers taken."""
    with tb.connect(address, reconnect_timeout=60) as c:
        taken, errors = _take_all(c.queue("chaos").get)
    out.put({"worker": worker, "errors": errors, "taken": taken})


def subscribe(address: str, worker: int, ready: Any, out: Any) -> None:
    """The same from a subscription of the broadcast queue "cast"."""
    with tb.connect(address, reconnect_timeout=60) as c:
        c.broadcast("cast", maxsize=8)
        sub = c.subscribe("cast")
        ready.set()
        taken, errors = _take_all(sub.get)
    out.put({"worker": worker, "errors": errors, "taken": taken})


def _put_numbered(q: Any, first: int, stop: Any) -> tuple[list[int], list[str]]:
    """Put items numbered from `first` until `stop`: the numbers whose put returned, and
    the errors that are not documented."""
    low_priority()
    errors: list[str] = []
    sent: list[int] = []
    n = first
    while not stop.is_set() and len(errors) < 5:
        try:
            q.put(np.array([n, n * 7 % 1013], dtype=np.int64), timeout=5)
            sent.append(n)
        except tb.Timeout:
            pass  # the consumers are slow, or the broker was down for a while
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        n += 1
    return sent, errors


def _take_all(get: Any) -> tuple[list[int], list[str]]:
    """Take items with `get` until their queue is closed and drained: the numbers taken,
    and the errors seen (an item that came back wrong is one)."""
    errors: list[str] = []
    taken: list[int] = []
    while len(errors) < 5:
        try:
            item = get(timeout=5)
        except tb.QueueClosed as exc:
            if "subscription" in str(exc):  # ended under it, before the stream did
                errors.append(f"QueueClosed: {exc}")
            break
        except tb.Timeout:
            continue
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        n, check = item.numpy().tolist()
        if check != n * 7 % 1013:
            errors.append(f"item {n} came back as {check}")
        taken.append(n)
        del item
    return taken, errors


def hold_through(address: str, ready: Any, go: Any, out: Any) -> None:
    """Hold arrays (one read from the directory, one the broker leased) while the broker is
    killed and others fill its memory; they must keep their values."""
    with tb.connect(address, reconnect_timeout=60) as c:
        direct = c.get("a").numpy()
        leased = next(iter(c.watch("b")))  # a watch asks the broker: a broker lease
        c.delete("a")
        c.put("b", np.zeros(1, np.uint8))  # both retired: only our leases keep them
        ready.set()
        go.wait(60)
        same = bool((direct == 1).all() and (leased.numpy() == 2).all())
        out.put({"same": same, "leases": c.stats()["leases"]})
        del direct, leased
        time.sleep(0.2)  # the releases go out
        out.put({"same": same})


def create_and_wait(address: str, size: int, ready: Any, go: Any, out: Any) -> None:
    """Write an object in place, and seal it only after `go` (the broker was killed and
    restarted meanwhile); then read it back."""
    with tb.connect(address, reconnect_timeout=60) as c:
        with c.create("big", (size,), "uint8") as buf:
            view = buf.numpy()
            view[: size // 2] = 3
            ready.set()
            go.wait(60)
            view[size // 2 :] = 3
            del view
        got = c.get("big")
        out.put({"version": buf.version, "ok": bool((got.numpy() == 3).all())})
        del got, buf
