"""tensorbroker's asyncio client: `tb.aio.connect()` (see client/aio.py)."""

from .client.aio import AsyncClient, connect
from .client.aio_queue import AsyncQueue

__all__ = ["AsyncClient", "AsyncQueue", "connect"]
