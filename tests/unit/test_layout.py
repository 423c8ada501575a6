"""The package's layout holds (issue 49): no import circle between its modules (the wings'
layering is import-linter's, in `make lint`), and no module over MAX_LINES lines."""

from __future__ import annotations

import os
from pathlib import Path

import grimp

import tensorbroker

MAX_LINES = 450


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.find_modules_directly_imported_by(nxt)))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_module_imports_another_that_imports_it_back() -> None:
    """Imports under TYPE_CHECKING count too: a module that needs a type of one that
    imports it names it with a Protocol."""
    assert _cycles(grimp.build_graph("tensorbroker")) == []


def test_no_module_is_over_the_line_limit() -> None:
    root = Path(tensorbroker.__file__).parent  # (client, common, server: links to follow)
    files = [Path(d, f) for d, _, fs in os.walk(root, followlinks=True) for f in fs]
    long = {
        str(p.relative_to(root)): n
        for p in files
        if p.suffix == ".py" and (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"split these along the lines their docstrings draw: {long}"
