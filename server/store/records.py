"""What the broker keeps of each object and each client: `StoredObject` (an object or a
queue item, from put to freed: its life is drawn in registry.py) and `Session` (one client,
from its hello to when its process has let go of everything), and `Peer`, the process at the
other end of a socket."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ...common.descriptors import TensorDesc
from ...common.dtypes import dtype
from .arena import Block


@dataclass(eq=False, slots=True)
class StoredObject:
    key: str
    bundle: bool
    block: Block
    wire: Sequence[Any]  # its tensors, as sent on the wire (built once, at put: laid_out)
    version: int = 0  # set at seal
    leases: int = 0
    live: bool = False
    retired: bool = False
    freed: bool = False
    queue: Any = None  # the queue this item goes to (None: a keyed object)
    device: str = "cpu"  # or "cuda:N": then block is in that device's arena
    events: list[int] | None = None  # a device object's write and read-done events
    oid: int = 0  # its id, never reused: what lease slots hold
    listed: bool = False  # in the directory since sealed: readers' slots may hold it
    granted: bool = False  # a block granted ahead, not yet written (Note [grants])
    evictable: bool = False  # may be freed to make room (eviction.py)
    last_use: float = 0.0  # when it was put, or last read through the broker (monotonic)
    sealed_at: float = 0.0  # when it was sealed (monotonic)

    @property
    def nbytes(self) -> int:
        return self.block.size

    @property
    def tensors(self) -> tuple[TensorDesc, ...]:
        return tuple(TensorDesc.from_wire(w) for w in self.wire)

    @property
    def data_bytes(self) -> int:
        """The bytes of its tensors (its block may be larger: blocks come in size classes)."""
        return sum(dtype(t.dtype).nbytes(t.shape) for t in self.tensors)


class Peer(NamedTuple):
    """The process at the other end of a socket, as the kernel says (SO_PEERCRED)."""

    pid: int | None  # None where the kernel cannot say (another pid namespace)
    uid: int | None


@dataclass(eq=False, slots=True)
class Session:
    """One client (all the sockets of one `Client`), known from its hello."""

    token: str
    pid: int | None
    boot_id: str | None = None
    start_time: int | None = None
    leases: dict[int, StoredObject] = field(default_factory=dict)
    pending: set[int] = field(default_factory=set)  # lease ids of its unsealed puts
    read_events: dict[int, int] = field(default_factory=dict)  # device lease -> read-done event
    writing: list[StoredObject] = field(default_factory=list)  # device objects it sealed whose
    # copies may still be running (Note [a producer that dies with its copy queued])
    routes: set[bytes] = field(default_factory=set)  # its sockets' ZeroMQ routing ids
    pidfd: int | None = None  # readable when the client process exits
    last_seen: float = 0.0  # for sessions without a pidfd: heartbeats keep them alive
    closed: bool = False  # said bye, kept only for the leases its process still holds
    region: int | None = None  # its lease-slot region (Note [directory and lease slots])
    mailbox: int | None = None  # its mailbox (Note [direct handoff] in common/mailbox.py)
    applied: int = 0  # the request id of its last seal applied (or refused) and journaled
    awaiting: bool = False  # adopted from a broker that died: not back yet (Note [recovery])
    came_back: bool = False  # adopted, and its hello with its leases was answered
    grants: dict[Any, int] = field(default_factory=dict)  # size class -> blocks granted ahead
    credits: dict[int, int] = field(default_factory=dict)  # queue id -> slots granted ahead
    uid: int | None = None  # the kernel's word for the user it runs as (None: tcp://)

    def __repr__(self) -> str:
        return f"<session {self.token[:8]} pid={self.pid} uid={self.uid}>"
