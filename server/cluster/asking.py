"""A request of a key this node knows nothing of, in a cluster (Note [homes] in homes.py):
parked while the key's home is asked where it lives (a get, exists, wait, delete), or every
node is (a listing: keys, ls), then run again with what the answers said, or with what came
by its deadline (ASK_WAIT at most).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...common.errors import BrokerError
from ...common.protocol import Request, reply_error, reply_ok
from ..store.objects import Objects
from ..store.parking import Waiter
from ..store.records import Session
from .records import Links, Remote

log = logging.getLogger("tensorbroker.server.cluster.homes")  # (its lines, as before)

ASK_WAIT = 2.0  # seconds a request waits for a home's (or, listing, every node's) answer
Handler = Callable[[Session, bytes, Request], "dict[str, Any] | None"]
Row = tuple[str, int, int]  # where a key lives: (node, version, size)


@dataclass(eq=False)
class Ask:
    """A request parked until the nodes asked answer (the homes of its keys, or, for a
    listing, every node): `rows` (a listing's) gathers what they hold."""

    id: int
    nodes: set[str]
    until: float  # when it runs with what came (its request's timeout, at most ASK_WAIT)
    line: deque[Waiter] = field(default_factory=deque)
    rows: dict[str, Row] | None = None
    answered: set[str] = field(default_factory=set)
    began: float = 0.0


class Asking:
    """Homes' requests parked while a home, or every node, is asked (what it uses of Homes
    is named here)."""

    node: str
    objects: Objects
    links: Links
    index: Mapping[str, Remote]
    listed: Callable[[str, str, int, int], None]
    members: tuple[str, ...]
    asked: dict[str, str]
    asks: dict[int, Ask]
    handlers: dict[str, Handler]
    asked_count: int
    _ids: itertools.count[int]
    _again: set[int]
    _rows: dict[int, dict[str, Row]]
    _moving: Iterator[None]

    def home(self, key: str, members: tuple[str, ...] | None = None) -> str:
        raise NotImplementedError  # (Homes')

    def _deleted(self, key: str, owner: str, version: int) -> bool:
        raise NotImplementedError  # (Homes')

    def _waited(self, key: str) -> bool:
        raise NotImplementedError  # (Homes')

    def lookup(self, session: Session, route: bytes, req: Request, keys: list[str]) -> bool:
        """Ask the homes of `keys` (those of other nodes) where they live; `req` waits, and
        runs again once they answered. False if none is asked (this node is their home,
        or `req` runs again already)."""
        if id(req) in self._again:
            return False
        homes: dict[str, list[str]] = {}
        for key in keys:
            home = self.home(key)
            if home != self.node:
                homes.setdefault(home, []).append(key)
        ask = self._ask(req)
        look = req.fields.get("timeout", 0.0) != 0  # (it waits: told of a later put)
        for home, named in homes.items():
            if self.links.send(home, {"op": "where", "ask": ask.id, "keys": named, "look": look}):
                ask.nodes.add(home)
                self.asked.update(dict.fromkeys(named, home))
                self.asked_count += 1
        return self._park(session, route, req, ask)

    def gather(self, session: Session, route: bytes, req: Request, query: dict[str, Any]) -> bool:
        """A listing: every node up is asked for its own keys that `query` names (`prefix`,
        `after`, `limit`, `by`: as `ls`); `req` waits, and runs again with them (`rows`).
        False if no node is asked."""
        if id(req) in self._again:
            return False
        ask = self._ask(req, rows={})
        for node in self.members:
            if node != self.node and self.links.send(node, {"op": "ls", "ask": ask.id, **query}):
                ask.nodes.add(node)
        return self._park(session, route, req, ask)

    def rows(self, req: Request) -> dict[str, Row]:
        """The rows gathered for listing `req` (Mapping of key -> (node, version, size))."""
        return self._rows.get(id(req), {})

    def _ask(self, req: Request, rows: dict[str, Row] | None = None) -> Ask:
        """An ask for `req`: it waits at most ASK_WAIT, or its own timeout if shorter (and
        runs with what came: a get then waits in its key's line for the rest of it)."""
        timeout = req.fields.get("timeout")
        wait = ASK_WAIT if not timeout else min(ASK_WAIT, timeout)
        now = time.monotonic()
        return Ask(next(self._ids), set(), now + wait, rows=rows, began=now)

    def _park(self, session: Session, route: bytes, req: Request, ask: Ask) -> bool:
        if not ask.nodes:
            return False
        self.asks[ask.id] = ask
        self.objects.lot.park(session, route, req, None, ask.line, "")
        return True

    def answered(self, node: str, m: dict[str, Any]) -> None:
        """`node` answered ask `m["ask"]`: where its keys live (`where`), or its own keys
        (`ls`). Its request runs again once every node asked answered."""
        ask = self.asks.get(int(m.get("ask", 0)))
        if m["op"] == "where":  # (a looker's ask again, for no request: ask 0)
            for key, owner, version, size in m["keys"]:
                if owner is not None and owner != self.node:
                    if not self._deleted(str(key), str(owner), int(version)):
                        self.listed(str(owner), str(key), int(version), int(size))
                elif owner is not None:
                    continue
                elif m.get("look", True):  # (a looker there: a non-waiting ask's answer,
                    self.asked.setdefault(str(key), node)  # come first, forgot it)
                elif self.asked.get(str(key)) == node and not self._waited(str(key)):
                    del self.asked[str(key)]  # (not a looker there: nothing to hear)
        elif ask is not None and ask.rows is not None:
            for key, version, size in m["keys"]:
                ask.rows[str(key)] = (node, int(version), int(size))
        if ask is not None:
            ask.nodes.discard(node)
            ask.answered.add(node)
            if not ask.nodes:
                self._done(ask)

    def tick(self, now: float) -> None:
        """A slice of a move under way (`changed`); asks whose nodes went down, or did not
        answer within ASK_WAIT: run with what came."""
        try:
            next(self._moving, None)
        except Exception:  # (the move ends: `_move` says so as it unwinds)
            log.exception("could not move keys to their homes")
        for ask in list(self.asks.values()):
            ask.nodes = {n for n in ask.nodes if self.links.up(n)}
            if not ask.nodes or now > ask.until:
                self._done(ask)

    def _done(self, ask: Ask) -> None:
        del self.asks[ask.id]
        if ask.rows is not None:  # the keys of nodes that did not answer: as known here
            for key, remote in self.index.items():
                if remote.node not in ask.answered:
                    ask.rows.setdefault(key, remote)
        spent = time.monotonic() - ask.began
        for w in list(ask.line):
            if not w.done:
                timeout = w.request.fields.get("timeout")
                if timeout:  # (what is left of it)
                    w.request.fields["timeout"] = max(0.001, timeout - spent)
                self._again_run(w, ask.rows)

    def _again_run(self, w: Waiter, rows: dict[str, Row] | None) -> None:
        objects, req = self.objects, w.request
        objects.lot.unpark(w)
        self._again.add(id(req))
        if rows is not None:
            self._rows[id(req)] = rows
        try:
            reply = self.handlers[req.op](w.session, w.route, req)
        except BrokerError as exc:
            objects.answer(w, reply_error(req.id, exc))
        except Exception as exc:  # (a bug: said, not a request left unanswered)
            log.exception("%s could not run again", req.op)
            objects.answer(w, reply_error(req.id, BrokerError(f"internal error: {exc!r}")))
        else:
            if reply is not None:
                objects.answer(w, reply_ok(req.id, **reply))
        finally:
            self._again.discard(id(req))
            self._rows.pop(id(req), None)
