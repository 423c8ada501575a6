"""The leases a client's process holds, and their releases: queued by finalisers and sent in
batches, on the next call (connection.py) or by the release thread when the client is idle
(that thread also sends heartbeats to a broker that cannot watch this process, comes back to
a broker that exited, and runs `on_idle`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import zmq

from ..common.errors import BrokerError, BrokerUnavailable
from ..common.protocol import MAX_RELEASES, Op
from .transport import BrokerExited, Channel, ChannelPool

log = logging.getLogger(__name__)

RELEASE_WINDOW = 0.005  # releases wait at most this long for a request to carry them ...
RELEASE_IDLE_WINDOW = 0.1  # ... or this long, in a client that has been idle
# Calls whose answer from a broker that died, come after the hello to the next one, is let
# go and asked for again (`Leases.leased`)
ASKED_AGAIN = frozenset({Op.GET, Op.QGET})
RETRY_IDLE = 1.0  # seconds between the release thread's looks for a broker that did not come back


class Leases:
    """The leases this process holds (`held`), the lease ids let go of (`releases`) and the
    ring slots found idle (`done`), until a message carries them to the broker."""

    def __init__(self) -> None:
        self.releases: queue.SimpleQueue[int] = queue.SimpleQueue()
        # Ring slots found idle, (queue id, version), for the broker (Note [broadcast ring]).
        self.done: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self.held: dict[int, int] = {}  # lease id -> object id, claimed again after a restart
        self._lock = threading.Lock()  # (`hold_put` against `resume`)
        self.epoch = 0  # resume hellos said: a reply is of the broker of its request's epoch

    def hold(self, lease: int, oid: int) -> None:
        """This process holds `lease` on object `oid` (claimed again if the broker restarts);
        it ends when the lease id is released, or `forget`."""
        self.held[lease] = oid

    def leased(self, reply: dict[str, Any], epoch: int, again: bool) -> bool:
        """Hold the lease `reply` brings (a get's, a queue get's), the answer to a call sent
        at `epoch`, while the call is still named in the hello to a broker that restarts
        (Connection.in_flight): that hello names the call, or lists the lease (held after,
        a queue item's lease was in neither, and the new broker freed the item under the
        consumer's array). If a hello went since the call was sent, the answer is the
        broker's that died, and the new one does not know the lease: it frees a key's
        version once replaced, and keeps a queue item for the call until the session ends.
        Then, if `again` (ASKED_AGAIN), False: the lease is let go, and the caller asks the
        new broker again (the same item, for a queue get: Adoption.retake)."""
        if "lease" not in reply or "oid" not in reply:
            return True
        if self._hold_at(reply["lease"], reply["oid"], epoch):
            return True
        if again:
            self.releases.put(reply["lease"])
            return False
        self.hold(reply["lease"], reply["oid"])
        return True

    def hold_put(self, put: int, oid: int, epoch: int) -> bool:
        """Hold the block of `put` (a grant, or a put's memory), which the reply to a request
        sent at `epoch` brought (read before the request went); False, and the put let go,
        if a hello to a broker that restarted listed what this process holds since: the
        reply may be the broker's that died, the new one aborts such a put, and its seal
        would be answered as one sealed and freed since (`sealed_before` in
        server/adoption.py): the item lost. The caller puts again."""
        if self._hold_at(put, oid, epoch):
            return True
        self.releases.put(put)  # (a put of the broker of now, if it was: aborted)
        return False

    def _hold_at(self, lease: int, oid: int, epoch: int) -> bool:
        """Hold `lease` if no resume hello went since `epoch` (atomic with `resume`)."""
        with self._lock:
            if epoch == self.epoch:
                self.held[lease] = oid
                return True
        return False

    def resume(self) -> list[int]:
        """What this process holds, for the hello to a broker that restarted: [lease id,
        object id, ...]. A put a reply brings is held only if its request went after."""
        with self._lock:
            self.epoch += 1
            return [n for pair in list(self.held.items()) for n in pair]

    def forget(self, lease: int) -> None:
        self.held.pop(lease, None)

    def drain(self) -> list[int]:
        """The lease ids queued now (no longer held), as many as one message may carry: the
        rest go with the next."""
        out: list[int] = []
        while not self.releases.empty() and len(out) < MAX_RELEASES:  # cheaper than Empty
            try:
                lease = self.releases.get_nowait()
            except queue.Empty:  # another thread took the last one
                break
            self.held.pop(lease, None)
            out.append(lease)
        return out

    def message(self) -> dict[str, Any] | None:
        """A one-way message with the releases and idle ring slots queued now; None if none."""
        ids = self.drain()
        slots: list[int] = []
        while not self.done.empty() and len(slots) < MAX_RELEASES:
            try:
                slots.extend(self.done.get_nowait())
            except queue.Empty:
                break
        if not ids and not slots:
            return None
        message: dict[str, Any] = {"op": Op.RELEASE, "id": 0, "rel": ids}
        if slots:
            message["done"] = slots
        return message

    def send_all(self, channel: Channel) -> list[int]:
        """Send what is queued over `channel`, but for the last releases: those, to go with
        the bye."""
        while message := self.message():
            if len(message["rel"]) < MAX_RELEASES and "done" not in message:
                last: list[int] = message["rel"]
                return last
            channel.send(message)
        return []


class Link(Protocol):
    """What the release thread asks of its connection (`Connection` in connection.py)."""

    @property
    def generation(self) -> int: ...

    def broker_exited(self) -> bool: ...

    def reconnect(self, generation: int, window: float | None = None) -> None: ...

    def new_channel(self) -> Channel: ...


class ReleaseThread:
    """The release thread of one connection, and how to stop it. It holds the leases and a
    socket of its own, and the connection only weakly, so that an unclosed Client can still
    be collected (and warn)."""

    def __init__(
        self, connection: Callable[[], Link | None], leases: Leases, heartbeat: float | None,
        channel: Channel, pool: ChannelPool, on_idle: Callable[[], None], name: str,
    ) -> None:  # fmt: skip
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_flush_releases,
            args=(connection, leases, self._stop, heartbeat, channel, pool, on_idle),
            daemon=True,
            name=name,
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)


def _flush_releases(
    connection: Callable[[], Link | None],
    leases: Leases,
    stop: threading.Event,
    heartbeat: float | None,
    channel: Channel,
    pool: ChannelPool,
    on_idle: Callable[[], None],
) -> None:
    """The release thread: send the releases no request carried within RELEASE_WINDOW, and
    heartbeats if the broker asked for them.

    It looks at the queue on a timer and never blocks on it: a thread blocked in
    `SimpleQueue.get` is woken by every put and then fights the caller for the GIL, which
    cost a busy client about 35 us per get.
    """
    delay, last_sent = RELEASE_WINDOW, time.monotonic()
    generation, exited, gave_up = 0, False, False
    try:
        while not stop.wait(delay):
            conn = connection()
            if conn is None:
                break
            if exited or conn.broker_exited() or conn.generation != generation:
                try:  # come back now, not at the next call: the new broker waits for us
                    conn.reconnect(generation, window=0 if gave_up else None)
                    generation = conn.generation
                    fresh = conn.new_channel()
                except BrokerExited:  # gone again: the next turn waits for the next one
                    exited = True
                    del conn
                    continue
                except BrokerUnavailable:  # none came back: look again now and then
                    exited, gave_up, delay = True, True, RETRY_IDLE
                    del conn
                    continue
                except BrokerError as exc:
                    log.warning("the release thread stopped: %s", exc)
                    break
                gave_up = False
                pool.discard(channel)
                channel, exited = fresh, False
            del conn
            try:
                on_idle()  # device leases: record their read-done events, then release them
            except Exception as exc:
                log.warning("settling device leases failed: %s", exc)
            message, now = leases.message(), time.monotonic()
            try:
                if message is not None:  # (held no more: a broker that comes back drops them)
                    channel.send(message)
                    delay, last_sent = RELEASE_WINDOW, now
                else:
                    delay = min(2 * delay, RELEASE_IDLE_WINDOW)
                    if heartbeat is not None and now - last_sent >= heartbeat:
                        channel.send({"op": Op.HEARTBEAT, "id": 0})
                        last_sent = now
            except BrokerExited:  # the next turn comes back to the broker that replaces it
                exited = True
            if heartbeat is not None:
                delay = min(delay, heartbeat)
    except zmq.ZMQError as exc:
        log.warning("the release thread stopped: %s", exc)
    finally:
        pool.discard(channel)
