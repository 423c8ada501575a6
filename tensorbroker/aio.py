"""tensorbroker's asyncio client: `tb.aio.connect()` (see client/aio.py)."""

from .client.aio import AsyncClient, AsyncQueue, connect

__all__ = ["AsyncClient", "AsyncQueue", "connect"]
