"""The exception tree of tensorbroker, and its wire codes.

    BrokerError
    ├── BrokerUnavailable        no broker answers at the address, or it went away
    ├── Timeout (TimeoutError)   a wait ran out (get, queue put/get)
    ├── NotFound (KeyError)      no such key
    ├── CapacityError            the broker cannot hold the object
    ├── InvalidRequest (ValueError)  the request itself is wrong (bad dtype, shape, key, ...)
    ├── ProtocolError            a malformed message, or client and broker speak different versions
    ├── QueueClosed              the queue was closed and is drained
    └── PeerUnavailable          the key lives on another node of the cluster, which is down

Every message says what happened, naming the key, the sizes or the address, and what to do.
"""

from __future__ import annotations


class BrokerError(Exception):
    """Root of every error tensorbroker raises."""

    code = "broker_error"

    def __str__(self) -> str:
        # KeyError quotes its message; every error here reads as plain text.
        return str(self.args[0]) if self.args else self.code


class BrokerUnavailable(BrokerError):
    code = "unavailable"


class Timeout(BrokerError, TimeoutError):
    code = "timeout"


class NotFound(BrokerError, KeyError):
    code = "not_found"


class CapacityError(BrokerError):
    code = "capacity"


class InvalidRequest(BrokerError, ValueError):
    code = "invalid"


class ProtocolError(BrokerError):
    code = "protocol"


class QueueClosed(BrokerError):
    code = "queue_closed"


class PeerUnavailable(BrokerError):
    code = "peer_unavailable"


class SessionUnknown(ProtocolError):
    """The broker does not know the client's socket: it restarted. The client says hello
    again (never raised to users)."""

    code = "hello_first"


ERRORS_BY_CODE: dict[str, type[BrokerError]] = {
    cls.code: cls
    for cls in (
        BrokerError,
        BrokerUnavailable,
        Timeout,
        NotFound,
        CapacityError,
        InvalidRequest,
        ProtocolError,
        QueueClosed,
        PeerUnavailable,
        SessionUnknown,
    )
}


def error_from_wire(code: str, message: str) -> BrokerError:
    """The exception for an error reply; an unknown code still gives a BrokerError."""
    return ERRORS_BY_CODE.get(code, BrokerError)(message)
