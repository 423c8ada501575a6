"""The docs cannot drift (issue 49): every ```python block of the README and of docs/ runs,
as a reader would run it, against a broker of its own (TENSORBROKER_ADDRESS); a block that
cannot (a sketch, two processes, a GPU) is fenced ```python notest and says why on its
first line."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

import tensorbroker as tb

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```python( notest)?\n(.*?)^```$", re.M | re.S)


def _blocks() -> Iterator[tuple[str, bool, str]]:
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = path.read_text()
        for m in FENCE.finditer(text):
            line = text[: m.start()].count("\n") + 1
            yield f"{path.relative_to(ROOT)}:{line}", bool(m.group(1)), m.group(2)


BLOCKS = list(_blocks())


def test_the_blocks_that_do_not_run_say_why() -> None:
    unexplained = [where for where, notest, code in BLOCKS if notest and not code.startswith("#")]
    assert unexplained == []


@pytest.mark.parametrize(
    "code", [code for _, notest, code in BLOCKS if not notest],
    ids=[where for where, notest, _ in BLOCKS if not notest],
)  # fmt: skip
def test_a_block_runs(
    code: str, fresh_broker: tb.BrokerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TENSORBROKER_ADDRESS", fresh_broker.address)
    exec(compile(code, "<docs>", "exec"), {"__name__": "__docs__"})
