"""A pull that failed (pulls.py): what its gets are told, or whether they wait on for the
key's owner to be back (a reader does not raise while the owner may be alive and its own
timeout has not run out), and what the pulls sent here are told; or one whose read cannot
be used, or whose lend went unanswered, asked again."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from ...common.errors import BrokerError, NotFound, PeerUnavailable
from ...common.protocol import reply_error, reply_ok
from ..store.objects import Objects
from ..store.parking import Waiter
from ..store.records import Session
from .offers import Held
from .records import Links, Pull, Remote
from .transfers import Transfers

log = logging.getLogger(__name__)


class Failing:
    """Pulls' failures: `_fail`, `_get_again`, `_read_again`, `_again` and `_unanswered`."""

    node: str
    links: Links
    index: dict[str, Remote]
    objects: Objects
    registry: Any
    session: Session

    held: Held
    transfers: Transfers
    pulls: dict[int, Pull]
    ask: Callable[[str, str, Sequence[Waiter], Sequence[tuple[str, int, int]]], Pull]

    def _end(self, pull: Pull) -> None:
        raise NotImplementedError

    def _cut(self, pull: Pull, why: str) -> None:
        raise NotImplementedError

    def _return(self, node: str, pull: int, ask: int) -> None:
        raise NotImplementedError

    def _lend(self, pull: Pull, source: str | None = None, direct: bool = False) -> None:
        raise NotImplementedError

    def _ask_at(self, pull: Pull, source: str, direct: bool = False) -> None:
        raise NotImplementedError

    def _read_again(self, pull: Pull, exc: Exception) -> None:
        """A read that cannot be used: from an offer, that failed (a segment of its owner's
        that this node's NIXL does not know yet, say), or from a source that forgot this node
        meanwhile. The offer is given back, and the owner asked to lend the key instead."""
        log.info("cluster: %r read again, from its owner %r (read from %r: %s)", pull.key,
                 pull.node, pull.source, exc)  # fmt: skip
        offer, pull.offer = pull.offer, None
        if offer is not None:
            self.held.read(pull.key, offer, failed=True)
        self._cut(pull, f"node {self.node!r} read {pull.key!r} again")
        if pull.version and offer is None:  # (its lender let go already, or does now)
            self._return(pull.source, pull.id, pull.ask)
        self._drop(pull)
        pull.version = 0
        pull.obj, pull.cut, pull.told, pull.read_at = None, False, 0, 0.0
        pull.suspect = False  # (of the read thrown away: the next is read anew)
        if not self.links.up(pull.node):
            self._fail(pull, PeerUnavailable(f"the pull of {pull.key!r} failed: {exc}"))
            return
        pull.started = time.monotonic()
        relay, pull.source = pull.source != pull.node, pull.node
        self._lend(pull, pull.node, direct=relay)  # (a relay failed it: the owner lends it)

    def _drop(self, pull: Pull) -> None:
        """Abort the put of `pull`'s replica; its block stays out of use while a lender may
        still write into it (pieces given up: Note [pushes] in pushes.py)."""
        put, reading = pull.put, pull.reading
        pull.put, pull.reading = 0, None
        if not put:
            return

        def release() -> None:
            self.registry.abort(self.session, put, False)

        if reading is None or not self.transfers.hold(reading.reads, release):
            release()

    def _again(self, pull: Pull, error: BrokerError) -> None:
        """Pull it again from where the index says it is now (another version won, or it was
        deleted there, meanwhile), for the same gets; `error` for them if no node has it."""
        self._end(pull)
        remote = self.index.get(pull.key)
        if remote is not None and self.links.up(remote.node):
            self.ask(pull.key, remote.node, pull.waiters, pull.lends)
            pull.lends = []
        elif remote is not None:  # it lives on: on a node that is down
            down = f"{pull.key!r} lives on node {remote.node!r}, which is down"
            self._fail(pull, PeerUnavailable(f"{down}: try again once it is back"))
        else:
            self._fail(pull, error)

    def _unanswered(self, pull: Pull) -> None:
        """A lend not answered within PULL_WAIT: asked of the owner again, directly (a relay
        may still be reading a large version; the owner is up, else `node_down` ended the
        pull), as long as a get still waits for it or a pull of another node was sent here;
        else the pull ends. A get waits for its own timeout (at least PULL_WAIT: replicas.py),
        not for a pull that no longer answers in time."""
        if any(not w.done for w in pull.waiters) or pull.lends:
            self._ask_at(pull, pull.node, direct=True)
        else:
            self._fail(pull, PeerUnavailable(f"node {pull.node!r} did not lend {pull.key!r}"))

    def _fail(self, pull: Pull, error: BrokerError) -> None:
        if pull.handle is not None:  # still reading: its block must outlive the read
            return
        self._end(pull)
        for node, their, ask in pull.lends:  # sent here: their owner lends it to them instead
            gone = f"node {self.node!r} could not pull {pull.key!r}"
            self.links.answer(node, {"op": "lent", "pull": their, "ask": ask, "error": gone})
        self._drop(pull)
        deleted = isinstance(error, NotFound) and pull.key not in self.index
        remote = self.index.get(pull.key)  # (its key's node now is down: wait for it)
        owner = pull.node if remote is None else remote.node
        lost = isinstance(error, PeerUnavailable) and not self.links.up(owner)
        now = time.monotonic()
        for w in pull.waiters:
            if w.done:
                continue
            until = w.request.fields.setdefault("until", w.deadline)  # (Replicas.get's)
            if w.request.fields.get("timeout", 0.0) != 0.0 and (
                deleted or (lost and (until is None or now < until))
            ):  # (deleted: it waits as for a key no node has; no pull, no loop)
                self._get_again(w, until, now)
            else:
                self.objects.answer(w, reply_error(w.request.id, error))

    def _get_again(self, w: Waiter, until: float | None, now: float) -> None:
        """Handle a get that may wait again, from its start, until its deadline (`until`): a
        watch with `deletes` is told its key is gone; another is pulled again from where the
        index says its key lives, or waits for that node to be back (Replicas.get).

        A get whose pull failed for a node taken for down waits on so: a reader does not
        raise while its key's owner may be alive and its own timeout has not run out. A
        broker stalled past DOWN_AFTER takes every peer for down, and its readers' pulls
        failed although no node went down (issue 50)."""
        if until is not None:
            w.request.fields["timeout"] = max(0.001, until - now)
        self.objects.lot.unpark(w)
        try:
            reply = self.objects.get(w.session, w.route, w.request)
        except BrokerError as exc:
            self.objects.answer(w, reply_error(w.request.id, exc))
        else:
            if reply is not None:
                self.objects.answer(w, reply_ok(w.request.id, **reply))
