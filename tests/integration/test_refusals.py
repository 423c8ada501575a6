"""A put the broker refuses gives its memory back at the refusal: whatever the refusal, once
the client that made it closes, the broker holds nothing for it, while that process lives on
(a long-lived worker must not leak a block per refused put)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest

import tensorbroker as tb
from tensorbroker.common.protocol import MAX_KEY_BYTES
from tests.support import wait_until

pytestmark = pytest.mark.usefixtures("transport")  # lanes and ZeroMQ both

SMALL = np.arange(3, dtype=np.float64)  # a small put: written into a block granted ahead


def _empty_key(c: tb.Client) -> None:
    with pytest.raises(tb.InvalidRequest, match="non-empty string"):
        c.put("", SMALL)


def _key_too_long(c: tb.Client) -> None:
    with pytest.raises(tb.InvalidRequest, match="over the limit"):
        c.put("k" * (MAX_KEY_BYTES + 1), SMALL)


def _refused_after_it_returned(c: tb.Client) -> None:
    assert c.put("", SMALL, wait=False) is None  # the seal is sent; its error comes later
    with pytest.raises(tb.InvalidRequest, match="non-empty string"):
        c.flush()


def _bundle_name_refused(c: tb.Client) -> None:
    with pytest.raises(tb.InvalidRequest):
        c.put("b", {"n" * (MAX_KEY_BYTES + 1): SMALL})


_streams = itertools.count()


def _queue_closed(c: tb.Client) -> None:
    q = c.queue(f"closed-{next(_streams)}", maxsize=4)  # a closed queue's name stays closed
    q.put(SMALL)  # the producer now holds slots credited ahead: its next put asks nothing
    item = q.get(timeout=5.0)
    np.testing.assert_array_equal(item.numpy(), SMALL)
    del item
    q.close()
    with pytest.raises(tb.QueueClosed):
        q.put(SMALL)
    c.flush()


REFUSALS: dict[str, Callable[[tb.Client], None]] = {
    "empty key": _empty_key,
    "key too long": _key_too_long,
    "a put that did not wait": _refused_after_it_returned,
    "bundle name too long": _bundle_name_refused,
    "closed queue": _queue_closed,
}


@pytest.mark.parametrize("refusal", list(REFUSALS))
def test_a_refused_put_gives_its_memory_back(fresh_broker: tb.BrokerProcess, refusal: str) -> None:
    with tb.connect(fresh_broker.address) as watcher:
        for _ in range(20):
            with tb.connect(fresh_broker.address) as c:
                REFUSALS[refusal](c)
            c.close()
        # a closed client's bye goes one way, on its own socket: it may come after the stats
        wait_until(lambda: watcher.stats()["granted_bytes"] == 0, timeout=5.0)
        stats = watcher.stats()
        assert stats["used_bytes"] == 0, f"{refusal}: {stats['used_bytes']} bytes still held"
        assert stats["leases"] == 0 and stats["pending"] == 0, stats
        assert stats["granted_bytes"] == 0, stats  # the closed clients' grants went back
        # and the broker still serves a put of the same size from the same memory
        assert watcher.put("after", SMALL) == 1
        watcher.delete("after")
        assert watcher.stats()["used_bytes"] == 0


def test_a_client_that_goes_on_after_refusals_holds_only_its_stock_of_grants(
    fresh_broker: tb.BrokerProcess,
) -> None:
    """Every block the broker counts as granted to a client that goes on is one the client
    still has to write into: the refused puts' blocks are not among them."""
    with tb.connect(fresh_broker.address) as c:
        c.put("x", SMALL)
        c.delete("x")
        for _ in range(20):
            with pytest.raises(tb.InvalidRequest):
                c.put("", SMALL)
        stats = c.stats()
        assert stats["used_bytes"] == 0 and stats["leases"] == 0, stats
        stock = sum(len(blocks) for blocks in c._transfer.writes.ahead.grants.values())
        assert stats["granted_bytes"] == stock * 4096, (stats["granted_bytes"], stock)
