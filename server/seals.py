"""A client's seals: a `seal` (of a put that asked for its block) or a `write` (into a block
granted ahead), sent to the room of its key or of its queue; a seal sent again to a broker
that applied it before it died, answered from what it sealed; a seal refused, its block
given back; and the grants the batch's writes used, topped up once their replies are out
(Note [grants] in grants.py).
"""

from __future__ import annotations

import logging
from typing import Any

from ..common import protocol
from ..common.protocol import Op, Request, reply_ok
from .adoption import Adoption
from .queues.handoff import Handoffs
from .queues.queues import Queues
from .store.objects import Objects
from .store.records import Session

log = logging.getLogger(__name__)

SEALS = frozenset({Op.SEAL, Op.WRITE})  # a client's seals, in order over one socket


class Seals:
    def __init__(
        self,
        objects: Objects,
        queues: Queues,
        adoption: Adoption,
        handoffs: Handoffs,
        sessions: dict[bytes, Session],
    ) -> None:
        """`sessions`: the sessions by route (Sessions.routes)."""
        self.objects, self.queues, self.adoption = objects, queues, adoption
        self.registry = objects.registry
        self.handoffs, self._sessions = handoffs, sessions

    def seal(self, session: Session, route: bytes, req: Request) -> dict[str, Any]:
        put_id, keep = req.fields["put"], req.fields.get("keep", False)
        done = self.adoption.sealed_before(session, put_id, req.fields.get("item", False))
        if done is not None:  # sealed by the broker that died; its answer was lost
            return {"version": done[0]}
        queue = self.registry.pending_put(session, put_id, "seal").queue
        if queue is not None:
            return self.queues.seal(session, put_id, keep, queue)
        return self.objects.seal(session, put_id, keep)

    def write(self, session: Session, route: bytes, req: Request) -> dict[str, Any]:
        """A block granted ahead, written: sealed as a put of its key, or a queue item."""
        done = self.adoption.sealed_before(session, req.fields["put"], "queue" in req.fields)
        if done is not None:  # sealed by the broker that died; its answer was lost
            return {"version": done[0]}
        if "queue" in req.fields:
            return self.queues.direct.write(session, route, req)
        return self.objects.write(session, route, req)

    def refused(self, route: bytes, message: Any, parsed: bool) -> None:
        """A seal (or write into a block granted ahead) refused, for any reason: its block
        goes back now. Its client forgets the put when the answer is an error (Note [writes]
        in client/writes.py), so a put left pending here would hold its memory until the
        client's process exits. A seal refused before it was parsed is applied too, as far
        as its offers go (the broker's dispatch says so of the others)."""
        op = message.get("op") if isinstance(message, dict) else None
        if type(op) is not str or op not in SEALS:  # (an op of any shape comes here too)
            return
        session = self._sessions.get(route)
        put_id = message.get("put")
        if session is None or type(put_id) is not int:
            return
        if put_id in session.pending:
            self.registry.abort(session, put_id, keep=message.get("keep") is True)
        request_id = protocol.request_id(message)
        if not parsed and request_id:
            self.handoffs.applied(session, request_id)

    def top_up(self) -> list[tuple[bytes, bytes]]:
        """The grants the last batch's writes used, topped up: one message per writer's
        socket, [(route, message)], to send now that their replies are out."""
        refills, self.objects.refills = self.objects.refills, []
        due: dict[tuple[bytes, Session], set[tuple[str, int]]] = {}
        for session, route, size_class, device in refills:
            due.setdefault((route, session), set()).add((device, size_class))
        out = []
        grant = self.registry.grants.grant
        for (route, session), classes in due.items():
            if session.closed or route not in session.routes:
                continue
            grants = []
            for device, size_class in sorted(classes):
                try:
                    grants += grant(session, size_class, device)
                except Exception:  # (outside any request: the loop must go on) no grants
                    log.exception("could not top up the grants of %s on %s", size_class, device)
            if grants:
                out.append((route, reply_ok(0, grants=grants)))
        return out
