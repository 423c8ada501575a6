"""The calls that look at a broker as a whole: objects and queues listed, a queue removed,
its clients, its counters, a ping. Part of `Client` (client.py), which sends them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..common.protocol import Op
from .connection import REQUEST_TIMEOUT


class Admin:
    """What `tensorbroker ls`, `top` and `stat` use, as any program may."""

    def _call(self, op: str, wait: float | None = REQUEST_TIMEOUT, **fields: Any) -> dict[str, Any]:
        raise NotImplementedError  # (Client's)

    def list_objects(
        self, prefix: str = "", largest: int | None = None, page_size: int = 10_000
    ) -> Iterator[dict[str, Any]]:
        """The objects under `prefix`, in key order (or the `largest` ones, largest first),
        each a dict: key, version, nbytes, device, leases (readers holding it), bundle,
        tensors ([name, dtype, shape] each), evictable. Asks a page (at most 10,000) at a
        time, so a huge store is listed as it goes (keys put meanwhile may or may not show)."""
        if largest is not None:
            yield from self._call(Op.LIST, prefix=prefix, by="size", limit=largest)["objects"]
            return
        after: str | None = None
        while True:
            fields: dict[str, Any] = {"prefix": prefix, "limit": page_size}
            if after is not None:
                fields["after"] = after
            page = self._call(Op.LIST, **fields)
            yield from page["objects"]
            if not page["more"] or not page["objects"]:
                return
            after = page["objects"][-1]["key"]

    def list_queues(self) -> list[dict[str, Any]]:
        """Every queue not yet ended, each a dict: name, depth (items waiting), maxsize,
        in_flight, closed, consumers and producers waiting, subscribers (None: not a
        broadcast queue)."""
        return list(self._call(Op.QLIST)["queues"])

    def delete_queue(self, name: str) -> None:
        """Remove queue `name` now: its consumers get QueueClosed (waiting ones at once), the
        items waiting in it are freed, and the name may start a new queue. NotFound if there
        is none. Items consumers hold stay theirs until they let go."""
        self._call(Op.QDELETE, name=name)

    def clients(self) -> list[dict[str, Any]]:
        """The broker's clients, each a dict: pid, uid (None where the kernel cannot say),
        sockets, leases, held_bytes, parked (requests waiting), closed, idle_s."""
        return list(self._call(Op.CLIENTS)["clients"])

    def stats(self) -> dict[str, Any]:
        """Broker counters: capacity_bytes, used_bytes, objects, clients, leases, ..."""
        reply = self._call(Op.STATS)
        return {k: v for k, v in reply.items() if k not in ("id", "ok")}

    def ping(self) -> dict[str, Any]:
        reply = self._call(Op.PING)
        return {k: v for k, v in reply.items() if k not in ("id", "ok")}
