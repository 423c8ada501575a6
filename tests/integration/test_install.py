"""Installing tensorbroker as its users do: from a wheel (built here from the checkout, or the
one `make wheel-check` names in $TB_WHEEL: what `make wheels` made and auditwheel repaired),
into a fresh environment of this Python (or of $TB_WHEEL_PYTHON, the wheel's own) with no
compiler reachable. And the checkout imports as it installs:
tensorbroker/{common,server,client} are links to the top-level folders, so a checkout on
sys.path (the working directory, for `python -m` and `python -c`) is the same package as an
installed copy, never a shadow without subpackages."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import tensorbroker

REPO = Path(__file__).resolve().parents[2]
UV = Path(sys.executable).with_name("uv")  # the Makefile installs .venv with it

# Run by the fresh environment's Python, from a folder outside the checkout: it must find the
# installed copy only, its extensions prebuilt, and no compiler on PATH.
SMOKE = """
import importlib.metadata, os, shutil, sys
import numpy as np
import tensorbroker as tb
from tensorbroker.client import _dlpack
from tensorbroker.common import _shm

assert not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")), "a compiler is on PATH"
for module in (tb, _dlpack, _shm):
    assert module.__file__.startswith(sys.prefix), module.__file__
assert os.path.exists(os.path.join(os.path.dirname(tb.__file__), "py.typed"))
with tb.start_broker(memory="64MiB") as broker, tb.connect(broker.address) as c:
    c.put("x", np.arange(1000, dtype=np.int64))
    x = np.from_dlpack(c.get("x"))
    assert x.sum() == 499500, x
print(tb.__version__, importlib.metadata.version("tensorbroker"))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("TB_WHEEL")
    if given:
        return Path(given).resolve()
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run(
        [str(UV), "build", "--wheel", "--quiet", "--python", sys.executable, "--out-dir", str(out),
         str(REPO)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (built,) = out.glob("tensorbroker-*.whl")
    return built


def _run(*args: str, cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{args}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.slow  # (a wheel built, 16 s: make test-all, and make wheel-check with CI's wheel)
def test_a_wheel_installs_and_serves_where_no_compiler_is(wheel: Path, tmp_path: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.endswith(".c")], "the wheel ships C sources"
    assert {"tensorbroker/py.typed", f"{_dist_info(wheel)}/licenses/LICENSE"} <= set(names)
    venv = tmp_path / "venv"
    base = os.environ.get("TB_WHEEL_PYTHON") or sys.executable
    _run(base, "-m", "venv", "--without-pip", str(venv), cwd=tmp_path, env=dict(os.environ))
    python = str(venv / "bin" / "python")
    # Nothing may be compiled: PATH has the new environment only, CC names no program, and
    # only wheels are taken (numpy, pyzmq and msgpack: theirs, from PyPI or uv's cache).
    bare = {**os.environ, "PATH": str(venv / "bin"), "CC": "no-compiler", "CXX": "no-compiler"}
    bare.pop("PYTHONPATH", None)
    _run(str(UV), "pip", "install", "--quiet", "--python", python, "--only-binary", ":all:",
         str(wheel), cwd=tmp_path, env=bare)  # fmt: skip
    version, installed = _run(python, "-c", SMOKE, cwd=tmp_path, env=bare).split()
    assert version == installed == tensorbroker.__version__
    shown = _run(str(venv / "bin" / "tensorbroker"), "--version", cwd=tmp_path, env=bare)
    assert shown.strip() == f"tensorbroker {version}"


def test_an_installed_copy_imports_from_the_repository_root_and_elsewhere(
    wheel: Path, tmp_path: Path
) -> None:
    here = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    if f"-{here}-" not in wheel.name:
        pytest.skip(f"{wheel.name} is for another Python: this test imports with {here}'s packages")
    site = tmp_path / "site"
    _run(sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
         "--target", str(site), str(wheel), cwd=tmp_path, env=dict(os.environ))  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(site)}
    imports = "import tensorbroker, tensorbroker.server.broker, tensorbroker.common.protocol"
    assert _run(
        sys.executable, "-c", f"{imports}; print(tensorbroker.__version__)", cwd=REPO, env=env
    )
    assert "serve" in _run(sys.executable, "-m", "tensorbroker", "--help", cwd=REPO, env=env)
    # Elsewhere, the installed copy alone: real subpackages and the built extension.
    where = _run(
        sys.executable, "-c", "import tensorbroker.client._dlpack as d, tensorbroker.server.broker "
        "as b; print(d.__file__); print(b.__file__)", cwd=tmp_path, env=env,
    ).split()  # fmt: skip
    assert all(Path(p).is_relative_to(site) for p in where), where


def _dist_info(wheel: Path) -> str:
    name, version = wheel.name.split("-")[:2]
    return f"{name}-{version}.dist-info"
