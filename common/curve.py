"""Keys for tcp:// (CurveZMQ): a broker on TCP encrypts and authenticates every connection.

    tensorbroker keys --out DIR            DIR/broker.key (public), DIR/broker.key_secret
    tensorbroker serve --address tcp://0.0.0.0:5555 --curve-secret DIR/broker.key_secret
    TENSORBROKER_SERVER_KEY=DIR/broker.key  (or connect(server_key=...)) on each client

A client must know the broker's public key to connect at all (a wrong one never completes
the handshake), and cannot be overheard or impersonated. The public key is not a secret:
to decide which clients may connect, give each its own pair (`tensorbroker keys --name
NAME`, its secret file in TENSORBROKER_CLIENT_KEY) and serve with `--curve-clients DIR`, a
folder of the public keys let in. A client without a pair of its own makes one per
connection. Over ipc:// none of this applies: the socket's folder permissions decide.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import zmq

from .errors import InvalidRequest

SERVER_KEY_ENV = "TENSORBROKER_SERVER_KEY"
CLIENT_KEY_ENV = "TENSORBROKER_CLIENT_KEY"
Z85_KEY_CHARS = 40


@dataclass(frozen=True)
class ClientKeys:
    server: bytes  # the broker's public key
    public: bytes
    secret: bytes

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Make `sock` (before it connects) a CURVE client of the broker."""
        sock.curve_serverkey = self.server
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


def make_keys(directory: str, name: str) -> tuple[str, str]:
    """A new key pair in `directory` (made 0700 if new): the paths of the public key file
    and of the secret one (mode 0600)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    public, secret = (os.path.join(directory, name + ext) for ext in (".key", ".key_secret"))
    for path in (public, secret):
        if os.path.exists(path):
            raise InvalidRequest(f"{path} exists: remove it, or choose another --name or --out")
    import zmq.auth  # here: 4 ms of every broker's start, where most brokers use no keys

    public, secret = zmq.auth.create_certificates(directory, name)
    os.chmod(secret, 0o600)
    return public, secret


def load_secret(path: str) -> tuple[bytes, bytes]:
    """(public, secret) from a secret key file made by `tensorbroker keys`."""
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise InvalidRequest(
            f"cannot read a secret key from {path} ({exc}): make one with `tensorbroker keys`"
        ) from None
    if secret is None:
        raise InvalidRequest(
            f"{path} holds only a public key: pass the .key_secret file `tensorbroker keys` made"
        )
    return public, secret


def public_key(value: str) -> bytes:
    """A public key given as its 40 Z85 characters, or as the path of a key file."""
    if len(value) == Z85_KEY_CHARS and not os.path.exists(value):
        return value.encode("ascii")
    import zmq.auth

    try:
        public, _ = zmq.auth.load_certificate(value)
    except (OSError, ValueError) as exc:
        raise InvalidRequest(
            f"the broker's public key must be 40 Z85 characters or the path of the .key file "
            f"`tensorbroker keys` made; cannot read {value!r} ({exc})"
        ) from None
    return public


def client_keys(address: str, server_key: str | None) -> ClientKeys | None:
    """The keys a client of a tcp:// broker connects with: the broker's public key from
    `server_key` or $TENSORBROKER_SERVER_KEY (None if neither is set, or not tcp://), and the
    client's own pair from $TENSORBROKER_CLIENT_KEY, else a new one."""
    server_key = server_key or os.environ.get(SERVER_KEY_ENV)
    if not address.startswith("tcp://") or not server_key:
        return None
    own = os.environ.get(CLIENT_KEY_ENV)
    public, secret = load_secret(own) if own else zmq.curve_keypair()
    return ClientKeys(public_key(server_key), public, secret)


@dataclass(frozen=True)
class ServerKeys:
    public: bytes
    secret: bytes
    clients: str | None  # a folder of the client public keys let in; None: any client

    def apply(self, sock: zmq.Socket[bytes]) -> None:
        """Make `sock` (before it binds) a CURVE server."""
        sock.curve_server = True
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


LOOPBACK = ("127.0.0.1", "localhost", "[::1]")


def server_keys(
    address: str, secret: str | None, clients: str | None, insecure_tcp: bool
) -> ServerKeys | None:
    """How a broker at `address` guards it: keys on tcp:// (InvalidRequest, saying what to
    do, where there are none and `insecure_tcp` is not given for a loopback address)."""
    if not address.startswith("tcp://"):
        if secret or clients or insecure_tcp:
            raise InvalidRequest(
                "--curve-secret, --curve-clients and --insecure-tcp are for tcp:// addresses; "
                f"{address} is guarded by its folder's permissions"
            )
        return None
    if clients is not None and not os.path.isdir(clients):
        raise InvalidRequest(f"--curve-clients {clients}: no such folder of public keys")
    if secret:
        public, key = load_secret(secret)
        return ServerKeys(public, key, clients)
    if clients:
        raise InvalidRequest("--curve-clients needs --curve-secret: the broker's own keys")
    host = address[len("tcp://") :].rsplit(":", 1)[0]
    if not insecure_tcp:
        raise InvalidRequest(
            f"serving {address} without keys would let anyone who reaches the port read, "
            "write and delete every tensor. Make keys (`tensorbroker keys --out DIR`) and "
            "serve with --curve-secret DIR/broker.key_secret; or, for 127.0.0.1 only, pass "
            "--insecure-tcp"
        )
    if host not in LOOPBACK:
        raise InvalidRequest(
            f"--insecure-tcp serves only a loopback address (127.0.0.1, localhost, [::1]), not "
            f"{host}: use keys (--curve-secret) to serve other hosts"
        )
    return None
