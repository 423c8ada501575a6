"""Unit tests for the offers of small versions (server/cluster/offers.py, Note [offers]): when an
owner's pin goes, when a peer gives an offer back, and a read from an offer that fails."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tensorbroker.common.protocol import Request
from tensorbroker.server.cluster.offers import GIVE_BACK_EVERY, GIVE_BACK_MAX, OFFER_MAX, Held, Lent
from tensorbroker.server.cluster.replicas import Replicas
from tensorbroker.server.store.arena import Arena
from tensorbroker.server.store.objects import Objects
from tensorbroker.server.store.parking import ParkingLot
from tensorbroker.server.store.records import Session
from tensorbroker.server.store.registry import Registry

MiB = 2**20


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    arena = Arena(16 * MiB, shm_dir=str(tmp_path), chunk_size=4 * MiB)
    arena.free(arena.allocate(1))  # its first chunk made, as a broker's at start (Broker.bind)
    yield Registry(arena)
    arena.close()


def _sealed(registry: Registry, key: str, nbytes: int = 4096, evictable: bool = False) -> Any:
    s = Session("owner" * 4, None)
    put, obj = registry.begin_put(s, key, [("", "uint8", (nbytes,))], False)
    obj.evictable = evictable
    return registry.seal(s, put, keep=False)


# -- the owner's side ------------------------------------------------------------------------------


def test_an_offered_version_stays_until_every_peer_gave_it_back(registry: Registry) -> None:
    lent = Lent(registry)
    v1 = _sealed(registry, "k")
    lent.pin(v1, {"b", "c"})
    _sealed(registry, "k")  # version 2 replaces it: version 1 is held for b and c
    assert not v1.freed and len(lent) == 1
    lent.back("b", "k", 1)
    lent.back("b", "k", 1)  # twice: still c's
    assert not v1.freed
    lent.let_go("c")  # c went down: it will not say
    assert v1.freed and len(lent) == 0


def test_a_version_offered_twice_is_pinned_once(registry: Registry) -> None:
    lent = Lent(registry)
    v1 = _sealed(registry, "k")
    lent.pin(v1, {"b"})
    lent.pin(v1, {"b", "c"})
    registry.delete("k")
    lent.back("b", "k", 1)
    assert not v1.freed
    lent.back("c", "k", 1)
    assert v1.freed


def test_what_no_peer_was_told_of_is_not_pinned(registry: Registry) -> None:
    lent = Lent(registry)
    v1 = _sealed(registry, "k")
    lent.pin(v1, set())
    registry.delete("k")
    assert v1.freed and len(lent) == 0


def test_large_evictable_or_device_versions_are_not_offered(registry: Registry) -> None:
    lent = Lent(registry)
    assert lent.offerable(_sealed(registry, "small", OFFER_MAX))
    assert not lent.offerable(_sealed(registry, "large", OFFER_MAX + 1))
    assert not lent.offerable(_sealed(registry, "cache", 64, evictable=True))


# -- the peer's side -------------------------------------------------------------------------------


def test_an_offer_replaced_is_given_back_at_once_or_once_its_read_is_over() -> None:
    held = Held()
    held.keep("a", "k", 1, {})
    held.keep("a", "k", 2, {})  # version 2 listed: version 1 goes back
    assert held.take_due() == {"a": {"offers": [["k", 1]]}}
    offer = held.of("k", "a", 2)
    assert offer is not None and held.of("k", "a", 1) is None
    offer.reading = True
    held.drop("k")  # deleted there while it is read: the owner must keep it until the read ends
    assert held.due == {}
    held.read("k", offer)
    assert held.due == {"a": [["k", 2]]}


def test_offers_due_are_given_back_together_after_a_while_or_once_many() -> None:
    held = Held()
    assert held.give_back_in(time.monotonic()) == math.inf
    held.keep("a", "k", 1, {})
    held.drop("k")
    now = time.monotonic()
    assert 0 < held.give_back_in(now) <= GIVE_BACK_EVERY
    assert held.give_back_in(now + GIVE_BACK_EVERY) == 0
    for v in range(GIVE_BACK_MAX):
        held.refuse("b", "j", v)
    assert held.give_back_in(now) == 0  # many: at once
    assert len(held.take_due()["b"]["offers"]) == GIVE_BACK_MAX
    assert held.give_back_in(now) == math.inf


def test_the_reads_of_offers_are_said_with_the_offers_given_back() -> None:
    """One message to each owner for both: a small put read by every node must not cost
    its owner one more message from each."""
    held = Held()
    held.keep("a", "k", 1, {})
    held.was_read("a", "k", 1)
    held.was_read("b", "j", 3)  # (from another owner)
    assert 0 < held.give_back_in(time.monotonic()) <= GIVE_BACK_EVERY
    held.keep("a", "k", 2, {})  # version 2 listed: version 1 goes back
    assert held.take_due() == {
        "a": {"offers": [["k", 1]], "read": [["k", 1]]}, "b": {"offers": [], "read": [["j", 3]]},
    }  # fmt: skip
    assert held.give_back_in(time.monotonic()) == math.inf


def test_an_offer_sent_twice_is_kept_once_and_not_given_back() -> None:
    held = Held()
    held.keep("a", "k", 1, {})
    held.keep("a", "k", 1, {"address": 2})
    assert held.due == {} and len(held) == 1


def test_the_offers_of_a_node_that_went_down_are_void_and_not_given_back() -> None:
    held = Held()
    held.keep("a", "k", 1, {})
    held.keep("b", "j", 1, {})
    offer = held.of("k", "a", 1)
    assert offer is not None
    offer.reading = True
    held.forget("a")
    held.read("k", offer)
    assert held.of("k", "a", 1) is None and held.due == {} and len(held) == 1


# -- a read from an offer that fails ---------------------------------------------------------------


class Links:
    def __init__(self, fresh: bool = True) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []
        self._fresh = fresh

    def send(self, node: str, message: dict[str, Any]) -> bool:
        self.sent.append((node, message))
        return True

    def answer(self, node: str, message: dict[str, Any]) -> None:
        self.sent.append((node, message))

    after = send  # (sent at once: these tests have no loop to flush)

    def everyone(self, message: dict[str, Any]) -> None:
        pass

    def everyone_after(self, message: dict[str, Any]) -> None:
        pass

    def up(self, node: str) -> bool:
        return True

    def fresh(self, node: str) -> bool:
        return self._fresh

    seen_forgot: dict[str, int] = {}

    def acked(self, node: str, m: dict[str, Any]) -> bool:
        return True

    def nodes(self) -> list[str]:
        return ["a"]


class FailingTransfers:
    """NIXL knows no memory at the offered address (a segment made after its metadata)."""

    def layout(self, node: str, offer: dict[str, Any]) -> tuple[list[Any], bool, str]:
        specs = [(str(n), str(d), tuple(s)) for n, d, s in offer["specs"]]
        return specs, bool(offer["bundle"]), "cpu"

    def take(self, node: str, offer: dict[str, Any], obj: Any, lent: bool = False) -> Any:
        raise OSError("NIXL could not start a read: nixlNotFoundError")


def _got_offered(registry: Registry, transfers: Any, links: Links) -> Replicas:
    """Node b, offered key k by node a, and a get of k on b."""
    lot = ParkingLot()
    objects = Objects(registry, lot, lambda route, payload, last=False: None)
    replicas = Replicas("b", objects, lot, transfers, links)
    offer = {"specs": [["", "uint8", [4096]]], "bundle": False, "size": 4096, "address": 1}
    replicas.listed("a", "k", 1, 4096, offer)
    get = Request("get", 7, {"key": "k", "timeout": 5.0}, [])
    assert replicas.get(Session("reader" * 4, None), b"route", get)
    return replicas


def _lent_asked(links: Links, pull: int) -> bool:
    """Whether `a` was asked to lend `k` for `pull` (its first lend)."""
    lend = {"op": "lend", "pull": pull, "key": "k", "ask": 1}
    return any(n == "a" and {f: m.get(f) for f in lend} == lend for n, m in links.sent)


def test_a_read_from_an_offer_that_fails_asks_its_owner_to_lend_it(registry: Registry) -> None:
    links = Links()
    replicas = _got_offered(registry, FailingTransfers(), links)
    replicas.flush()
    (pull,) = replicas.pulls.pulls.values()  # the get still waits, for the loan now
    assert _lent_asked(links, pull.id)
    time.sleep(GIVE_BACK_EVERY)
    replicas.flush()
    assert ("a", {"op": "offers_back", "offers": [["k", 1]]}) in links.sent
    assert len(replicas.held) == 0  # and the block it began for the read is given back:
    assert registry.arena.used_bytes == 0 and "k" not in registry.objects


class Reading(FailingTransfers):
    def take(self, node: str, offer: dict[str, Any], obj: Any, lent: bool = False) -> Any:
        return "read", int(offer["size"])


@pytest.mark.parametrize("fresh", [True, False])
def test_an_offer_is_read_only_while_its_owner_surely_holds_this_node_up(
    registry: Registry, fresh: bool
) -> None:
    """A broker whose loop stalled past the time its peers take it for down must not read
    what they offered it before (they let it go): it asks them to lend it instead."""
    links = Links(fresh)
    replicas = _got_offered(registry, Reading(), links)
    (pull,) = replicas.pulls.pulls.values()
    assert (pull.handle is not None) == fresh  # read at once from the offer, or not
    assert _lent_asked(links, pull.id) == (not fresh)
    assert len(replicas.held) == (1 if fresh else 0)  # (given back, if not read)


def test_a_get_whose_read_from_an_offer_cannot_begin_is_answered(registry: Registry) -> None:
    """No room here for the replica: the get is told so at once (it waited for good)."""
    s = Session("filler" * 4, None)
    while registry.arena.used_bytes + MiB <= 16 * MiB:  # (the arena: 16 MiB)
        put, _ = registry.begin_put(
            s, f"fill{registry.arena.used_bytes}", [("", "uint8", (MiB,))], False
        )
        registry.seal(s, put, keep=False)
    answers: list[bytes] = []
    lot = ParkingLot()
    objects = Objects(registry, lot, lambda route, payload, last=False: answers.append(payload))
    replicas = Replicas("b", objects, lot, Reading(), Links())  # type: ignore[arg-type]
    offer = {"specs": [["", "uint8", [2 * MiB]]], "bundle": False, "size": 2 * MiB, "address": 1}
    replicas.listed("a", "k", 1, 2 * MiB, offer)
    get = Request("get", 7, {"key": "k", "timeout": None}, [])
    assert replicas.get(Session("reader" * 4, None), b"route", get)
    assert len(answers) == 1 and b"capacity" in answers[0]
    assert not lot.line(("get", "k")) and not replicas.pulls.pulls


# -- prefetch: a small version offered is read as it is listed (Note [prefetch]) ------------------


def _listed(registry: Registry, prefetch: int, size: int = 4096, offered: bool = True) -> Replicas:
    """Node b, told by node a of version 1 of key k (`size` bytes, with its offer or not)."""
    lot = ParkingLot()
    objects = Objects(registry, lot, lambda route, payload, last=False: None)
    replicas = Replicas("b", objects, lot, Reading(), Links(), prefetch)  # type: ignore[arg-type]
    offer = {"specs": [["", "uint8", [size]]], "bundle": False, "size": size, "address": 1}
    replicas.listed("a", "k", 1, size, offer if offered else None)
    return replicas


def test_a_small_version_offered_is_read_as_it_is_listed(registry: Registry) -> None:
    replicas = _listed(registry, prefetch=OFFER_MAX)
    (pull,) = replicas.pulls.pulls.values()  # no get asked: read at once, from its offer
    assert pull.handle is not None and pull.waiters == [] and replicas.prefetched == 1
    replicas.listed("a", "k", 1, 4096)  # told again (a welcome, say): the same pull
    assert len(replicas.pulls.pulls) == 1 and replicas.prefetched == 1


@pytest.mark.parametrize(
    ("prefetch", "size", "offered"),
    [(0, 4096, True), (4096, 4097, True), (OFFER_MAX, 4096, False)],
    ids=["prefetch-off", "over-the-bound", "not-offered"],
)
def test_a_version_is_not_read_until_a_get_asks_for_it(
    registry: Registry, prefetch: int, size: int, offered: bool
) -> None:
    replicas = _listed(registry, prefetch, size, offered)
    assert not replicas.pulls.pulls and replicas.prefetched == 0
    get = Request("get", 7, {"key": "k", "timeout": 5.0}, [])
    assert replicas.get(Session("reader" * 4, None), b"route", get)
    assert len(replicas.pulls.pulls) == 1  # the get pulls it


def test_a_prefetch_leaves_a_quarter_of_this_nodes_memory_free(registry: Registry) -> None:
    s = Session("filler" * 4, None)
    while registry.arena.free_bytes - MiB >= 4 * MiB:  # (16 MiB: 4 MiB is a quarter)
        put, _ = registry.begin_put(
            s, f"f{registry.arena.used_bytes}", [("", "uint8", (MiB,))], False
        )
        registry.seal(s, put, keep=False)
    used = registry.arena.used_bytes
    replicas = _listed(registry, prefetch=OFFER_MAX)  # 4 MiB + 4 KiB would be needed free
    assert not replicas.pulls.pulls and registry.arena.used_bytes == used
