"""latency.png and bandwidth.png: put, get and handoff against size, log scales."""

from __future__ import annotations

import os
from typing import Any

from .config import SYSTEMS
from .plan import Results, format_size

PANELS = ("put", "get", "handoff")  # put_nowait is drawn on the put panel

STYLE: dict[str, dict[str, Any]] = {
    "tensorbroker": {"color": "tab:red", "linewidth": 2.5, "marker": "o", "zorder": 5},
    "plasma": {"color": "tab:blue", "marker": "s"},
    "ray": {"color": "tab:orange", "marker": "^"},
    "torch_queue": {"color": "tab:purple", "marker": "v"},
    "mp_queue": {"color": "tab:brown", "marker": "D"},
    "zmq_pickle5": {"color": "tab:green", "marker": "P"},
    "zmq_floor": {"color": "grey", "linestyle": "--", "marker": "x"},
    "copyto_floor": {"color": "black", "linestyle": ":", "marker": "+"},
}
TITLES = {"put": "put", "get": "get (zero-copy read)", "handoff": "handoff between processes"}
BANDWIDTH_TITLES = {**TITLES, "get": "get (zero-copy: size / time grows with size)"}


def _tick(nbytes: int) -> str:
    """4K, 64K, 1M, 1G: short enough that neighbouring sizes do not collide."""
    return format_size(nbytes).replace(" ", "").replace("iB", "").replace("B", "")


def _series(results: Results, scenario: str, system: str) -> tuple[list[int], list[float]]:
    sizes, values = [], []
    for row in results.rows(scenario):
        value = results.median(row, system)
        if row.metric == "value" and value is not None and value > 0:
            sizes.append(row.param)
            values.append(value)
    return sizes, values


def _draw(results: Results, path: str, bandwidth: bool, subtitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(16, 5.2), constrained_layout=True)
    for ax, scenario in zip(axes, PANELS, strict=True):
        ticks: set[int] = set()
        for spec in SYSTEMS:
            sizes, values = _series(results, scenario, spec.name)
            if not sizes:
                continue
            ticks.update(sizes)
            ys = [s / v / 1e9 for s, v in zip(sizes, values, strict=True)] if bandwidth else values
            ax.plot(sizes, ys, label=spec.label, **STYLE.get(spec.name, {}))
        sizes, values = _series(results, "put_nowait", "tensorbroker")
        if scenario == "put" and sizes:
            ys = [s / v / 1e9 for s, v in zip(sizes, values, strict=True)] if bandwidth else values
            ticks.update(sizes)
            ax.plot(sizes, ys, label="tensorbroker, wait=False",
                    **{**STYLE["tensorbroker"], "linestyle": "--", "marker": "o"})  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sorted(ticks), [_tick(t) for t in sorted(ticks)])
        ax.set_xlabel("object size")
        ax.set_ylabel("GB/s (size / time)" if bandwidth else "seconds (median)")
        ax.set_title((BANDWIDTH_TITLES if bandwidth else TITLES)[scenario])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    kind = "bandwidth (higher is better)" if bandwidth else "latency (lower is better)"
    fig.suptitle(f"{kind} — {subtitle}")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(results: Results, out_dir: str, subtitle: str) -> list[str]:
    """Draw both figures; return their paths (none when there is nothing to draw)."""
    if not any(results.rows(scenario) for scenario in PANELS):
        return []
    paths = []
    for name, bandwidth in (("latency.png", False), ("bandwidth.png", True)):
        path = os.path.join(out_dir, name)
        _draw(results, path, bandwidth, subtitle)
        paths.append(path)
    return paths
