"""tensorbroker: share tensors between processes on one machine, with no copy.

import tensorbroker as tb
with tb.connect() as c:
    c.put("x", torch_tensor)          # one copy into the broker's shared memory
    t = c.get("x")                    # no copy: torch.from_dlpack(t), jax.numpy.from_dlpack(t)
    q = c.queue("frames", maxsize=8)  # a pipeline queue: q.put(x), q.get(), q.close()
"""

from .client.client import Client, connect
from .client.queue import Queue
from .client.tensor import Tensor
from .common.errors import (
    BrokerError,
    BrokerUnavailable,
    CapacityError,
    InvalidRequest,
    NotFound,
    ProtocolError,
    QueueClosed,
    Timeout,
)
from .launcher import BrokerProcess, start_broker

__version__ = "0.1.0"

__all__ = [
    "BrokerError",
    "BrokerProcess",
    "BrokerUnavailable",
    "CapacityError",
    "Client",
    "InvalidRequest",
    "NotFound",
    "ProtocolError",
    "Queue",
    "QueueClosed",
    "Tensor",
    "Timeout",
    "connect",
    "start_broker",
]
