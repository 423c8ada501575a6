"""The descriptors of a device's VMM chunks, given to the clients that ask (Note [device
handles] in devices.py): the `chunk` request, answered over the client's lane with the
chunk's file descriptor passed alongside (SCM_RIGHTS)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...common.errors import InvalidRequest
from ...common.protocol import Request, reply_ok
from .devices import DeviceMemory
from .records import Session


class ChunkFds:
    """Answers `chunk`: `send(route, payload, fd)` sends a reply with a descriptor (the
    Outbox's), `is_lane(route)` says whether the request came on a lane (Endpoint's)."""

    def __init__(
        self,
        devices: DeviceMemory,
        send: Callable[[bytes, bytes, int | None], None],
        is_lane: Callable[[bytes], bool],
    ) -> None:
        self.devices, self.send, self.is_lane = devices, send, is_lane

    def chunk(self, session: Session, route: bytes, req: Request) -> dict[str, Any] | None:
        """The descriptor of chunk `segment` of `device`, for a client that passed hello (its
        user is this broker's, or a member of its --group: Sessions.hello checked)."""
        device, name = req.fields["device"], req.fields["segment"]
        if not device.startswith("cuda:"):
            raise InvalidRequest(f"chunk: a chunk is a GPU's (cuda:N), not {device!r}'s")
        arena = self.devices.arena(device)  # (InvalidRequest if it is not served)
        try:
            chunk = arena.chunk(name)
        except (KeyError, IndexError):
            raise InvalidRequest(f"chunk: {device} has no chunk {name!r}") from None
        if chunk.fd < 0:
            raise InvalidRequest(f"chunk: {name} is opened by its IPC handle, not a descriptor")
        if not self.is_lane(route):
            raise InvalidRequest(
                f"chunk: the descriptor of {name} goes over a lane (the Unix socket beside an "
                "ipc:// address), and this client talks ZeroMQ: unset TENSORBROKER_LANES=off"
            )
        self.send(route, reply_ok(req.id, size=chunk.size), chunk.fd)
        return None
