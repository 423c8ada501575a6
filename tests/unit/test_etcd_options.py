"""`serve --etcd` with TLS (--etcd-cacert, --etcd-cert, --etcd-key), as Joining.parse checks
them: what cannot work is refused at start, saying what to give instead."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
from pathlib import Path

import pytest

from tensorbroker.common.errors import InvalidRequest
from tensorbroker.server.cluster.etcd import Etcd, EtcdUnavailable, tls
from tensorbroker.server.cluster.joining import Joining
from tests.certs import Authority

HTTPS = "https://127.0.0.1:2379"


def _parse(etcd: str | None, *files: str | None, node: str | None = "a") -> Joining | None:
    cluster = None if node is None else "tcp://127.0.0.1:1"
    padded = (*files, None, None, None)[:3]
    return Joining.parse(node, cluster, "", True, etcd=etcd, etcd_files=padded)


def test_an_etcd_over_https_is_reached_with_the_ca_and_the_certificate_given(
    tmp_path: Path,
) -> None:
    ca = Authority(tmp_path)
    broker = ca.issue("broker")
    joining = _parse(f"{HTTPS},https://127.0.0.2:2379", ca.cert, *broker)
    assert joining is not None and joining.etcd_tls is not None
    assert joining.etcd_tls.verify_mode == ssl.CERT_REQUIRED and joining.etcd_tls.check_hostname
    plain = _parse(HTTPS)  # (the system's CAs, no certificate of its own)
    assert plain is not None and plain.etcd_tls is not None
    assert _parse("http://127.0.0.1:2379").etcd_tls is None  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("etcd", "files", "says"),
    [
        ("http://127.0.0.1:2379", ("ca",), "--etcd-cacert is for an etcd served with TLS: give "
         "--etcd https://HOST:PORT"),
        (None, ("ca",), "--etcd-cacert is for an etcd served with TLS"),
        (HTTPS, ("ca", "cert"), "--etcd-cert and --etcd-key go together"),
        (HTTPS, (None, None, "key"), "--etcd-cert and --etcd-key go together"),
        (f"{HTTPS},http://127.0.0.2:2379", (), "--etcd: all http:// or all https://"),
        ("ftp://127.0.0.1:2379", (), "https:// for an etcd served with TLS"),
        (HTTPS, ("missing",), "--etcd-cacert {tmp}/missing.pem: No such file or directory"),
        (HTTPS, ("ca", "key", "key"), "not a PEM certificate and key that go together"),
        (HTTPS, ("ca", "cert", "other_key"), "not a PEM certificate and key that go together"),
    ],
)  # fmt: skip
def test_etcd_tls_options_that_cannot_work_are_refused_saying_what_to_give(
    etcd: str | None, files: tuple[str | None, ...], says: str, tmp_path: Path
) -> None:
    ca = Authority(tmp_path)
    broker, other = ca.issue("broker"), ca.issue("other")
    paths = {"ca": ca.cert, "cert": broker.cert, "key": broker.key, "other_key": other.key,
             "missing": str(tmp_path / "missing.pem")}  # fmt: skip
    given = tuple(None if f is None else paths[f] for f in files)
    with pytest.raises(InvalidRequest) as caught:
        _parse(etcd, *given, node=None if etcd is None else "a")
    assert says.format(tmp=tmp_path) in str(caught.value)


def test_a_tls_connection_cut_short_is_waited_out_and_an_untrusted_one_is_not(
    tmp_path: Path,
) -> None:
    """An endpoint that closes the connection during the handshake (an etcd restarting, a
    proxy) is unavailable, as one not answering is: a starting broker waits for it. One
    whose certificate is not trusted refused for good (`refused`: the broker stops)."""
    ca = Authority(tmp_path)
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(*Authority(tmp_path, "another CA").issue("etcd"))
    with socket.create_server(("127.0.0.1", 0)) as listening:
        url = f"https://127.0.0.1:{listening.getsockname()[1]}"

        def serve(handshake: bool) -> None:
            conn, _ = listening.accept()
            with conn:
                if handshake:  # (its certificate is not one `ca` signed)
                    with contextlib.suppress(OSError):
                        server_side.wrap_socket(conn, server_side=True).close()

        for handshake, refused in ((False, False), (True, True)):
            server = threading.Thread(target=serve, args=(handshake,))
            server.start()
            with pytest.raises(EtcdUnavailable) as caught:
                Etcd((url,), tls=tls((url,), ca.cert)).range(b"/x/")
            server.join(5)
            assert caught.value.refused is refused, str(caught.value)
            assert ("check --etcd-cacert" in str(caught.value)) is refused
