"""Which calls go again to a broker that restarted under them (Connection._call): reads,
and writes the broker recognises when they come twice; and what a call that may not go
again raises instead."""

from __future__ import annotations

from typing import Any

from ..common.errors import BrokerUnavailable
from ..common.protocol import Op

# Calls sent again to a broker that adopted the state of the one that died: reads, and
# writes the broker recognises when they come twice (a seal by its put id, a queue get by
# its request id, a grant's first copy aborted as the client did not claim it).
RESENT = frozenset(
    {Op.GET, Op.EXISTS, Op.KEYS, Op.STATS, Op.PING, Op.QINFO, Op.QOPEN, Op.QGET, Op.QCLOSE,
     Op.PUT, Op.QPUT, Op.SEAL, Op.ABORT, Op.GRANT, Op.QCREDIT, Op.WAIT, Op.WATCH_PREFIX}
)  # fmt: skip
FRESH_SAFE = frozenset(
    {Op.GET, Op.EXISTS, Op.KEYS, Op.STATS, Op.PING, Op.PUT, Op.QOPEN, Op.GRANT, Op.WAIT,
     Op.WATCH_PREFIX}  # a watcher of a broker that restarted is told it overflowed
)  # fmt: skip


def check_resent(address: str, resumed: bool, op: str, fields: dict[str, Any], sent: bool) -> None:
    """Raise BrokerUnavailable if `op` must not be sent again to the broker of now at
    `address` (`resumed`: it kept this client's session; `sent`: the call went to the one
    before, which may have done it)."""
    what = " ".join(str(fields[f]) for f in ("key", "name", "put") if f in fields)
    what = f"{op} {what!r}" if what else op
    if not resumed and op not in FRESH_SAFE:
        raise BrokerUnavailable(
            f"the broker at {address} restarted without the state of the one before "
            f"(started with --reset, or it could not adopt it): {what} was lost with "
            "everything it held; do it again (a queue: open it again)"
        )
    if sent and op not in RESENT:
        raise BrokerUnavailable(
            f"the broker at {address} restarted during {what}: it may or may not "
            "have been done; look (exists, keys) and do it again if need be"
        )
