"""The public API surface of `tensorbroker`, and what importing it drags in."""

from __future__ import annotations

import subprocess
import sys

import tensorbroker as tb

PUBLIC = [
    "BrokerError",
    "BrokerProcess",
    "BrokerUnavailable",
    "CapacityError",
    "Client",
    "InvalidRequest",
    "KeyEvent",
    "NotFound",
    "PeerUnavailable",
    "ProtocolError",
    "Queue",
    "QueueClosed",
    "Subscription",
    "Tensor",
    "Timeout",
    "connect",
    "start_broker",
]
NOT_ERRORS = ("BrokerProcess", "Client", "KeyEvent", "Queue", "Subscription", "Tensor")


def _run(code: str) -> str:
    """Run `code` in a fresh interpreter (without the repository on sys.path); its stdout."""
    done = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_all_is_exactly_the_public_names() -> None:
    assert sorted(tb.__all__) == PUBLIC
    assert len(set(tb.__all__)) == len(tb.__all__)
    for name in PUBLIC:
        assert getattr(tb, name, None) is not None, name


def test_public_names_are_what_they_say() -> None:
    for name in PUBLIC:
        obj = getattr(tb, name)
        if name[0].isupper() and name not in NOT_ERRORS:
            assert issubclass(obj, tb.BrokerError), name
        else:
            assert callable(obj), name


def test_star_import_gives_the_public_names() -> None:
    out = _run(
        "ns = {}; exec('from tensorbroker import *', ns); "
        "print(sorted(k for k in ns if not k.startswith('__')))"
    )
    assert out == repr(PUBLIC)


def test_importing_tensorbroker_does_not_import_frameworks() -> None:
    out = _run("import sys, tensorbroker; print('torch' in sys.modules, 'jax' in sys.modules)")
    assert out == "False False"


_SERVER_ONLY = """
import sys
import tensorbroker.server.broker, tensorbroker.server.store.registry
import tensorbroker.server.store.arena
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "jax", "jaxlib", "cupy")
             or m == "tensorbroker.client" or m.startswith("tensorbroker.client.")))
"""


def test_server_never_imports_frameworks_or_the_client() -> None:
    assert _run(_SERVER_ONLY) == "[]"


def test_importing_the_server_does_not_import_frameworks() -> None:
    out = _run(
        "import sys, tensorbroker.server.broker; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'jax', 'cupy')))"
    )
    assert out == "[]"
