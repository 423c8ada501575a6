"""What `serve --node --cluster --etcd --peers` says, checked: this node, the etcd where the
brokers find each other (Note [membership] in membership.py) or the addresses of its peers (a
DNS name standing for every address it resolves to), and the keys the brokers of a cluster
share (Note [cluster] in cluster.py); and whether a broker that says hello speaks this
cluster's protocol."""

from __future__ import annotations

import ipaddress
import logging
import socket
import ssl
from typing import Any, NamedTuple

from ...common.config import format_size, parse_size
from ...common.curve import ServerKeys, server_keys
from ...common.errors import InvalidRequest
from .etcd import endpoints, tls
from .offers import OFFER_MAX

log = logging.getLogger(__name__)

# The cluster's messages and where keys live (rendezvous.py): every broker of a cluster
# speaks the same (a hello or welcome says which; none said: 1).
PROTOCOL = 4  # (4: lent versions pushed, Note [pushes] in pushes.py)


def speaks(m: dict[str, Any], refused: set[str]) -> bool:
    """Whether hello or welcome `m` comes from a broker of this PROTOCOL: one that does not
    is not linked to (it would look for keys at other homes), and is logged once (`refused`
    names those logged)."""
    theirs = m.get("protocol", 1)
    if theirs == PROTOCOL:
        return True
    who = f"{m.get('node')!r} at {m.get('address')}"
    if who not in refused:
        refused.add(who)
        log.error(
            "cluster: node %s speaks cluster protocol %s, this broker %s: not linked (run "
            "the same release of tensorbroker on every node)", who, theirs, PROTOCOL
        )  # fmt: skip
    return False


class Joining(NamedTuple):
    """What `serve --node --cluster --etcd --peers` says: this node's name, the address its
    peers reach it at, the etcd endpoints and prefix where the brokers find each other (or
    the peers' addresses) with the TLS that etcd is reached with (None: over http), and the
    CURVE keys the brokers share (None: --insecure-tcp, on loopback only)."""

    node: str
    address: str
    peers: list[str]
    keys: ServerKeys | None
    prefetch: int = 0  # versions of at most this many bytes are read as announced
    etcd: tuple[str, ...] = ()
    etcd_prefix: str = "/tensorbroker"
    etcd_tls: ssl.SSLContext | None = None

    @classmethod
    def parse(
        cls, node: str | None, address: str | None, peers: str, insecure: bool,
        secret: str | None = None, clients: str | None = None, prefetch: str | None = None,
        etcd: str | None = None, etcd_prefix: str = "/tensorbroker",
        etcd_files: tuple[str | None, str | None, str | None] = (None, None, None),
    ) -> Joining | None:  # fmt: skip
        """The options as given (None: no cluster); InvalidRequest saying what is wrong.
        `etcd_files`: --etcd-cacert, --etcd-cert and --etcd-key (etcd.tls)."""
        if node is None and address is None and not peers and not etcd:
            tls((), *etcd_files)  # (given without --etcd: said, not ignored)
            return None
        if not node or not address:
            raise InvalidRequest("a cluster needs both --node NAME and --cluster tcp://HOST:PORT")
        found_etcd = endpoints(etcd) if etcd else ()
        etcd_tls = tls(found_etcd, *etcd_files)
        if not etcd_prefix.startswith("/") or not etcd_prefix.strip("/") or " " in etcd_prefix:
            raise InvalidRequest(
                f"--etcd-prefix: a path such as /tensorbroker, not {etcd_prefix!r}"
            )
        if not node.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise InvalidRequest(f"--node: letters, digits, '-', '_' and '.' only, not {node!r}")
        tcp_host(address, "--cluster")
        found = [a for spec in peers.split(",") if spec.strip() for a in resolve(spec.strip())]
        for peer in found:
            tcp_host(peer, "--peers")
        # Brokers share one key pair (a Kubernetes Secret, say): each serves it, and reaches
        # the others with it; --curve-clients, if given, must hold its public key.
        keys = server_keys(address, secret, clients, insecure)  # refuses what would be open
        if keys is None:
            wide = [a for a in found if not loopback(tcp_host(a, "--peers"))]
            if wide:
                raise InvalidRequest(
                    f"--peers {wide[0]}: without keys a cluster stays on loopback; serve every "
                    "broker with the same --curve-secret (`tensorbroker keys`)"
                )
        prefetched = _prefetch(prefetch)
        return cls(node, address, found, keys, prefetched, found_etcd, etcd_prefix, etcd_tls)


def _prefetch(text: str | None) -> int:
    """--prefetch SIZE, in bytes (0 if not given: Note [prefetch] says why): no more than
    OFFER_MAX, since only a version offered with its announcement is read as it is announced
    (Note [offers])."""
    if text is None:
        return 0
    try:
        size = parse_size(text)
    except ValueError as exc:
        raise InvalidRequest(f"--prefetch: {exc}") from None
    if size > OFFER_MAX:
        raise InvalidRequest(
            f"--prefetch {text}: at most {format_size(OFFER_MAX)} (larger versions are pulled "
            "at their first get, or as a watch on this node asks for them)"
        )
    return size


def tcp_host(address: str, option: str) -> str:
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    if not address.startswith("tcp://") or not host or not port.isdigit():
        raise InvalidRequest(f"{option}: tcp://HOST:PORT, not {address!r}")
    return host.strip("[]")


def loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve(spec: str) -> list[str]:
    """tcp://HOST:PORT as is; dns:NAME:PORT as every address NAME resolves to (a Kubernetes
    headless service names each broker of the DaemonSet)."""
    if not spec.startswith("dns:"):
        return [spec]
    name, _, port = spec[4:].rpartition(":")
    if not name or not port.isdigit():
        raise InvalidRequest(f"--peers: dns:NAME:PORT, not {spec!r}")
    try:
        infos = socket.getaddrinfo(name, int(port), type=socket.SOCK_STREAM)
    except OSError as exc:
        raise InvalidRequest(f"--peers {spec}: {name!r} does not resolve: {exc}") from None
    hosts = sorted({str(info[4][0]) for info in infos})
    return [f"tcp://[{h}]:{port}" if ":" in h else f"tcp://{h}:{port}" for h in hosts]
