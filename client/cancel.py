"""A call given up while it waits in the broker (interrupted: Ctrl-C, a signal handler's
exception; or no reply in time): cancelled there, and an answer that came anyway handed to
its caller's `late` (`Connection.call`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..common.errors import BrokerError
from ..common.protocol import Op
from .transport import Channel, NoReply

if TYPE_CHECKING:
    from .handoff import Bell

log = logging.getLogger(__name__)

CANCEL_WAIT = 2.0  # a call given up waits this long for the broker to confirm its cancel


def given_up(exc: BaseException) -> bool:
    """Whether a call that raised `exc` was given up while it waited (its answer may still
    come), not answered with an error or left by a broker that exited."""
    return isinstance(exc, NoReply) or not isinstance(exc, BrokerError)


def cancel(
    channel: Channel, request_id: int, cancel_id: int, bell: Bell | None,
    late: Callable[[dict[str, Any]], None],
) -> bool:  # fmt: skip
    """The caller stopped waiting for request `request_id` on `channel`: cancel it in the
    broker (a request `cancel_id`), and hand the answer that came anyway (on the socket, or to
    the `bell`) to `late`. Whether the channel is clean again (False: discard it, the broker
    did not confirm the cancel in time)."""
    kept = channel.kept.pop(request_id, None)  # read as the signal came
    if kept is not None:
        if kept.get("ok"):
            late(kept)
        return True
    try:
        channel.send({"op": Op.CANCEL, "id": cancel_id, "call": request_id})
        answer: dict[str, Any] | None = None
        deadline = time.monotonic() + CANCEL_WAIT
        while time.monotonic() < deadline:
            reply = channel.receive()
            if reply is None:
                continue
            if reply.get("id") == request_id:  # answered before the cancel came
                answer = reply
            elif reply.get("id") == cancel_id:
                if not reply.get("cancelled") and answer is None and bell is not None:
                    # A producer claimed its grant: the item is (or soon is) in the
                    # mailbox, addressed to this request.
                    answer = bell.settle(request_id, CANCEL_WAIT)
                if answer is not None and answer.get("ok"):
                    late(answer)
                return True
    except BaseException:  # interrupted again, or the broker exited: the socket goes
        log.warning("a call given up (request %d) was not cancelled", request_id)
        return False
    log.warning("the broker did not confirm the cancel of request %d", request_id)
    return False
