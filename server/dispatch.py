"""The broker's requests, one at a time (Note [recovery] in durability/state.py for when their
replies go): each parsed, its sender's session found (only hello and ping come before a
hello), the leases it carries ended, and handed to its op's room (ops.py's table). An error
becomes its reply; a bug becomes an internal error's reply, logged, and the broker goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import zmq

from ..common import protocol
from ..common.errors import BrokerError, SessionUnknown
from ..common.fields import parse_request
from ..common.protocol import NO_REPLY, Op, Request, reply_error, reply_ok
from .ops import Handler
from .opstats import OpStats
from .queues.handoff import Handoffs
from .queues.queues import Queues
from .seals import SEALS, Seals
from .sessions.endpoint import Endpoint
from .sessions.outbox import Outbox
from .sessions.sessions import Sessions
from .store.registry import Registry

log = logging.getLogger("tensorbroker.server.broker")  # (its loop's, as before)


class Dispatching:
    """Broker's side that answers each request (what it uses of Broker is named here)."""

    opstats: OpStats
    outbox: Outbox
    seals: Seals
    queues: Queues
    sessions: Sessions
    endpoint: Endpoint
    registry: Registry
    handoffs: Handoffs
    _handlers: dict[str, Handler]
    _ping: Callable[[], dict[str, Any]]

    def _handle(self, route: bytes, message: Any, frame: zmq.Frame | None = None) -> None:
        """Answer one request; `frame`: the ZeroMQ frame it came in (None: a lane's)."""
        began = time.perf_counter()
        op = None
        try:
            request = parse_request(message)
            op = request.op  # a known op: the counters stay bounded
            result = self._dispatch(route, request, frame)
        except Exception as exc:
            self._fail(route, protocol.request_id(message) or 0, exc)
            self.seals.refused(route, message, parsed=op is not None)
        else:
            if result is not None and request.op not in NO_REPLY:
                self.outbox.send(route, reply_ok(request.id, **result))
        self.queues.slots.admit_putters()
        if op is not None:
            self.opstats.record(op, time.perf_counter() - began)

    def _dispatch(
        self, route: bytes, request: Request, frame: zmq.Frame | None
    ) -> dict[str, Any] | None:
        if request.op == Op.HELLO:
            return self.sessions.hello(route, request, self.endpoint.peer(route, frame))
        if request.op == Op.PING:
            return self._ping()
        session = self.sessions.routes.get(route)
        if session is None:
            raise SessionUnknown(f"{request.op}: this broker does not know the client")
        session.last_seen = time.monotonic()
        if request.releases:
            release = self.registry.release
            unknown = [lease for lease in request.releases if not release(session, lease)]
            if unknown:
                unknown = self.handoffs.released_early(session, unknown)
            if unknown:  # one line per request, however many (a flood must not fill the log)
                log.warning("%s released %d leases it does not hold (%s%s)", session,
                            len(unknown), ", ".join(map(str, unknown[:5])),
                            ", ..." if len(unknown) > 5 else "")  # fmt: skip
        try:
            return self._handlers[request.op](session, route, request)
        finally:
            if request.op in SEALS:  # applied or refused: its offers say so (Note [direct handoff])
                self.handoffs.applied(session, request.id)

    def _refuse(self, route: bytes, exc: Exception) -> None:
        """A message that would not decode."""
        self._fail(route, 0, exc)

    def _fail(self, route: bytes, request_id: int, exc: Exception) -> None:
        self.opstats.refuse(exc.code if isinstance(exc, BrokerError) else BrokerError.code)
        if isinstance(exc, BrokerError):
            log.debug("request %s failed: %s", request_id, exc)
        else:  # a bug must not take the broker down; say so loudly
            log.exception("internal error handling request %s", request_id)
            exc = BrokerError(f"internal error: {exc!r}")
        self.outbox.send(route, reply_error(request_id, exc))
