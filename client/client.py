"""`Client`: put, get, create, delete and friends, over a broker's shared memory.

The public API only (with admin.py's calls that look at the broker as a whole, and
queues.py's that open queues). Beneath it, as layers: the connection (connection.py: hello, calls;
leases.py: releases, the release thread) and the transfer of bytes (transfer.py: copies,
in-place writes; reads.py: Tensors and their leases). `Queue` uses the same two layers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Literal, NamedTuple, overload

from ..common.cudart import parse_device
from ..common.errors import BrokerError, BrokerUnavailable, InvalidRequest, NotFound, Timeout
from ..common.protocol import Op
from .admin import Admin
from .connection import RECONNECT_TIMEOUT, REQUEST_TIMEOUT, Connection
from .cuda import DeviceLink
from .queues import Queues
from .reads import Item
from .tensor import Tensor
from .transfer import Transfer
from .transport import waits

log = logging.getLogger(__name__)


class KeyEvent(NamedTuple):
    """What `watch_prefix` yields: a put or a delete of a key, or that some were missed."""

    event: str  # "put", "delete" or "overflowed"
    key: str | None
    version: int | None


class Client(Admin, Queues):
    """A connection to one broker. Use `tb.connect()` to make one; close it, or use `with`."""

    _conn: Connection | None = None  # class-level default: a half-built Client can be closed
    _closed = True

    def __init__(
        self,
        address: str | None = None,
        timeout: float = 5.0,
        reconnect_timeout: float = RECONNECT_TIMEOUT,
        server_key: str | None = None,
    ) -> None:
        devices = DeviceLink()
        self._conn = Connection(address, timeout, devices.settle, reconnect_timeout, server_key)
        devices.ask_through(self._conn)  # for the descriptors of VMM chunks
        self._transfer = Transfer(self._conn, devices)
        self.address = self._conn.address
        self._closed = False

    # -- the public API --------------------------------------------------------------------

    @overload
    def put(
        self,
        key: str,
        value: Any,
        *,
        device: Any = ...,
        copy: bool = ...,
        wait: Literal[True] = ...,
        evictable: bool = ...,
    ) -> int: ...
    @overload
    def put(
        self,
        key: str,
        value: Any,
        *,
        device: Any = ...,
        copy: bool = ...,
        wait: bool,
        evictable: bool = ...,
    ) -> int | None: ...
    def put(
        self,
        key: str,
        value: Any,
        *,
        device: Any = None,
        copy: bool = False,
        wait: bool = True,
        evictable: bool = False,
    ) -> int | None:
        """Store a tensor, or a bundle (a dict of name -> tensor), under `key`; return its
        version. One copy into the broker's memory; readers of an older version keep theirs.

        wait=False returns None once the copy is done and the seal is sent, without waiting
        for the broker: this client's puts still apply in the order they were made, a later
        get, exists or delete of `key` by this client sees it, and an error of it (with the
        key) is raised by this client's next call, or by `flush()`.

        The object is stored on its tensors' device: host shared memory, or GPU memory for
        CUDA tensors (then put returns once the copy is enqueued on the tensor's stream, not
        finished). `device=` stores it elsewhere ('cpu', 'cuda:N'), only with copy=True.

        evictable=True lets the broker delete it to make room when its memory is full, least
        recently used first and never while someone holds it (host objects only).
        """
        more = {"evictable": True} if evictable else {}
        return self._transfer.write(
            key, value, Op.PUT, REQUEST_TIMEOUT, device, copy, wait, key=key, **more
        )

    def flush(self) -> None:
        """Wait until every put of this client is applied; raise the first error of one that
        did not wait (with its key)."""
        self._transfer.writes.flush()

    def get(
        self, key: str, timeout: float | None = 0.0, *, device: Any = None, copy: bool = False
    ) -> Item:
        """The current version of `key`: a Tensor, or a dict of them for a bundle.

        timeout=0 (the default) raises NotFound at once if the key does not exist; a number
        waits that many seconds for it to be put (then Timeout); None waits as long as it
        takes. No copy: the result reads the broker's memory, on the device it is stored on.
        `device=` asks for it on a given device: if it is stored elsewhere, that takes
        copy=True (then the result is a private copy).
        """
        timeout, wait = waits(timeout)
        want = None if device is None else parse_device(device, f"get {key!r}")
        self._transfer.writes.settle(key)  # this client's put of it, if still on its way
        result = self._transfer.reads.read_directly(key)
        if result is None:  # not listed (or not yet there): the broker answers, or waits
            result = self._transfer.reads.read(self._get(wait, key=key, timeout=timeout))
        return self._transfer.reads.move(key, result, want, copy)

    def get_many(self, keys: Sequence[str], timeout: float | None = 0.0) -> dict[str, Item]:
        """The current version of each of `keys`, as `get` gives them: key -> Tensor (or dict
        of them for a bundle). Keys listed in the broker's directory are read without asking
        it; the rest take one request, which waits up to `timeout` seconds (None: as long as
        it takes) for all of them. Raises NotFound (timeout=0) or Timeout naming the keys
        missing."""
        keys = list(keys)
        if len(set(keys)) != len(keys):
            raise InvalidRequest(f"get_many: keys must be distinct, got {keys!r:.200}")
        writes = self._transfer.writes
        if writes.outstanding:  # this client's puts of them, if still on their way
            for key in keys:
                writes.settle(key)
        items = self._transfer.reads.read_many(keys)
        if len(items) == len(keys):  # all read from the directory (in the order asked)
            return items
        missing = [key for key in keys if key not in items]
        if missing and timeout != 0.0:
            self.wait(missing, timeout=timeout)
        for key in missing:
            item = self._transfer.reads.read_directly(key)
            if item is None:  # not listed: its descriptor is too big, or it went again
                with contextlib.suppress(NotFound):
                    reply = self._call(Op.GET, key=key, timeout=0.0)
                    item = self._transfer.reads.move(
                        key, self._transfer.reads.read(reply), None, False
                    )
            if item is not None:
                items[key] = item
        absent = [k for k in keys if k not in items]
        if absent:
            shown = ", ".join(map(repr, absent[:10])) + (", ..." if len(absent) > 10 else "")
            if timeout == 0.0:
                raise NotFound(f"get_many: no object {shown} ({len(absent)} of {len(keys)})")
            raise Timeout(
                f"get_many: {shown} ({len(absent)} of {len(keys)}) not put within {timeout}s"
            )
        return {key: items[key] for key in keys}

    def wait(
        self, keys: Sequence[str], num: int | None = None, timeout: float | None = None
    ) -> list[str]:
        """Wait until `num` of `keys` (default: all of them) exist, or `timeout` seconds pass
        (None: as long as it takes); return the keys that exist then, in the order given.
        Never raises Timeout: fewer than `num` keys come back instead. One request."""
        keys = list(keys)
        num = len(keys) if num is None else num
        if not keys:
            return []
        timeout, wait = waits(timeout)
        for key in keys:
            self._transfer.writes.settle(key)
        reply = self._call(Op.WAIT, keys=keys, num=num, timeout=timeout, wait=wait)
        return list(reply["keys"])

    def watch(self, key: str, timeout: float | None = None) -> Iterator[Item | None]:
        """Follow `key`: yield its current version (once it exists), then each newer one as
        it is sealed, for as long as the caller iterates; None when the key is deleted (or
        evicted) after a version it yielded, and then the next version put.

        It follows the key's state, not each event: a slow watcher skips to the newest
        version instead of queueing stale ones, and a delete and a put made while it was not
        looking show as the new version alone (`watch_prefix` yields every put and delete).
        A bundle always comes whole. `timeout` bounds each wait for a newer version (then
        Timeout); None waits as long as it takes. Each item is a `get`: zero copy, leased.
        """
        timeout, wait = waits(timeout)
        self._transfer.writes.settle(key)
        seen, deletes = 0, False  # deletes: a version was yielded since the last None
        while True:
            more = {"deletes": True} if deletes else {}
            reply = self._get(wait, key=key, timeout=timeout, after=seen, **more)
            if reply.get("deleted"):
                deletes = False
                yield None
                continue
            seen, deletes = reply["version"], True
            yield self._transfer.reads.read(reply)

    def watch_prefix(self, prefix: str, timeout: float | None = None) -> Iterator[KeyEvent]:
        """Follow every put and delete of a key starting with `prefix` ("" for all), from
        now: yields KeyEvent("put" or "delete", key, version), in the order the broker
        applied them. A watcher that keeps up misses none; one that falls far behind (or
        whose broker restarted) gets KeyEvent("overflowed", None, None) and goes on from
        then. `timeout` bounds each wait for the next event (then Timeout); None waits as
        long as it takes. Where "now" is, is fixed before this returns; in a cluster, the
        puts on other nodes come from when they heard of the prefix (one trip after the
        first `watch_prefix` of it on this node). An eviction is a "delete"; `watch` of one
        key sees deletes too (it yields None)."""
        timeout, wait = waits(timeout)
        start = self._call(Op.WATCH_PREFIX, prefix=prefix)

        def follow(after: int, run: int) -> Iterator[KeyEvent]:
            while True:
                reply = self._call(
                    Op.WATCH_PREFIX, prefix=prefix, after=after, run=run, timeout=timeout,
                    wait=wait,
                )  # fmt: skip
                if reply.get("overflowed"):
                    yield KeyEvent("overflowed", None, None)
                for _, event, key, version in reply["events"]:
                    yield KeyEvent(event, key, version)
                after, run = reply["next"], reply["run"]

        return follow(start["next"], start["run"])

    def create(
        self, key: str, shape: Sequence[int], dtype: Any, device: Any = "cpu"
    ) -> contextlib.AbstractContextManager[Tensor]:
        """Write an object in place: yields a writable Tensor over its memory (host shared
        memory, or a GPU's for device='cuda:N').

        Sealed (published) when the block exits; aborted if it raises. On a GPU, readers are
        ordered after the writes enqueued by then on the streams the buffer was taken on
        (torch.from_dlpack(buf), buf.torch(), ...).
        """
        return self._transfer.create(key, shape, dtype, device, Op.PUT, REQUEST_TIMEOUT, key=key)

    def delete(self, key: str) -> None:
        """Remove `key`; NotFound if absent. Readers keep their bytes until they let go."""
        self._transfer.writes.settle(key)
        self._call(Op.DELETE, key=key)

    def exists(self, key: str) -> bool:
        """Whether `key` has a version now (this client's own put of it still out counted:
        read your writes), on this node or, in a cluster, on any node."""
        self._transfer.writes.settle(key)
        return bool(self._call(Op.EXISTS, key=key)["exists"])

    def keys(self) -> list[str]:
        """Every key with a version now (in a cluster, every node's).
        `list_objects` pages through them with their sizes."""
        return list(self._call(Op.KEYS)["keys"])

    # -- plumbing --------------------------------------------------------------------------

    def _call(self, op: str, wait: float | None = REQUEST_TIMEOUT, **fields: Any) -> dict[str, Any]:
        assert self._conn is not None
        return self._conn.call(op, wait, **fields)

    def _get(self, wait: float | None, **fields: Any) -> dict[str, Any]:
        """A get that may wait in the broker; if given up, an answer that comes anyway is
        let go."""
        assert self._conn is not None
        return self._conn.call(Op.GET, wait, late=self._transfer.reads.let_go, **fields)

    # -- closing ---------------------------------------------------------------------------

    def close(self) -> None:
        """Send what releases are due and disconnect. Idempotent.

        Arrays still alive from this client keep their memory (and their leases) until the
        process exits.
        """
        conn = self._conn
        if self._closed or conn is None or os.getpid() != conn.pid:
            if conn is not None and os.getpid() == conn.pid:
                conn.close()  # a half-built Client: its sockets
            return
        self._closed = True
        failed: BrokerError | None = None
        writes = self._transfer.writes
        try:
            if not conn.broker_exited() and not conn.broken:  # (a broker gone: nothing to wait
                writes.flush()  # for) before bye, which another socket carries
        except BrokerUnavailable:
            pass
        except BrokerError as exc:
            failed = exc
        if writes.outstanding:
            log.warning(
                "%d puts that did not wait may be lost: the broker at %s exited before it "
                "answered them", writes.outstanding, self.address,
            )  # fmt: skip
        conn.stop_releasing()
        try:
            self._transfer.finish()  # (asks the broker: a Ctrl-C here still closes the rest)
        finally:
            self._transfer.writes.close()
            conn.close()
            self._transfer.close()
        if failed is not None:  # a put that did not wait failed: say so, once closed
            raise failed

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        conn = self._conn
        if not self._closed and conn is not None and os.getpid() == conn.pid:
            warnings.warn(
                f"unclosed tensorbroker Client of {self.address}", ResourceWarning, stacklevel=1
            )
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<tb.Client {self.address} {state}>"


def connect(
    address: str | None = None,
    timeout: float = 5.0,
    reconnect_timeout: float = RECONNECT_TIMEOUT,
    server_key: str | None = None,
) -> Client:
    """Connect to a broker: `address`, else $TENSORBROKER_ADDRESS, else the default socket.
    A tcp:// broker that serves with keys needs its public key: `server_key` (40 characters,
    or the path of its .key file), else $TENSORBROKER_SERVER_KEY (common/curve.py).

    Raises BrokerUnavailable (naming the address) if no broker answers within `timeout`.
    If the broker exits, the client waits up to `reconnect_timeout` seconds for a broker to
    come back at the same address and goes on with it: its arrays stay readable, its leases
    carry over, and calls in flight are sent again where that is safe (others raise
    BrokerUnavailable saying what may be lost). 0: a broker that exits breaks the client.
    """
    return Client(address, timeout, reconnect_timeout, server_key)
