"""What an operator lists: the objects with their sizes and holders (`list`), the queues with
their depths (`qlist`), the clients with what they hold (`clients`), and a queue's removal
(`qdelete`). These are read-only views of the registry, the queues and the sessions, except
the removal, which the queues do.

A store can hold millions of keys, so `list` answers one page at a time (at most LIST_LIMIT
objects, the keys after `after` in order) and the broker answers other clients between pages.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterable, Mapping
from itertools import chain
from typing import Any

from ..common.errors import InvalidRequest
from ..common.protocol import Request
from .queues.queue_state import BrokerQueue
from .queues.queues import Queues
from .store.objects import Objects
from .store.parking import ParkingLot
from .store.records import Session, StoredObject

LIST_LIMIT = 10_000  # objects per page of `list`

Reply = dict[str, Any]


class Inventory:
    def __init__(
        self, objects: Objects, queues: Queues, sessions: Iterable[Session], lot: ParkingLot
    ) -> None:
        self.registry, self.queues, self._sessions, self.lot = (
            queues.registry,
            queues,
            sessions,
            lot,
        )
        self._objects = objects  # (its `elsewhere`: the keys of a cluster's other nodes)

    def objects(self, session: Session, route: bytes, req: Request) -> Reply | None:
        """A page of objects: by key after `after` (with "more" if keys remain), or the
        `limit` largest (by="size"). Leases count the broker's and the directory's readers."""
        f = req.fields
        prefix, limit, by = f.get("prefix", ""), f.get("limit", LIST_LIMIT), f.get("by", "key")
        if not 1 <= limit <= LIST_LIMIT:
            raise InvalidRequest(f"limit must be 1 to {LIST_LIMIT}, got {limit}")
        objects, elsewhere = self.registry.objects, self._objects.elsewhere
        if elsewhere is not None and by == "key":  # every node is asked for its own keys
            query = {"prefix": prefix, "after": f.get("after"), "limit": limit, "by": by}
            if elsewhere.gather(session, route, req, query):
                return None  # (and this runs again with them)
        there: Mapping[str, tuple[str, int, int]] = {}  # key -> (node, version, size)
        if elsewhere is not None:  # (by size: this node's objects, its replicas' owners)
            there = elsewhere.rows(req) if by == "key" else elsewhere.where()
        chosen: list[StoredObject | dict[str, Any]]
        if by == "size":
            # By block first (cheap), then by the tensors' bytes among the blocks at least as
            # large as the last one chosen: blocks come in size classes, so ties are common.
            under = [o for k, o in objects.items() if k.startswith(prefix)]
            blocks = heapq.nlargest(limit, under, key=lambda o: o.nbytes)
            least = blocks[-1].nbytes if blocks else 0
            near = [o for o in under if o.nbytes >= least]
            if len(near) > LIST_LIMIT:  # a million objects of one class: any of them will do
                near = blocks
            largest: list[StoredObject] = heapq.nlargest(limit, near, key=lambda o: o.data_bytes)
            chosen = list(largest)
            more = False
        elif by == "key":
            after = f.get("after")
            # Every key once, no copy of either (a replica's key is in both).
            every = chain(objects, (k for k in there if k not in objects))
            keys = heapq.nsmallest(
                limit + 1,
                (k for k in every if k.startswith(prefix) and (after is None or k > after)),
            )
            more = len(keys) > limit
            chosen = [objects.get(k) or _remote_row(k, *there[k]) for k in keys[:limit]]
        else:
            raise InvalidRequest(f"by must be 'key' or 'size', got {by!r}")
        held = self.registry.slots.held() if self.registry.slots is not None else {}
        rows = [o if isinstance(o, dict) else _object_row(o, held.get(o.oid, 0)) for o in chosen]
        if elsewhere is not None:  # where each lives: a replica's owner, or this node
            for row in rows:
                row.setdefault(
                    "node", there[row["key"]][0] if row["key"] in there else elsewhere.node
                )
        return {"objects": rows, "more": more}

    def queue_list(self, session: Session, route: bytes, req: Request) -> Reply:
        """Every queue not yet ended (closed queues still draining included)."""
        return {"queues": [_queue_row(q) for q in self.queues.by_name.values() if not q.ended]}

    def clients(self, session: Session, route: bytes, req: Request) -> Reply:
        """Every session: its process, user, sockets, what it holds, its parked requests."""
        held = self.registry.slots.held if self.registry.slots is not None else None
        parked: dict[Session, int] = {}
        for w in self.lot.parked:
            parked[w.session] = parked.get(w.session, 0) + 1
        rows = []
        for s in self._sessions:
            slotted = 0
            if held is not None and s.region is not None:
                slotted = sum(held(s.region).values())
            reading = [o for lease, o in s.leases.items() if lease not in s.pending]
            rows.append({
                "pid": s.pid,
                "uid": s.uid,
                "sockets": len(s.routes),
                "leases": len(reading) + slotted,  # what it reads (not its puts' blocks)
                "held_bytes": sum(o.nbytes for o in reading),
                "parked": parked.get(s, 0),
                "closed": s.closed,
                "idle_s": max(0.0, time.monotonic() - s.last_seen) if s.last_seen else None,
            })  # fmt: skip
        return {"clients": rows}


def _object_row(obj: StoredObject, readers: int) -> dict[str, Any]:
    tensors = obj.tensors
    return {
        "key": obj.key,
        "version": obj.version,
        "nbytes": obj.data_bytes,
        "device": obj.device,
        "leases": obj.leases + readers,
        "bundle": obj.bundle,
        "tensors": [[t.name, t.dtype, list(t.shape)] for t in tensors],
        "evictable": obj.evictable,
    }


def _remote_row(key: str, node: str, version: int, size: int) -> dict[str, Any]:
    """A key only another node of the cluster holds (not pulled here)."""
    return {
        "key": key, "version": version, "nbytes": size, "device": "cpu", "leases": 0,
        "bundle": False, "tensors": [], "evictable": False, "node": node,
    }  # fmt: skip


def _queue_row(q: BrokerQueue) -> dict[str, Any]:
    (depth, in_flight), (consumers, producers) = q.counts(), q.waiters()
    return {
        "name": q.name,
        "depth": depth,
        "maxsize": q.maxsize,
        "in_flight": in_flight,
        "closed": q.closed,
        "consumers": consumers,
        "producers": producers,
        "subscribers": None if q.subs is None else len(q.subs),
    }
