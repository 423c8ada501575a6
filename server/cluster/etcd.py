"""The few etcd calls a cluster needs, through etcd's JSON gateway (its v3 API over HTTP, at
the addresses `serve --etcd` names) with the standard library's http.client: no gRPC or
protobuf next to torch's and JAX's pins. On this 2-core VM the gateway took puts as fast as
the gRPC client aetcd (1,000-1,200/s from one process, fsync on: issue 50's study).

An etcd served over https is reached with TLS (`tls`): its certificate checked against
`--etcd-cacert` (else the system's CAs), and this broker's own, `--etcd-cert` with
`--etcd-key`, shown to an etcd that asks for one (`--client-cert-auth`), as etcdctl's
`--cacert`, `--cert` and `--key` do.

Keys and values are bytes, base64 on the wire; etcd's 64-bit integers come as strings."""

from __future__ import annotations

import base64
import http.client
import json
import socket
import ssl
from collections.abc import Iterator
from threading import Event
from typing import Any
from urllib.parse import urlsplit

from ...common.errors import BrokerError, InvalidRequest

TIMEOUT = 2.0  # seconds a call waits for an etcd endpoint (then the next is tried)
# A watch stream's member that died without a word is found within about 11 s.
KEEPALIVE = ((socket.TCP_KEEPIDLE, 5), (socket.TCP_KEEPINTVL, 2), (socket.TCP_KEEPCNT, 3))


class EtcdUnavailable(BrokerError):
    """No etcd member answered; `refused`: each refused the connection (none listens, or the
    TLS handshake failed)."""

    code = "unavailable"
    refused = False


class EtcdRefused(EtcdUnavailable):
    """etcd answered, and refused the call (a lease it does not know, say)."""


def endpoints(spec: str) -> tuple[str, ...]:
    """`--etcd http[s]://HOST:PORT[,...]`, checked; InvalidRequest saying what is wrong."""
    found = tuple(e.strip().rstrip("/") for e in spec.split(",") if e.strip())
    for e in found:
        url = urlsplit(e)
        if url.scheme not in ("http", "https") or not url.hostname or url.port is None or url.path:
            raise InvalidRequest(
                f"--etcd: http://HOST:PORT[,http://HOST:PORT...] (https:// for an etcd served "
                f"with TLS), not {e!r}"
            )
    if not found:
        raise InvalidRequest("--etcd: at least one http://HOST:PORT")
    if len({urlsplit(e).scheme for e in found}) > 1:
        raise InvalidRequest(f"--etcd: all http:// or all https://, not {spec!r}")
    return found


def tls(
    urls: tuple[str, ...], cacert: str | None = None, cert: str | None = None,
    key: str | None = None,
) -> ssl.SSLContext | None:  # fmt: skip
    """How the etcd at `urls` (`endpoints`) is reached: None over http; over https, a TLS
    context trusting `cacert` (a PEM file; None: the system's CAs) and showing the
    certificate `cert` with its private `key`, if given. InvalidRequest saying what is
    wrong."""
    given = [f"--etcd-{n}" for n, v in (("cacert", cacert), ("cert", cert), ("key", key)) if v]
    if not urls or urlsplit(urls[0]).scheme == "http":
        if given:
            raise InvalidRequest(
                f"{given[0]} is for an etcd served with TLS: give --etcd https://HOST:PORT"
            )
        return None
    if (cert is None) != (key is None):
        raise InvalidRequest("--etcd-cert and --etcd-key go together: the certificate this "
                             "broker shows etcd, and its private key")  # fmt: skip
    try:
        context = ssl.create_default_context(cafile=cacert)
    except (OSError, ssl.SSLError) as exc:
        why = _why(exc, "not a file of PEM CA certificates")
        raise InvalidRequest(f"--etcd-cacert {cacert}: {why}") from None
    if cert is not None:
        try:
            context.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            why = _why(exc, "not a PEM certificate and key that go together")
            raise InvalidRequest(f"--etcd-cert {cert} with --etcd-key {key}: {why}") from None
    return context


def _why(exc: OSError | ssl.SSLError, unreadable: str) -> str:
    """What is wrong with a PEM file, as the user can act on it (`unreadable`: what it is
    not, if it could be read)."""
    if isinstance(exc, ssl.SSLError):
        return f"{unreadable} ({exc.reason or exc})"
    return exc.strerror or str(exc)


def _refused_handshake(exc: BaseException) -> bool:
    """Whether `exc` is a TLS handshake that failed for good: a certificate not trusted, or
    an alert from the server (a certificate it asked for and was not shown), not a
    connection cut short (an etcd restarting)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return True
    return isinstance(exc, ssl.SSLError) and "ALERT" in str(exc.reason or "")


def connection(
    url: str, timeout: float, context: ssl.SSLContext | None
) -> http.client.HTTPConnection:
    """A connection to the etcd endpoint `url`: over TLS with `context` (`tls`), else plain."""
    parts = urlsplit(url)
    if context is None:
        return http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
    return http.client.HTTPSConnection(
        parts.hostname or "", parts.port, timeout=timeout, context=context
    )


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def prefix_end(prefix: bytes) -> bytes:
    """The end of the range of keys that start with `prefix` (etcd's range_end)."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


class Etcd:
    """A client of the etcd cluster at `urls`: each call tries them in turn, from the one that
    answered last; EtcdUnavailable (naming them) if none answers, EtcdRefused if one refused
    the call. A member that does not answer, or answers 5xx (no leader, say), is passed over.
    `failed`: the endpoints passed over in the last call. Not shared between threads: each
    thread makes its own."""

    def __init__(
        self, urls: tuple[str, ...], timeout: float = TIMEOUT, first: int = 0,
        tls: ssl.SSLContext | None = None,
    ) -> None:  # fmt: skip
        """`first`: the endpoint tried first (another client's `first`, say); `tls`: over
        https, how (`tls()`)."""
        self.urls, self.timeout, self.tls = urls, timeout, tls
        self.failed: set[str] = set()
        self.first = first  # the endpoint that answered last

    def call(self, path: str, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """POST `body` to /v3/`path`: the JSON answer of the first endpoint that gives one."""
        errors, self.failed, refused, handshakes = [], set(), 0, 0
        n = len(self.urls)
        for turn in range(n):
            url = self.urls[(self.first + turn) % n]
            conn = connection(url, timeout or self.timeout, self.tls)
            try:
                conn.request("POST", f"/v3/{path}", json.dumps(body))
                reply = conn.getresponse()
                data = json.loads(reply.read() or b"{}")
            except (OSError, http.client.HTTPException, ValueError) as exc:
                errors.append(f"{url}: {exc}")
                self.failed.add(url)
                handshake = _refused_handshake(exc)  # (as a refusal: not waited out at start)
                handshakes += handshake
                refused += handshake or isinstance(exc, ConnectionRefusedError)
                continue
            finally:
                conn.close()
            if reply.status >= 500:  # (a member without a leader, say: another may have one)
                errors.append(f"{url}: HTTP {reply.status} {data.get('message', '')}")
                self.failed.add(url)
                continue
            if reply.status != 200:
                raise EtcdRefused(f"etcd at {url} refused {path}: {data.get('message', data)}")
            self.first = (self.first + turn) % n
            return dict(data)
        what = "start etcd there, or give this broker's --etcd the addresses of a running one"
        if handshakes:
            what = ("check --etcd-cacert (the CA that signed etcd's certificate, which must "
                    "name the host in --etcd), and --etcd-cert with --etcd-key if etcd asks for "
                    "a client certificate")  # fmt: skip
        unavailable = EtcdUnavailable(
            f"no etcd answers at {', '.join(self.urls)} ({'; '.join(errors)}): {what}"
        )
        unavailable.refused = refused == n
        raise unavailable

    def grant(self, ttl: int) -> int:
        """A new lease of `ttl` seconds: its id."""
        return int(self.call("lease/grant", {"TTL": ttl})["ID"])

    def keep_alive(self, lease: int) -> bool:
        """Renew `lease`; False if it expired already (its keys are gone)."""
        try:
            result = self.call("lease/keepalive", {"ID": lease}).get("result", {})
        except EtcdRefused as exc:
            if "lease not found" in str(exc):
                return False
            raise
        return int(result.get("TTL", 0)) > 0

    def revoke(self, lease: int) -> None:
        self.call("lease/revoke", {"ID": lease}, timeout=0.5)

    def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = lease
        self.call("kv/put", body)

    def put_new(self, key: bytes, value: bytes, lease: int) -> bytes | None:
        """Put `key` only if it does not exist (one transaction): None if it was put, else
        the value it has."""
        put = {"key": _b64(key), "value": _b64(value), "lease": lease}
        data = self.call("kv/txn", {
            "compare": [{"key": _b64(key), "target": "CREATE", "result": "EQUAL",
                         "create_revision": "0"}],
            "success": [{"request_put": put}],
            "failure": [{"request_range": {"key": _b64(key)}}],
        })  # fmt: skip
        if data.get("succeeded"):
            return None
        for response in data.get("responses", ()):
            for kv in response.get("response_range", {}).get("kvs", ()):
                return base64.b64decode(kv.get("value", ""))
        return b""  # (gone meanwhile: the caller tries again)

    def range(self, prefix: bytes) -> tuple[int, dict[bytes, bytes]]:
        """The keys under `prefix` with their values, and the revision they are of."""
        body = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}
        data = self.call("kv/range", body)
        kvs = data.get("kvs", ())
        found = {base64.b64decode(kv["key"]): base64.b64decode(kv.get("value", "")) for kv in kvs}
        return int(data["header"]["revision"]), found

    def watch(
        self, url: str, prefix: bytes, start: int, opened: list[socket.socket], stop: Event
    ) -> Iterator[tuple[bytes, bytes | None, int]]:
        """The changes under `prefix` from revision `start` on, from the endpoint `url` (one
        of `urls`), as etcd sends them: (key, value, revision) for a put, (key, None,
        revision) for a delete, until the stream ends (OSError: the endpoint went away, or
        TCP's keepalive found it dead). The stream's socket goes into `opened`, and another
        thread shuts it to end the watch; once `stop` is set, the watch ends."""
        conn = connection(url, TIMEOUT, self.tls)
        try:
            create = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}
            conn.request("POST", "/v3/watch", json.dumps({"create_request": {
                **create, "start_revision": start}}))  # fmt: skip
            reply = conn.getresponse()
            if reply.status != 200:
                raise OSError(f"etcd at {url} refused the watch: HTTP {reply.status}")
            sock = conn.sock
            assert sock is not None
            sock.settimeout(None)  # (a quiet cluster sends nothing for hours: TCP's keepalive
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # finds a dead member
            for option, value in KEEPALIVE:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
            opened.append(sock)
            if stop.is_set():  # (shut as it opened: the streams were shut before it was listed)
                return
            while True:
                line = reply.readline()
                if not line:
                    raise OSError(f"etcd at {url} ended the watch")
                result = json.loads(line).get("result", {})
                if result.get("compact_revision") or result.get("canceled"):
                    raise OSError(f"etcd at {url} cancelled the watch: {result}")
                for event in result.get("events", ()):
                    kv = event["kv"]
                    key, revision = base64.b64decode(kv["key"]), int(kv["mod_revision"])
                    if event.get("type") == "DELETE":
                        yield key, None, revision
                    else:
                        yield key, base64.b64decode(kv.get("value", "")), revision
        finally:
            conn.close()
