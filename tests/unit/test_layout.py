"""The package's layout holds (issue 49): no import circle between its modules (the wings'
layering is import-linter's, in `make lint`), and no module over MAX_LINES lines."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import pkgutil
import textwrap
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


def _placeholder(fn: object) -> bool:
    """Whether `fn` is a mixin's stand-in for a method of the class it is part of: its body
    only raises NotImplementedError."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    try:
        source = inspect.getsource(fn)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return False
    body = ast.parse(textwrap.dedent(source)).body[0]
    statements = [s for s in body.body if not isinstance(s, ast.Expr)]  # type: ignore[attr-defined]
    return (
        len(statements) == 1
        and isinstance(statements[0], ast.Raise)
        and "NotImplementedError" in ast.unparse(statements[0])
    )


def test_no_class_built_of_mixins_runs_a_mixins_stand_in() -> None:
    """A room split into mixins names what a mixin uses of the class it is part of, some
    of it as methods that only raise NotImplementedError. One of those earlier in the
    method order than the real method hid it: Homes took Moves' stand-in `tick` for
    Asking's, and every cluster's beat raised (caught by the suite, 2026-12-02)."""
    found = []
    for info in pkgutil.walk_packages(tensorbroker.__path__, "tensorbroker."):
        if info.name.endswith("__main__"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # (an extra not installed here: cupy, say)
            continue
        for cls in vars(module).values():
            if not inspect.isclass(cls) or cls.__module__ != module.__name__:
                continue
            if len(cls.__mro__) < 3:  # (no mixin: itself and object)
                continue
            for name in dir(cls):
                defined = next((k for k in cls.__mro__ if name in vars(k)), None)
                if defined is None or defined is cls:
                    continue
                fn = vars(defined)[name]
                if isinstance(fn, (staticmethod, classmethod)):
                    fn = fn.__func__
                if isinstance(fn, property):
                    fn = fn.fget
                if _placeholder(fn):
                    found.append(
                        f"{cls.__module__}.{cls.__qualname__}.{name} ({defined.__name__}'s)"
                    )
    assert not found, found
