"""The checkout imports as it installs: tensorbroker/{common,server,client} are links to the
top-level folders, so a checkout on sys.path (the working directory, for `python -m` and
`python -c`) is the same package as an installed copy, never a shadow without subpackages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _python(*args: str, cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_an_installed_copy_imports_from_the_repository_root_and_elsewhere(tmp_path: Path) -> None:
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(site), str(REPO)],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(site)}
    imports = "import tensorbroker, tensorbroker.server.broker, tensorbroker.common.protocol"
    assert _python("-c", f"{imports}; print(tensorbroker.__version__)", cwd=REPO, env=env)
    assert "serve" in _python("-m", "tensorbroker", "--help", cwd=REPO, env=env)
    # Elsewhere, the installed copy alone: real subpackages and the built extension.
    where = _python(
        "-c", "import tensorbroker.client._dlpack as d, tensorbroker.server.broker as b; "
        "print(d.__file__); print(b.__file__)", cwd=tmp_path, env=env,
    ).split()  # fmt: skip
    assert all(Path(p).is_relative_to(site) for p in where), where
