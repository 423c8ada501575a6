"""MkDocs hooks: the CLI reference is the commands' own `--help`, rendered at build time, so
that it cannot drift from the code (`<!-- cli -->` in cli.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

COMMANDS = ["", "serve", "ping", "stat", "ls", "rm", "top", "keys", "gc"]


def _help(command: str) -> str:
    args = [sys.executable, "-m", "tensorbroker", *([command] if command else []), "--help"]
    env = {**os.environ, "COLUMNS": "100"}
    return subprocess.run(args, capture_output=True, text=True, check=True, env=env).stdout


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if "<!-- cli -->" not in markdown:
        return markdown
    parts = []
    for command in COMMANDS:
        title = f"tensorbroker {command}".strip()
        parts.append(f"## `{title}`\n\n```text\n{_help(command).rstrip()}\n```\n")
    return markdown.replace("<!-- cli -->", "\n".join(parts))
