"""The floors: what no broker can beat on this machine.

zmq_floor: a single-threaded Python ROUTER that unpacks each msgpack request and answers a
reply shaped like a get's descriptor, and DEALER clients over ipc:// (the broker's
transport). Its get row is one round trip; its throughput row is the echo broker's rate.
copyto_floor: one `numpy.copyto` into a destination whose pages are already touched (the
copy a put cannot avoid).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import time
from typing import Any

import msgpack
import numpy as np
import zmq

from .base import POOL_SIZE, ClientPool, System, touched_like

REPLY = {
    "ok": True,
    "key": "get",
    "version": 1,
    "lease": 1,
    "segment": "tb-12345-0123456789abcdef",
    "offset": 4096,
    "dtype": "float32",
    "shape": [1024],
    "strides": [4],
}


def _echo_server(address: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    while True:
        route, payload = sock.recv_multipart()
        request = msgpack.unpackb(payload)
        sock.send_multipart([route, msgpack.packb({**REPLY, "id": request["id"]})])


class EchoClient:
    """A DEALER to the echo server: one `get` is one request and its reply."""

    def __init__(self, index: int, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.next_id = 0
        self.ops = {"get": self.get}

    def get(self) -> None:
        self.next_id += 1
        self.sock.send(msgpack.packb({"op": "get", "id": self.next_id, "key": "get"}))
        reply = msgpack.unpackb(self.sock.recv())
        assert reply["id"] == self.next_id

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


class ZmqFloor(System):
    name = "zmq_floor"
    scenarios = frozenset({"get", "throughput_get"})

    def __init__(self) -> None:
        super().__init__()
        self._tmp: str | None = None
        self._server: Any = None
        self._client: EchoClient | None = None
        self._pool: ClientPool | None = None

    def setup(self) -> dict[str, Any]:
        self._tmp = tempfile.mkdtemp(prefix="tbb-echo-")
        address = f"ipc://{os.path.join(self._tmp, 'echo.sock')}"
        self._server = mp.get_context("spawn").Process(
            target=_echo_server, args=(address,), daemon=True
        )
        self._server.start()
        self._client = EchoClient(-1, address)
        self._pool = ClientPool("systems.floors:EchoClient", (address,), POOL_SIZE)
        return {"pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(), "msgpack": _msgpack()}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._server is not None:
            self._server.kill()
            self._server.join()
            self._server = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def prepare_get(self, array: np.ndarray[Any, Any]) -> None:
        pass  # the echo server stores nothing: the round trip is the same for every size

    def get_once(self) -> float:
        assert self._client is not None
        t0 = time.perf_counter()
        self._client.get()
        return time.perf_counter() - t0

    def throughput(self, mode: str, clients: int, duration: float) -> float:
        assert self._pool is not None
        return self._pool.run(mode, clients, duration)


def _msgpack() -> str:
    return ".".join(str(part) for part in msgpack.version)


class CopytoFloor(System):
    name = "copyto_floor"
    scenarios = frozenset({"put", "handoff"})

    def __init__(self) -> None:
        super().__init__()
        self._dst: np.ndarray[Any, Any] | None = None

    def setup(self) -> dict[str, Any]:
        return {"numpy": np.__version__}

    def close(self) -> None:
        self._dst = None

    def put_once(self, array: np.ndarray[Any, Any]) -> float:
        if self._dst is None or self._dst.shape != array.shape:
            self._dst = None
            self._dst = touched_like(array)
        t0 = time.perf_counter()
        np.copyto(self._dst, array)
        return time.perf_counter() - t0

    def handoff_once(self, array: np.ndarray[Any, Any]) -> float:
        return self.put_once(array)
