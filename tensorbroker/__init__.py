"""tensorbroker: share tensors between processes on one machine, with no copy.

import tensorbroker as tb
with tb.connect() as c:
    c.put("x", torch_tensor)          # one copy into the broker's shared memory
    t = c.get("x")                    # no copy: torch.from_dlpack(t), jax.numpy.from_dlpack(t)
    q = c.queue("frames", maxsize=8)  # a pipeline queue: q.put(x), q.get(), q.close()

asyncio: `async with tb.aio.connect() as c:` with `await c.put(...)`, `await c.get(...)`.

The names below load on first use (PEP 562): `import tensorbroker` costs nothing, and the
broker (`tensorbroker.server`) never loads the client.

Errors, all from tensorbroker/common/errors.py:

    BrokerError
     ├── BrokerUnavailable        no broker at the address, or it exited
     ├── Timeout (TimeoutError)   a wait ran out
     ├── NotFound (KeyError)      no such key
     ├── CapacityError            the memory is full
     ├── InvalidRequest (ValueError)
     ├── ProtocolError            a message the other side could not read
     ├── QueueClosed              the queue ended
     └── PeerUnavailable          the key lives on a node of the cluster that is down
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_WHERE = {
    "BrokerError": ".common.errors",
    "BrokerUnavailable": ".common.errors",
    "CapacityError": ".common.errors",
    "InvalidRequest": ".common.errors",
    "NotFound": ".common.errors",
    "ProtocolError": ".common.errors",
    "QueueClosed": ".common.errors",
    "PeerUnavailable": ".common.errors",
    "Timeout": ".common.errors",
    "BrokerProcess": ".launcher",
    "start_broker": ".launcher",
    "Client": ".client.client",
    "connect": ".client.client",
    "KeyEvent": ".client.client",
    "Queue": ".client.queue",
    "Subscription": ".client.queue",
    "Tensor": ".client.tensor",
}

__all__ = [
    "BrokerError",
    "BrokerProcess",
    "BrokerUnavailable",
    "CapacityError",
    "Client",
    "InvalidRequest",
    "KeyEvent",
    "NotFound",
    "ProtocolError",
    "Queue",
    "QueueClosed",
    "PeerUnavailable",
    "Subscription",
    "Tensor",
    "Timeout",
    "connect",
    "start_broker",
]

if TYPE_CHECKING:  # what type checkers and editors see; at run time, __getattr__ below
    from .client.client import Client as Client
    from .client.client import KeyEvent as KeyEvent
    from .client.client import connect as connect
    from .client.queue import Queue as Queue
    from .client.queue import Subscription as Subscription
    from .client.tensor import Tensor as Tensor
    from .common.errors import BrokerError as BrokerError
    from .common.errors import BrokerUnavailable as BrokerUnavailable
    from .common.errors import CapacityError as CapacityError
    from .common.errors import InvalidRequest as InvalidRequest
    from .common.errors import NotFound as NotFound
    from .common.errors import PeerUnavailable as PeerUnavailable
    from .common.errors import ProtocolError as ProtocolError
    from .common.errors import QueueClosed as QueueClosed
    from .common.errors import Timeout as Timeout
    from .launcher import BrokerProcess as BrokerProcess
    from .launcher import start_broker as start_broker


def __getattr__(name: str) -> Any:
    if name == "aio":  # the asyncio client, a module: tb.aio.connect()
        return importlib.import_module(".aio", __name__)
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'tensorbroker' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # found once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
