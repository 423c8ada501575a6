"""Replies held for their batch's journal commit: a client is told of a change only once the
journal has it (Note [recovery] in state.py). The loop handles each batch of requests as one
transaction (`begin`, `commit`); the replies of its requests wait here until the batch's
records are written, then go out in order. The answer to a request that waited goes out at
once, after the records so far (`answer`), unless it is to go after the batch's replies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..durability.journal import Journal

Send = Callable[[bytes, bytes, "int | None"], None]  # route, payload, a descriptor with it


class Outbox:
    def __init__(
        self,
        journal: Journal,
        send: Send,
        committed: Callable[[], None],
        sent: Callable[[], None],
    ) -> None:
        """`committed`: told when records are written, before their replies go;
        `sent`: when they went (Note [direct handoff], Note [broadcast ring])."""
        self._journal, self._send = journal, send
        self._committed, self._sent = committed, sent
        self._held: list[tuple[bytes, bytes, int | None]] | None = None  # held for a commit
        self._after: list[tuple[bytes, bytes, int | None]] = []  # after the held ones

    def begin(self) -> None:
        """What the loop handles next is one journal transaction."""
        self._held = []
        self._journal.begin()

    def commit(self) -> None:
        self._journal.commit()
        self._committed()
        held, self._held = self._held, None
        for route, payload, fd in held or ():
            self._send(route, payload, fd)
        after, self._after = self._after, []
        for route, payload, fd in after:
            self._send(route, payload, fd)
        self._sent()

    def batch(self, replies: Iterable[tuple[bytes, bytes]]) -> None:
        """Messages made outside a request (grants topped up), sent after their journal
        records, as one transaction."""
        self.begin()
        try:
            for route, payload in replies:
                self.send(route, payload)
        finally:
            self.commit()

    def send(self, route: bytes, payload: bytes, fd: int | None = None) -> None:
        """A reply (with descriptor `fd` passed along, if given): after the batch's commit,
        or now outside of one."""
        if self._held is not None:
            self._held.append((route, payload, fd))
            return
        self._send(route, payload, fd)

    def answer(self, route: bytes, payload: bytes, last: bool = False) -> None:
        """The reply to a request that waited (a consumer parked on a queue, say): it goes
        out at once, after the journal records so far, not at the end of the batch, so that
        the work left (refilling the producer's grants) is not on the consumer's path.
        `last`: after the batch's replies instead (Note [broadcast] in subscriptions.py)."""
        if self._held is None:
            self._send(route, payload, None)
            return
        if last:
            self._after.append((route, payload, None))
            return
        self._held.append((route, payload, None))
        self.commit()
        self.begin()
