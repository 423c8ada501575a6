"""Adoption: a broker that starts on the state of one that died takes it over (Note
[recovery] in state.py), and holds what the dead broker's clients may still hold until every
one of them is back or gone.

    journal rows ──take_over──> arena blocks, objects, queues, sessions rebuilt
                                retired objects held (`holding`), queue items handed to gets
                                whose answer was lost held for them (`taken`)
    a client's hello again ──claim──> its leases hold their objects again
    every client back or gone ──settle──> what no lease came back for is freed

It owns what only a restart has: the adopted objects by id, the ones held until `settle`,
the items a get sent again is to be given (`retake`), and the puts the dead broker sealed,
whose seals a client sends again (`sealed_before`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Container
from typing import Any

from ..common.config import format_size
from ..common.errors import BrokerUnavailable
from .durability.journal import LIVE, PENDING, Recovered, Row
from .queues.queues import Queues
from .sessions.sessions import Sessions
from .store.arena import Arena, Block
from .store.records import Session, StoredObject
from .store.registry import Registry
from .store.segments import Segment

log = logging.getLogger(__name__)


class Adoption:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.adopted: dict[int, StoredObject] = {}  # oid -> object, until all are back
        self._holding: list[StoredObject] = []  # retired: held until every client is back
        self._taken: dict[tuple[str, int], StoredObject] = {}  # (session, qget id) -> item
        self._sealed_puts: dict[tuple[str, int], StoredObject] = {}  # (session, put id)

    def take_over(
        self,
        found: Recovered,
        shm_dir: str,
        prefix: str,
        sessions: Sessions,
        queues: Queues,
        segments: set[str],
    ) -> None:
        """Take over the state of the broker that died, whose segments' names start with
        `prefix`: its objects, queues and sessions. Segments of that prefix not in use now
        (the arena's, directory's, rings', and `segments`: the lease slots' and mailboxes')
        were made but not journaled, or replaced: they go."""
        registry = self.registry
        arena: Arena = registry.arena
        names = [n for n, (_, kind) in found.segments.items() if kind == "arena"]
        arena.adopt(
            [Segment.existing(shm_dir, n) for n in names],
            [Block(row.segment, row.offset, row.size) for row in found.objects],
        )
        held = sessions.adopt(found.sessions)
        queues.adopt(found.queues, found.objects, sessions.by_token)
        self._objects(found.objects, sessions.by_token, queues.by_id)
        for key, version in found.versions.items():  # deleted keys put again go on from there
            registry.seen_version(key, version)
        for token, oids in held.items():
            self._hold(sessions.by_token[token], oids)
        queues.adopted(found.objects, self.adopted, self.retire)
        old = found.meta.get("directory")
        if old in found.segments and registry.directory is not None:
            try:
                registry.directory.adopt(old)
            except (OSError, ValueError) as exc:  # its readers ask the broker instead
                log.error("the directory %s of the state cannot be mapped (%s): left", old, exc)
        ours = {*arena.segments, *segments, *queues.rings.segments, *queues.qrings.segments}
        if registry.directory is not None:
            ours.update(registry.directory.segments)
        for name in os.listdir(shm_dir):  # made but not journaled, or replaced
            if name.startswith(prefix) and name not in ours:
                os.unlink(os.path.join(shm_dir, name))
                registry.journal.segment_gone(name)
        waiting = sum(s.awaiting for s in sessions.by_token.values())
        log.warning(
            "adopted the state of a broker that died (%s): %d objects, %d queues, %s used; "
            "waiting for %d clients to come back",
            found.owner, len(registry.objects), len(queues.by_name),
            format_size(arena.used_bytes), waiting,
        )  # fmt: skip
        if not waiting:
            self.settle()

    def _objects(
        self, rows: list[Row], sessions: dict[str, Session], queues: dict[int, Any]
    ) -> None:
        """Rebuild the objects of the journal `rows` (their blocks are allocated in the arena
        already). Live ones are published again; puts of sessions still alive carry over;
        retired ones are held until `settle`, as leases on them come back with their clients."""
        registry = self.registry
        for row in rows:
            q = queues.get(row.queue) if row.queue is not None else None
            block = Block(row.segment, row.offset, row.size)
            if row.queue is not None and q is None:  # an item of a queue forgotten since
                registry.arena.free(block)
                registry.journal.freed(row)
                continue
            obj = StoredObject(row.key, row.bundle, block, row.wire, row.version, queue=q)
            obj.oid, obj.evictable = row.oid, row.evictable
            self.adopted[obj.oid] = obj
            owner = sessions.get(row.session)
            if row.state == PENDING:
                if owner is None or owner.closed:  # its writer died with the broker
                    registry.retire(obj)
                else:
                    registry.carry_put(owner, row.put, obj, granted=not row.wire)
                continue
            self._sealed_puts[row.session, row.put] = obj
            for taker, took in row.gives:  # a broadcast item given to these gets
                if _asks_again(sessions, taker):  # held until it asks again, or has it
                    self._taken[taker, took] = obj
                    registry.pin(obj)
            if row.state == LIVE:
                registry.relist(obj)
            else:  # retired: leases or slots may hold it
                obj.retired = obj.listed = True
                registry.pin(obj)
                if (
                    row.taker is not None
                    and row.took is not None
                    and _asks_again(sessions, row.taker)
                ):
                    self._taken[row.taker, row.took] = obj  # held until the taker asks again
                else:
                    self._holding.append(obj)

    def _hold(self, session: Session, oids: list[int]) -> None:
        """Leases of a closed client whose arrays live on, on adopted objects."""
        for oid in oids:
            obj = self.adopted.get(oid)
            if obj is not None and not obj.freed:
                self.registry.lease(session, obj)

    def sealed_before(self, session: Session, put_id: int, item: bool) -> tuple[int] | None:
        """(version,) of a put the broker that died sealed, if this seal is sent again; None
        if it is a put of this broker's, or carried over. A put a broker before granted that
        is neither pending nor journaled was sealed and freed since, or lost with that
        broker: a queue `item`, handed to its consumers and freed, is answered (0,), as done;
        a keyed put raises BrokerUnavailable, for which is not known. A keyed put was
        answered (0,) too: test_chaos's twenty kills once read an older version of a key
        whose put had been answered so (the put was lost)."""
        obj = self._sealed_puts.get((session.token, put_id))
        if obj is not None:
            return (obj.version,)
        if put_id < self.registry.first_id and put_id not in self.registry.pending:
            if item:
                return (0,)
            raise BrokerUnavailable(
                f"the broker restarted during put {put_id}: the one before may have sealed it "
                "(and freed it since) or lost it; look (exists, get) and put it again if need be"
            )
        return None

    def retake(self, session: Session, request_id: int) -> StoredObject | None:
        """A queue item the broker that died handed to this very request, whose answer was
        lost: it goes to the request sent again (the hold becomes the consumer's lease)."""
        obj = self._taken.pop((session.token, request_id), None) if self._taken else None
        if obj is not None:
            obj.leases -= 1
        return obj

    def retire(self, obj: StoredObject) -> None:
        """An adopted item no one is to be given any more: retired, and held until `settle`
        (its readers may not be back yet with their leases)."""
        self.registry.pin(obj)
        self._holding.append(obj)
        self.registry.retire(obj)

    def claim(self, session: Session, leases: list[tuple[int, int]], calls: list[int]) -> list[int]:
        """A client of the broker that died is back with the leases it holds ([lease id,
        object id]) and the ids of its calls still waiting for an answer; the leases hold
        their objects again. Its puts it no longer knows of are aborted, and queue items
        handed to calls no longer waiting are let go. The lease ids whose objects are gone."""
        registry = self.registry
        lost, claimed, leased = [], set(), set()
        for lease_id, oid in leases:
            claimed.add(lease_id)
            if lease_id in session.leases:
                continue  # a put carried over
            obj = self.adopted.get(oid)
            if obj is None or obj.freed:
                lost.append(lease_id)
                continue
            registry.lease(session, obj, lease_id=lease_id)
            leased.add(oid)
        for put_id in [p for p in session.pending if p not in claimed]:
            registry.abort(session, put_id, keep=False)
        self._let_go(session, keep=set(calls), leased=leased)
        return lost

    def drop(self, session: Session) -> None:
        """`session` is gone: the items held for its gets sent again are let go."""
        self._let_go(session, keep=set())

    def _let_go(self, session: Session, keep: set[int], leased: Container[int] = ()) -> None:
        """Let go of the items held for the gets of `session` not in `keep`, or `leased`
        (object ids) by its hello: their answer came (a lease holds them then), or they are
        not waited for any more. (A hello can name a get whose answer came just after, and
        its lease: Leases.leased on the client.)"""
        taken = self._taken
        for key in [
            k for k, obj in taken.items()
            if k[0] == session.token and (k[1] not in keep or obj.oid in leased)
        ]:  # fmt: skip
            self.registry.unpin(taken.pop(key))

    def settle(self) -> None:
        """Every client of the broker that died is back or gone: retired objects that no
        lease came back for are freed (after a scan of the slots)."""
        holding, self._holding = self._holding, []
        for obj in holding:
            self.registry.unpin(obj)
        self.adopted.clear()


def _asks_again(sessions: dict[str, Session], token: str) -> bool:
    """Whether the client of `token` may send a get again after a restart (alive and open:
    a client closed with arrays alive says which it holds otherwise, and asks nothing)."""
    session = sessions.get(token)
    return session is not None and not session.closed
