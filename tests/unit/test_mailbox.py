"""The mailbox body a producer writes in one C call and its consumer and the broker read
(Note [direct handoff] in common/mailbox.py)."""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterator

import pytest

from tensorbroker.common import _shm
from tensorbroker.common.mailbox import (
    BODY_HEAD,
    CLAIMED,
    FILLED,
    MAILBOX,
    MAILBOX_BODY,
    OPEN,
    body_tail,
    read_body,
    word,
)

QUEUE, TOKEN, LEASE, VERSION, REQUEST, APPLIED = 5, 7, 11, 3, 42, 9
TEMPLATE = [("a", "float32", [4, 2], [2, 1], 0), ("b", "int64", [3], [1], 64)]


@pytest.fixture
def boxes() -> Iterator[int]:
    """Two mailboxes: the producer's (0, where its offer is) and the consumer's (1), open
    for grant TOKEN."""
    mm = mmap.mmap(-1, 2 * MAILBOX)
    anchor = ctypes.c_char.from_buffer(mm)
    addr = ctypes.addressof(anchor)
    _shm.offer_write(addr, QUEUE, TOKEN, 1, LEASE, VERSION, REQUEST, APPLIED, b"consumer-tok")
    _shm.store(addr + MAILBOX, word(TOKEN, OPEN))
    yield addr
    del anchor
    mm.close()


def hand(addr: int, queue: int = QUEUE, last: int = APPLIED, tail: bytes | None = None) -> object:
    tail = body_tail("q", True, "tb-seg", TEMPLATE) if tail is None else tail
    return _shm.hand_over(addr, addr, 2 * MAILBOX, queue, last, 100, 101, 4096, tail)


def test_a_handed_item_reads_back_as_the_reply_the_broker_would_have_sent(boxes: int) -> None:
    consumer = boxes + MAILBOX
    rung = _shm.bell(consumer)
    assert hand(boxes) == (1, TOKEN, "consumer-tok", LEASE, VERSION)
    assert _shm.load(consumer) == word(TOKEN, FILLED)
    assert _shm.bell(consumer) == rung + 1
    tail = body_tail("q", True, "tb-seg", TEMPLATE)
    assert _shm.mailbox_take(consumer, REQUEST) == (LEASE, VERSION, 100, 101, 4096, tail)
    assert _shm.mailbox_take(consumer, REQUEST - 1) is None  # for another get: left there
    state, body = _shm.mailbox_read(consumer)
    assert body is not None and len(body) == BODY_HEAD.size + len(tail)
    assert read_body(body) == {
        "id": REQUEST, "ok": True, "key": "q", "version": VERSION, "bundle": True,
        "lease": LEASE, "oid": 100, "put": 101,
        "tensors": [["a", "float32", [4, 2], [2, 1], "tb-seg", 4096, "cpu"],
                    ["b", "int64", [3], [1], "tb-seg", 4160, "cpu"]],
    }  # fmt: skip


@pytest.mark.parametrize(
    "why",
    ["another queue", "a seal not applied yet", "taken back", "claimed already", "too big",
     "no offer"],
)  # fmt: skip
def test_an_item_is_not_claimed_unless_the_offer_holds_for_it(boxes: int, why: str) -> None:
    consumer = boxes + MAILBOX
    if why == "another queue":
        assert hand(boxes, queue=QUEUE + 1) is None
    elif why == "a seal not applied yet":  # its earlier items must be in the queue first
        assert hand(boxes, last=APPLIED + 1) is None
    elif why == "taken back":
        _shm.store(consumer, word(0, 0))
        assert hand(boxes) is None
    elif why == "claimed already":
        _shm.store(consumer, word(TOKEN, CLAIMED))
        assert hand(boxes) is None
    elif why == "too big":
        assert hand(boxes, tail=b"x" * (MAILBOX_BODY - BODY_HEAD.size + 1)) is None
    else:
        _shm.offer_write(boxes, 0, 0, 0, 0, 0, 0, 0, b"")
        assert hand(boxes) is None
    assert _shm.load(consumer) in (word(TOKEN, OPEN), word(0, 0), word(TOKEN, CLAIMED))
    assert _shm.mailbox_take(consumer, REQUEST) is None


def test_a_body_that_is_not_an_item_is_refused_with_a_value_error() -> None:
    with pytest.raises(ValueError, match="bytes"):
        read_body(b"short")
    with pytest.raises(ValueError):
        read_body(BODY_HEAD.pack(1, 2, 3, 4, 5, 6) + b"\xc1")
