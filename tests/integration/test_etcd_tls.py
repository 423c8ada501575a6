"""Brokers that find each other in an etcd served with TLS (`serve --etcd https://...
--etcd-cacert --etcd-cert --etcd-key`): a real etcd asking its clients for certificates
(--client-cert-auth), its CA and certificates made here (tests/certs.py)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import tensorbroker as tb
from tensorbroker.server.cluster.etcd import Etcd, tls
from tensorbroker.server.cluster.local_etcd import local_etcd
from tests.certs import Authority, Issued
from tests.support import free_port, wait_until

pytest.importorskip("nixl_cu12", reason="the cluster needs NIXL: make test installs nixl-cu12")


class Secured:
    """An etcd served with TLS at `url`, and the files its clients are given."""

    def __init__(self, url: str, ca: Authority, broker: Issued) -> None:
        self.url, self.ca, self.broker = url, ca, broker


@pytest.fixture
def secured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Secured]:
    monkeypatch.setenv("UCX_TLS", "tcp")  # (the brokers': the network path)
    ca = Authority(tmp_path)
    with local_etcd(str(tmp_path / "etcd"), free_port, tls=(ca.cert, *ca.issue("etcd"))) as url:
        yield Secured(url, ca, ca.issue("broker"))


def _options(node: str, etcd: str, *tls_options: str) -> list[str]:
    return ["--node", node, "--cluster", f"tcp://127.0.0.1:{free_port()}", "--insecure-tcp",
            "--etcd", etcd, *tls_options]  # fmt: skip


def _peers(c: tb.Client) -> dict[str, str]:
    return {n: p["state"] for n, p in c.stats()["cluster"]["peers"].items()}


def _members(secured: Secured) -> list[bytes]:
    context = tls((secured.url,), secured.ca.cert, *secured.broker)
    _, found = Etcd((secured.url,), tls=context).range(b"/tensorbroker/members/")
    return sorted(k.rsplit(b"/", 1)[1] for k in found)


def test_brokers_find_each_other_in_an_etcd_served_with_tls(secured: Secured) -> None:
    """a and b register, watch each other and keep their leases over https, showing their
    certificate: they link up and read each other's keys; b's stop takes its entry out of
    etcd, and a takes it for down."""
    files = ["--etcd-cacert", secured.ca.cert, "--etcd-cert", secured.broker.cert,
             "--etcd-key", secured.broker.key]  # fmt: skip
    with contextlib.ExitStack() as stack:
        brokers = {
            n: stack.enter_context(
                tb.start_broker(memory="32MiB", options=_options(n, secured.url, *files))
            )
            for n in "ab"
        }
        a = stack.enter_context(tb.connect(brokers["a"].address))
        with tb.connect(brokers["b"].address) as b:
            assert wait_until(lambda: _peers(a) == {"b": "up"} and _peers(b) == {"a": "up"}, 20)
            a.put("w", np.arange(1000, dtype=np.int32))
            assert np.array_equal(b.get("w", timeout=10).numpy(), np.arange(1000))
        assert _members(secured) == [b"a", b"b"]
        brokers["b"].stop()
        assert _members(secured) == [b"a"]
        assert wait_until(lambda: _peers(a) == {"b": "down"}, 5), _peers(a)


@pytest.mark.parametrize(
    ("given", "says"),
    [
        (("cacert",), "alert"),  # (etcd asks for one, none shown: its TLS stack's alert)
        (("other_ca", "cert", "key"), "certificate verify failed"),
    ],
)
def test_a_broker_that_etcd_refuses_or_does_not_trust_fails_at_once_saying_why(
    secured: Secured, given: tuple[str, ...], says: str, tmp_path: Path
) -> None:
    """A failed TLS handshake is not waited out as an etcd still starting would be: the
    broker stops at once, naming the options to check."""
    files = {"cacert": secured.ca.cert, "other_ca": Authority(tmp_path, "another CA").cert,
             "cert": secured.broker.cert, "key": secured.broker.key}  # fmt: skip
    options = [o for name in given for o in (f"--etcd-{name.replace('other_ca', 'cacert')}",
                                             files[name])]  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-m", "tensorbroker", "serve", "--memory", "16MiB",
         "--address", f"ipc://{tmp_path}/b.sock", *_options("a", secured.url, *options)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode != 0, run.stderr
    assert says in run.stderr and "check --etcd-cacert" in run.stderr, run.stderr
    assert "trying again" not in run.stderr, run.stderr
