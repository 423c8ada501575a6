"""ZeroMQ with pickle protocol 5 and out-of-band buffers: handoff only.

The producer pickles the array with `buffer_callback` (the header holds no data) and sends
header and buffers as one multipart message, `copy=False`, PUSH to PULL over ipc://; the
consumer unpickles over the received frames (no copy in Python; the kernel socket copies).
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import zmq

from .base import HANDOFF_TIMEOUT, Consumer, System


def _consumer(conn: Connection, address: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(HANDOFF_TIMEOUT * 1000))
    sock.connect(address)
    conn.send("ready")
    while conn.recv() is not None:
        conn.send("armed")
        frames = sock.recv_multipart(copy=False)
        value = pickle.loads(frames[0].buffer, buffers=[f.buffer for f in frames[1:]])
        received = time.perf_counter()
        del value, frames
        conn.send(received)
    sock.close()
    ctx.term()


class ZmqPickle5(System):
    name = "zmq_pickle5"
    scenarios = frozenset({"handoff"})

    def __init__(self) -> None:
        super().__init__()
        self._tmp: str | None = None
        self._ctx: zmq.Context[Any] | None = None
        self._sock: zmq.Socket[Any] | None = None
        self._consumer: Consumer | None = None

    def setup(self) -> dict[str, Any]:
        self._tmp = tempfile.mkdtemp(prefix="tbb-zmq-")
        address = f"ipc://{os.path.join(self._tmp, 'push.sock')}"
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._consumer = Consumer(_consumer, (address,))
        return {"pyzmq": zmq.__version__, "libzmq": zmq.zmq_version()}

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def handoff_once(self, array: np.ndarray[Any, Any]) -> float:
        assert self._consumer is not None and self._sock is not None
        self._consumer.arm("go")
        t0 = time.perf_counter()
        buffers: list[pickle.PickleBuffer] = []
        header = pickle.dumps(array, protocol=5, buffer_callback=buffers.append)
        self._sock.send_multipart([header, *(b.raw() for b in buffers)], copy=False)
        return self._consumer.received_at() - t0
