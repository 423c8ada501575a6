"""What the cluster's rooms share: the links to the other nodes as they use them (Links: the
Cluster's), where another node's key lives (Remote), a pull of one (Pull: pulls.py's; a relay lends
one under way, Note [relays] in lending.py), and the broker's ready items that are the
cluster's (Watched)."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from ..store.parking import Waiter
from ..store.records import StoredObject
from .offers import Offer


class Links(Protocol):
    """The links to the other nodes (cluster.py's Cluster)."""

    def send(self, node: str, message: dict[str, Any]) -> bool: ...
    def answer(self, node: str, message: dict[str, Any]) -> bool: ...
    def everyone(self, message: dict[str, Any]) -> None: ...
    def after(self, node: str, message: Any) -> None: ...
    def everyone_after(self, message: dict[str, Any]) -> None: ...
    def up(self, node: str) -> bool: ...
    def fresh(self, node: str) -> bool: ...
    def acked(self, node: str, m: dict[str, Any]) -> bool: ...
    def ack(self, node: str) -> dict[str, Any]: ...
    @property
    def incarnation(self) -> int: ...
    def nodes(self) -> list[str]: ...

    down_after: float  # seconds of silence before a peer is taken for down (Note [beats])


class Remote(NamedTuple):
    """A key that lives on another node, at `version`, `size` bytes."""

    node: str
    version: int
    size: int


@dataclass(slots=True)
class Pull:
    """A key being pulled: its owner `node`, asked (or `source`, a node it sent this one to)
    to lend it (handle None), then read. `lends`: pulls of other nodes sent here meanwhile."""

    id: int
    key: str
    node: str
    seen: int  # the version the index named when it was asked for
    started: float
    source: str = ""
    version: int = 0  # the version lent
    put: int = 0  # the put lease of the replica's block
    handle: Any = None
    reading: Any = None  # its last Reading (kept past `handle`: its block may be held, pushes.py)
    reads_failed: int = 0  # its reads that failed, its owner up (read again: READ_AGAIN)
    size: int = 0
    offer: Offer | None = None  # read from the offer its announcement carried (offers.py)
    asked: bool = True  # its lend went out (else sent again once its source is `fresh`)
    ask: int = 0  # its lends so far: only the last one's answer is read
    direct: bool = False  # its last lend said so (the owner itself lends it)
    suspect: bool = False  # its source forgot this node while it was read: not sealed
    cut: bool = False  # its relay failed it, or forgot this node: read again once its reads end
    read_at: float = 0.0  # when its read ended, its source not vouching for it yet (_vouched)
    obj: StoredObject | None = None  # the replica being read (a relay lends it meanwhile)
    # Its loan (lent or offered, and its version), read once this node's memory has grown
    # (the Growth it waits for: Note [growing] in server/store/arena.py).
    room: tuple[dict[str, Any], int, Any] | None = None
    told: int = 0  # its bytes read that the borrowers it was lent to meanwhile were told of
    waiters: list[Waiter] = field(default_factory=list)
    lends: list[tuple[str, int, int]] = field(default_factory=list)  # (node, pull id, ask)
    partial: list[tuple[str, int, int]] = field(default_factory=list)  # lent it meanwhile

    def lendable(self, chunk: int) -> bool:
        """Whether a relay lends this pull's replica while it reads it (Note [relays]): one
        larger than `chunk`, read into its block, part of it still to come, and not to be
        thrown away (else it is lent once sealed, and pinned)."""
        if self.obj is None or self.handle is None or self.cut or self.suspect:
            return False
        return chunk < self.size and self.handle.ready() < self.size


class Watched:
    """The broker's ready items that are not its endpoint's: pidfds, and the cluster's sockets
    and descriptors."""

    def __init__(self, *parts: Collection[Any]) -> None:
        self.parts = parts

    def __contains__(self, item: object) -> bool:
        return any(item in part for part in self.parts)

    def __iter__(self) -> Iterator[Any]:
        for part in self.parts:
            yield from part

    def __len__(self) -> int:
        return sum(len(part) for part in self.parts)
