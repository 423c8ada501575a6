"""`Client`: put, get, create, delete and friends, over a broker's shared memory.

Threads may share a Client: each call borrows a socket (a `Channel`) from a small pool, so a
`get` parked in the broker never blocks another thread's call. Lease releases are queued by
finalisers and sent in batches: on the next request, or by a background flusher thread
when the client is idle (that thread also sends heartbeats to a broker that cannot watch
this process).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import secrets
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import zmq

from ..common import host
from ..common.config import check_address, default_address
from ..common.cudart import STREAM_LEGACY, device_index, parse_device
from ..common.descriptors import ObjectDesc, TensorDesc
from ..common.dtypes import DType
from ..common.dtypes import dtype as lookup_dtype
from ..common.errors import BrokerError, BrokerUnavailable, InvalidRequest
from ..common.protocol import PROTOCOL_VERSION, Op
from . import placement
from .copy import Copier
from .cuda import DeviceLink
from .queue import Queue
from .shm import SegmentCache
from .sources import Source, entries
from .tensor import DeviceLease, Lease, Tensor
from .transport import BrokerExited, Channel, ChannelPool, waits

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = 30.0  # for requests the broker answers at once
RELEASE_WINDOW = 0.005  # releases wait at most this long for a request to carry them ...
RELEASE_IDLE_WINDOW = 0.1  # ... or this long, in a client that has been idle


class Client:
    """A connection to one broker. Use `tb.connect()` to make one; close it, or use `with`."""

    _closed = True  # class-level defaults: a half-built Client can still be closed
    _pid = -1
    _broker_pidfd: int | None = None

    def __init__(self, address: str | None = None, timeout: float = 5.0) -> None:
        self.address = check_address(address or default_address())
        self._pid = os.getpid()
        self._session = secrets.token_hex(16)
        self._ids = itertools.count(1)
        self._releases: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._segments = SegmentCache()
        self._devices = DeviceLink()
        self._copier = Copier()
        self._broken: str | None = None
        self._heartbeat: float | None = None
        self._pool = ChannelPool(self.address)
        self._closed = False
        try:
            self._pool.give_back(self._new_channel(timeout))
            flusher_channel = self._new_channel(timeout)
        except BaseException:
            self.close()
            raise
        # The thread holds the queue and its socket, not the Client, so an unclosed
        # Client can still be collected (and warn).
        self._stop = threading.Event()
        self._flusher = threading.Thread(
            target=_flush_releases,
            args=(
                self._releases,
                self._stop,
                self._heartbeat,
                flusher_channel,
                self._pool,
                self._devices.settle,
            ),
            daemon=True,
            name=f"tensorbroker-release-{self._session[:6]}",
        )
        self._flusher.start()

    def _new_channel(self, timeout: float) -> Channel:
        channel = self._pool.new()
        hello = {
            "op": Op.HELLO,
            "id": next(self._ids),
            "version": PROTOCOL_VERSION,
            "session": self._session,
            "pid": self._pid,
            "boot_id": host.boot_id(),
            "start_time": host.start_time(self._pid),
        }
        try:
            reply = channel.call(hello, timeout)
        except BrokerUnavailable:
            self._pool.discard(channel)
            raise BrokerUnavailable(
                f"no broker answers at {self.address} (waited {timeout:.1f}s): start one with "
                f"`tensorbroker serve --address {self.address}`, or set $TENSORBROKER_ADDRESS"
            ) from None
        except BaseException:
            self._pool.discard(channel)
            raise
        self._heartbeat = float(reply.get("heartbeat") or 0.0) or None
        if self._broker_pidfd is None and reply.get("boot_id") == host.boot_id():
            self._broker_pidfd = host.open_pidfd(reply["pid"], reply.get("start_time"))
        if self._broker_pidfd is not None:
            channel.watch_broker(self._broker_pidfd)
        return channel

    # -- the public API --------------------------------------------------------------------

    def put(self, key: str, value: Any, *, device: Any = None, copy: bool = False) -> int:
        """Store a tensor, or a bundle (a dict of name -> tensor), under `key`; return its
        version. One copy into the broker's memory; readers of an older version keep theirs.

        The object is stored on its tensors' device: host shared memory, or GPU memory for
        CUDA tensors (then put returns once the copy is enqueued on the tensor's stream, not
        finished). `device=` stores it elsewhere ('cpu', 'cuda:N'), only with copy=True.
        """
        return self._write(key, value, Op.PUT, REQUEST_TIMEOUT, device, copy, key=key)

    def get(
        self, key: str, timeout: float | None = 0.0, *, device: Any = None, copy: bool = False
    ) -> Tensor | dict[str, Tensor]:
        """The current version of `key`: a Tensor, or a dict of them for a bundle.

        timeout=0 (the default) raises NotFound at once if the key does not exist; a number
        waits that many seconds for it to be put (then Timeout); None waits as long as it
        takes. No copy: the result reads the broker's memory, on the device it is stored on.
        `device=` asks for it on a given device: if it is stored elsewhere, that takes
        copy=True (then the result is a private copy).
        """
        timeout, wait = waits(timeout)
        want = None if device is None else parse_device(device, f"get {key!r}")
        result = self._read(self._call(Op.GET, key=key, timeout=timeout, wait=wait))
        return placement.move(self, key, result, want, copy)

    def watch(self, key: str, timeout: float | None = None) -> Iterator[Tensor | dict[str, Tensor]]:
        """Follow `key`: yield its current version (once it exists), then each newer one as
        it is sealed, for as long as the caller iterates.

        A slow watcher skips to the newest version instead of queueing stale ones, and a
        bundle always comes whole. `timeout` bounds each wait for a newer version (then
        Timeout); None waits as long as it takes. Each item is a `get`: zero copy, leased.
        """
        timeout, wait = waits(timeout)
        seen = 0
        while True:
            reply = self._call(Op.GET, key=key, timeout=timeout, after=seen, wait=wait)
            seen = reply["version"]
            yield self._read(reply)

    def queue(self, name: str, maxsize: int = 0) -> Queue:
        """The pipeline queue `name`, made if it does not exist: FIFO, each item to one
        consumer. `maxsize` (0: no bound) bounds its items in flight, from a producer's put
        until the consumer lets go of the item; a put waits for a free slot. The first
        nonzero maxsize asked for a queue holds; 0 takes the queue as it is."""
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 0:
            raise InvalidRequest(
                f"queue {name!r}: maxsize must be an integer >= 0, not {maxsize!r}"
            )
        reply = self._call(Op.QOPEN, name=name, maxsize=maxsize)
        return Queue(self, name, reply["queue"], reply["maxsize"])

    # -- reading and writing, for keys and queues -------------------------------------------

    def _read(self, reply: dict[str, Any]) -> Tensor | dict[str, Tensor]:
        """The Tensors of an object descriptor the broker sent, with its lease."""
        obj = ObjectDesc.from_wire(reply)
        try:
            lease = self._lease(obj.lease, obj.tensors[0], reply, reader=True)
        except BaseException:
            self._releases.put(obj.lease)
            raise
        tensors = {t.name: Tensor(obj.key, obj.version, t, lease) for t in obj.tensors}
        return tensors if obj.bundle else tensors[""]

    def _lease(self, lease_id: int, desc: TensorDesc, reply: dict[str, Any], reader: bool) -> Lease:
        """A lease over the memory `desc` names: a mapped segment, or an opened device chunk
        with the object's events (opened once per Client)."""
        if desc.device == "cpu":
            return Lease(lease_id, self._segments.get(desc.segment), self._releases)
        index, link = device_index(desc.device), self._devices
        chunk = link.chunk(index, desc.segment, reply["handle"])
        write = link.event(index, *reply["event"])
        read = link.event(index, *reply["done"]) if reader else None
        return DeviceLease(lease_id, chunk, self._releases, link, write, read)

    def _write(
        self,
        label: str,
        value: Any,
        op: str,
        wait: float | None,
        device: Any = None,
        copy: bool = False,
        **fields: Any,
    ) -> int:
        """Put `value` through `op` (a put or a queue put): one copy, then seal."""
        items, bundle = entries(label, value)
        target, items = placement.place(self, label, items, device, copy)
        specs = [[name, dt.name, list(src.shape)] for name, src, dt in items]
        if target != "cpu":
            fields["device"] = target
        reply = self._call(op, wait=wait, tensors=specs, bundle=bundle, **fields)
        put_id = reply["put"]
        try:
            if target == "cpu":
                for (_, src, dt), wire in zip(items, reply["tensors"], strict=True):
                    assert isinstance(src, np.ndarray)  # placed on the host
                    dst = self._view(TensorDesc.from_wire(wire), dt.typestr)
                    self._copier.copy(dst, src)
            else:
                self._write_device(items, reply)
        except BaseException:
            with contextlib.suppress(BrokerError):
                self._call(Op.ABORT, put=put_id)
            raise
        version: int = self._call(Op.SEAL, put=put_id)["version"]
        return version

    def _write_device(self, items: list[tuple[str, Source, DType]], reply: dict[str, Any]) -> None:
        """Enqueue the copies into device memory on the sources' streams and record the
        object's write event after them. No host wait, except to keep a failed copy from
        running on after its memory went back to the broker."""
        wires = [TensorDesc.from_wire(w) for w in reply["tensors"]]
        index, link = device_index(wires[0].device), self._devices
        chunk = link.chunk(index, wires[0].segment, reply["handle"])
        write = link.event(index, *reply["event"])
        streams: set[int] = set()
        try:
            for (_, src, dt), desc in zip(items, wires, strict=True):
                stream = STREAM_LEGACY if isinstance(src, np.ndarray) else src.stream
                link.copy(index, chunk.address + desc.offset, src, dt, stream)
                streams.add(stream)
            stream = link.record_after(index, write, streams)
        except BaseException:
            with contextlib.suppress(Exception):  # no copy may land once the memory is reused
                link.runtime("abort").synchronize(index)
            raise
        link.keep_until_done(index, stream, [src for _, src, _ in items])

    def create(
        self, key: str, shape: Sequence[int], dtype: Any, device: Any = "cpu"
    ) -> contextlib.AbstractContextManager[Tensor]:
        """Write an object in place: yields a writable Tensor over its memory (host shared
        memory, or a GPU's for device='cuda:N').

        Sealed (published) when the block exits; aborted if it raises. On a GPU, readers are
        ordered after the writes enqueued by then on the streams the buffer was taken on
        (torch.from_dlpack(buf), buf.torch(), ...).
        """
        return self._create(key, shape, dtype, device, Op.PUT, REQUEST_TIMEOUT, key=key)

    @contextlib.contextmanager
    def _create(
        self,
        label: str,
        shape: Sequence[int],
        dtype: Any,
        device: str,
        op: str,
        wait: float | None,
        **fields: Any,
    ) -> Iterator[Tensor]:
        device = parse_device(device, f"create {label!r}")
        dt = lookup_dtype(dtype)
        specs = [["", dt.name, [int(d) for d in shape]]]
        if device != "cpu":
            fields["device"] = device
        reply = self._call(op, wait=wait, tensors=specs, **fields)
        desc = TensorDesc.from_wire(reply["tensors"][0])
        try:
            lease = self._lease(reply["put"], desc, reply, reader=False)
        except BaseException:
            self._releases.put(reply["put"])  # ends the put: the broker aborts it
            raise
        buffer = Tensor(label, 0, desc, lease, writable=True)
        try:
            yield buffer
            if isinstance(lease, DeviceLease):  # readers wait for the writes enqueued so far
                self._devices.record_after(lease.device, lease.write, lease.streams)
        except BaseException:
            if isinstance(lease, DeviceLease):  # nothing may still write once it is reused
                with contextlib.suppress(Exception):
                    self._devices.runtime("abort").synchronize(lease.device)
            if not self._closed:
                with contextlib.suppress(BrokerError):
                    self._call(Op.ABORT, put=lease.id, keep=True)
            raise
        buffer.version = self._call(Op.SEAL, put=lease.id, keep=True)["version"]

    def delete(self, key: str) -> None:
        """Remove `key`; NotFound if absent. Readers keep their bytes until they let go."""
        self._call(Op.DELETE, key=key)

    def exists(self, key: str) -> bool:
        return bool(self._call(Op.EXISTS, key=key)["exists"])

    def keys(self) -> list[str]:
        return list(self._call(Op.KEYS)["keys"])

    def stats(self) -> dict[str, Any]:
        """Broker counters: capacity_bytes, used_bytes, objects, clients, leases, ..."""
        reply = self._call(Op.STATS)
        return {k: v for k, v in reply.items() if k not in ("id", "ok")}

    def ping(self) -> dict[str, Any]:
        reply = self._call(Op.PING)
        return {k: v for k, v in reply.items() if k not in ("id", "ok")}

    # -- plumbing --------------------------------------------------------------------------

    def _view(self, desc: TensorDesc, typestr: str) -> np.ndarray[Any, Any]:
        """A writable NumPy view of a tensor being put (the mapping is held by the cache)."""
        mapping = self._segments.get(desc.segment)
        count = int(np.prod(desc.shape))
        flat = np.frombuffer(mapping.mmap, np.dtype(typestr), count, desc.offset)
        return flat.reshape(desc.shape)

    def _call(self, op: str, wait: float | None = REQUEST_TIMEOUT, **fields: Any) -> dict[str, Any]:
        self._check_usable()
        message = {"op": op, "id": next(self._ids), **fields}
        releases = _drain(self._releases)
        if releases:
            message["rel"] = releases
        channel = self._pool.borrow() or self._new_channel(REQUEST_TIMEOUT)
        try:
            return channel.call(message, wait)
        except BrokerExited as exc:
            self._broken = str(exc)
            raise
        finally:
            self._pool.give_back(channel)

    def _check_usable(self) -> None:
        if os.getpid() != self._pid:
            raise BrokerError(
                f"this Client was made in process {self._pid} and cannot be used in a forked "
                "child: call tb.connect() in the child (or use the spawn start method)"
            )
        if self._closed:
            raise BrokerError(f"this Client of {self.address} is closed")
        if self._broken:
            raise BrokerUnavailable(self._broken)

    # -- closing ---------------------------------------------------------------------------

    def close(self) -> None:
        """Send what releases are due and disconnect. Idempotent.

        Arrays still alive from this client keep their memory (and their leases) until the
        process exits.
        """
        if self._closed or os.getpid() != self._pid:
            return
        self._closed = True
        flusher = getattr(self, "_flusher", None)
        if flusher is not None:
            self._stop.set()
            flusher.join(timeout=5.0)
        with contextlib.suppress(Exception):
            self._devices.drain()  # the copies of its puts have run, so the objects hold them
            self._devices.settle()  # read-done events of leases let go of since its last look
        idle = self._pool.close()
        if idle and not self._broken:
            bye = {"op": Op.BYE, "id": 0, "keep_leases": True, "rel": _drain(self._releases)}
            with contextlib.suppress(zmq.ZMQError):
                idle[0].send(bye)
        for channel in idle:
            self._pool.discard(channel)
        self._segments.clear()
        self._devices.clear()
        self._copier.close()
        fd, self._broker_pidfd = self._broker_pidfd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not self._closed and os.getpid() == getattr(self, "_pid", None):
            warnings.warn(
                f"unclosed tensorbroker Client of {self.address}", ResourceWarning, stacklevel=1
            )
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<tb.Client {self.address} {state}>"


def _drain(releases: queue.SimpleQueue[int]) -> list[int]:
    """The lease ids queued now."""
    out: list[int] = []
    while not releases.empty():  # cheaper than waiting for queue.Empty on the hot path
        try:
            out.append(releases.get_nowait())
        except queue.Empty:  # another thread took the last one
            break
    return out


def _flush_releases(
    releases: queue.SimpleQueue[int],
    stop: threading.Event,
    heartbeat: float | None,
    channel: Channel,
    pool: ChannelPool,
    settle: Callable[[], None],
) -> None:
    """The flusher thread: send the releases no request carried within RELEASE_WINDOW, and
    heartbeats if the broker asked for them.

    It looks at the queue on a timer and never blocks on it: a thread blocked in
    `SimpleQueue.get` is woken by every put and then fights the caller for the GIL, which
    cost a busy client about 35 us per get.
    """
    delay, last_sent = RELEASE_WINDOW, time.monotonic()
    try:
        while not stop.wait(delay):
            try:
                settle()  # device leases: record their read-done events, then release them
            except Exception as exc:
                log.warning("settling device leases failed: %s", exc)
            ids, now = _drain(releases), time.monotonic()
            if ids:
                channel.send({"op": Op.RELEASE, "id": 0, "rel": ids})
                delay, last_sent = RELEASE_WINDOW, now
            else:
                delay = min(2 * delay, RELEASE_IDLE_WINDOW)
                if heartbeat is not None and now - last_sent >= heartbeat:
                    channel.send({"op": Op.HEARTBEAT, "id": 0})
                    last_sent = now
            if heartbeat is not None:
                delay = min(delay, heartbeat)
    except zmq.ZMQError as exc:
        log.warning("the release thread stopped: %s", exc)
    finally:
        pool.discard(channel)


def connect(address: str | None = None, timeout: float = 5.0) -> Client:
    """Connect to a broker: `address`, else $TENSORBROKER_ADDRESS, else the default socket.

    Raises BrokerUnavailable (naming the address) if no broker answers within `timeout`.
    """
    return Client(address, timeout)
