"""Small versions lent with their announcement, so that a first get on another node reads the
bytes at once instead of asking for them first (Note [offers]).

Note [offers]

A first get of another node's key used to cross between brokers three times before its read:
`lend`, then `lent` with the bytes' address, then the read. For a small version that is the
whole cost (a 4 KiB one: 685 us against a 54 us round trip). So the owner of a version of at
most OFFER_MAX bytes, not evictable and in host memory, pins it as it announces it, and the
`key` message carries its offer (layout and address, as a `lent` does): a peer's first get
READs it at once. Only the peers that follow the key get it (Note [follows]): one that was
offered a version and never told of the next would keep the offer, and its owner the
version, for good, and its first get would read that old version.

    owner A: put k v2 sealed ─ key(k, v2, offer) ──> B, C: each keeps the offer (`Held`)
             pins v2 for {B, C} (`Lent`)              B, C: READ at once (Note [prefetch] in
                                                      replicas.py; else at the first get), seal
             unpins v1 once B and C gave it back <─── offers_back([k, v1], ...; read [k, v2])
             counts v2's bytes as sent                (gathered for GIVE_BACK_EVERY, 10 ms)

Each peer keeps the offer of the version its index names until another version of the key,
or its delete, is listed there; then it gives it back, at once or, if a read of it is under
way, once the read is over. A peer that goes down or restarts gives nothing back: the owner
lets its offers go (and the peer drops those it held from an owner that went down or
restarted: a restarted broker's addresses are new). So a pin holds only a version no longer
current (a current one's memory is held anyway), for about one trip and GIVE_BACK_EVERY
after its successor is announced. An evictable version is not offered: the pin would keep it
from being evicted. A peer reads an offer only while the owner surely holds it up (`fresh`),
and keeps one only if it was made for its own incarnation knowing every time it forgot the
owner (`acked`, links.py): else the owner lets it go, or has.

Every node reads an offered version from its owner: below OFFER_MAX the fan-out of
replicas.py does not apply (64 KiB to a hundred nodes is 6.4 MB from the owner).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..store.records import StoredObject
from ..store.registry import Registry

OFFER_MAX = 64 * 1024  # versions of at most this many bytes are offered with their announcement
# Offers given back are gathered this long, or to GIVE_BACK_MAX of them, into one message: one
# each would double a cluster's messages per small put (500 puts of 4 KiB to the keys of a
# 3-node cluster took 0.50-0.62 s with one each, 0.27-0.30 gathered). A replaced version is
# held that much longer.
GIVE_BACK_EVERY = 0.01
GIVE_BACK_MAX = 1024


@dataclass(slots=True)
class Offer:
    """A version of `node`'s, offered to this node: where its bytes are (`fields`, those of a
    `lent`), and whether a read of it is under way (`reading`) or it was dropped meanwhile."""

    node: str
    version: int
    fields: dict[str, Any]
    reading: bool = False
    dropped: bool = False


class Lent:
    """The versions of this node's keys offered to its peers: pinned until each gives it back."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._out: dict[tuple[str, int], tuple[StoredObject, set[str]]] = {}

    def offerable(self, obj: StoredObject) -> bool:
        return obj.device == "cpu" and not obj.evictable and obj.nbytes <= OFFER_MAX

    def pin(self, obj: StoredObject, nodes: set[str]) -> None:
        """`obj` was offered to `nodes` (those its announcement reached): held for them."""
        out = self._out.get((obj.key, obj.version))
        if out is not None:  # offered again (announced twice): the one pin holds for all
            out[1].update(nodes)
        elif nodes:
            self.registry.pin(obj)
            self._out[obj.key, obj.version] = (obj, set(nodes))

    def size(self, node: str, key: str, version: int) -> int:
        """The bytes of the version of `key` offered to `node` (0 if it was not)."""
        out = self._out.get((key, version))
        return int(out[0].nbytes) if out is not None and node in out[1] else 0

    def back(self, node: str, key: str, version: int) -> None:
        """`node` gave back its offer of `key` at `version`."""
        out = self._out.get((key, version))
        if out is not None and node in out[1]:
            self._let_go(key, version, node)

    def let_go(self, node: str) -> None:
        """`node` went down or restarted: what it was offered is its no longer."""
        for key, version in [k for k, (_, nodes) in self._out.items() if node in nodes]:
            self._let_go(key, version, node)

    def _let_go(self, key: str, version: int, node: str) -> None:
        obj, nodes = self._out[key, version]
        nodes.discard(node)
        if not nodes:
            del self._out[key, version]
            self.registry.unpin(obj)

    def __len__(self) -> int:
        return len(self._out)


class Held:
    """The offers this node holds, by key; those to give back (`due`, by owner) and those read
    (`reads`: the owner counts their bytes as sent), said together (`take_due`)."""

    def __init__(self) -> None:
        self.offers: dict[str, Offer] = {}
        self.due: dict[str, list[list[Any]]] = {}  # node -> [[key, version], ...]
        self.reads: dict[str, list[list[Any]]] = {}  # node -> [[key, version], ...]
        self._count, self._since = 0, 0.0  # offers due and reads, and since when

    def give_back_in(self, now: float) -> float:
        """Seconds until the offers due are to be given back (inf: none is)."""
        if not self._count:
            return float("inf")
        if self._count >= GIVE_BACK_MAX:
            return 0.0
        return max(0.0, self._since + GIVE_BACK_EVERY - now)

    def take_due(self) -> dict[str, dict[str, list[list[Any]]]]:
        """What to say to each owner now: {node: {"offers": given back, "read": ...}} (one
        message each: a read of each small put by every node must not double the messages)."""
        said = {node: {"offers": offers} for node, offers in self.due.items()}
        for node, reads in self.reads.items():
            said.setdefault(node, {"offers": []})["read"] = reads
        self.due, self.reads, self._count = {}, {}, 0
        return said

    def keep(self, node: str, key: str, version: int, fields: dict[str, Any]) -> None:
        known = self.offers.get(key)
        if known is not None and (known.node, known.version) == (node, version):
            known.fields = fields  # offered again: the owner holds one pin for this node
            return
        self.drop(key)
        self.offers[key] = Offer(node, version, fields)

    def of(self, key: str, node: str, version: int) -> Offer | None:
        """The offer of `key` at `version` of `node`'s, if this node holds it."""
        offer = self.offers.get(key)
        ok = offer is not None and (offer.node, offer.version) == (node, version)
        return offer if ok else None

    def drop(self, key: str) -> None:
        """`key`'s offer is no longer wanted (another version, or none, is listed): given back
        now, or once the read of it under way is over (`read`)."""
        offer = self.offers.pop(key, None)
        if offer is None:
            return
        if offer.reading:
            offer.dropped = True
        else:
            self._give_back(key, offer)

    def read(self, key: str, offer: Offer, failed: bool = False) -> None:
        """A read of `offer` is over: given back if it was dropped meanwhile, or if it `failed`
        (its owner is asked to lend the version instead)."""
        offer.reading = False
        if failed and self.offers.get(key) is offer:
            del self.offers[key]
            offer.dropped = True
        if offer.dropped:
            self._give_back(key, offer)

    def forget(self, node: str) -> None:
        """`node` went down or restarted: its offers are void, and nothing is given back."""
        for key in [k for k, o in self.offers.items() if o.node == node]:
            offer = self.offers.pop(key)
            offer.reading, offer.dropped = False, False
        self._count -= len(self.due.pop(node, ())) + len(self.reads.pop(node, ()))

    def give_back(self, node: str) -> None:
        """`node` may have let its offers here go: each is dropped, and given back (for
        an owner that did not)."""
        for key in [k for k, o in self.offers.items() if o.node == node]:
            self.drop(key)

    def was_read(self, node: str, key: str, version: int) -> None:
        """`node`'s offer of `key` at `version` was read whole: its owner is told."""
        self._add(self.reads, node, [key, version])

    def refuse(self, node: str, key: str, version: int) -> None:
        """An offer of a version that lost here: not kept, given back."""
        self._add(self.due, node, [key, version])

    def _add(self, to: dict[str, list[list[Any]]], node: str, entry: list[Any]) -> None:
        if not self._count:
            self._since = time.monotonic()
        self._count += 1
        to.setdefault(node, []).append(entry)

    def _give_back(self, key: str, offer: Offer) -> None:
        self.refuse(offer.node, key, offer.version)

    def __len__(self) -> int:
        return len(self.offers)
