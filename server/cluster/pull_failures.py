"""A pull that failed (pulls.py): what its gets are told, or whether they wait on for the
key's owner to be back (a reader does not raise while the owner may be alive and its own
timeout has not run out), and what the pulls sent here are told."""

from __future__ import annotations

import time
from typing import Any

from ...common.errors import BrokerError, NotFound, PeerUnavailable
from ...common.protocol import reply_error, reply_ok
from ..store.objects import Objects
from ..store.parking import Waiter
from ..store.records import Session
from .records import Links, Pull, Remote


class Failing:
    """Pulls' failures: `_fail` and `_get_again`."""

    node: str
    links: Links
    index: dict[str, Remote]
    objects: Objects
    registry: Any
    session: Session

    def _end(self, pull: Pull) -> None:
        raise NotImplementedError

    def _fail(self, pull: Pull, error: BrokerError) -> None:
        if pull.handle is not None:  # still reading: its block must outlive the read
            return
        self._end(pull)
        for node, their, ask in pull.lends:  # sent here: their owner lends it to them instead
            gone = f"node {self.node!r} could not pull {pull.key!r}"
            self.links.answer(node, {"op": "lent", "pull": their, "ask": ask, "error": gone})
        if pull.put:
            self.registry.abort(self.session, pull.put, False)
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
