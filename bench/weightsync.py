"""Weight-sync benchmark: a trainer republishes a whole model's weights to inference processes.

A PyTorch process (the publisher) holds a bf16 state_dict shaped like a real decoder (Llama-2-7B:
291 tensors, 13.5 GB; or Llama-2-70B layers), publishes it, then regenerates it in place and
republishes it `--versions` times. A torch process and a JAX process on the same GPU follow it
and checksum every version: each bf16 value's bits as int16, summed mod 2**32, exact in any
summation order, so both must match the publisher's bit for bit (a mismatch raises).

Three ways of handing the weights over, one after the other, each in fresh processes:

  tensorbroker           c.put("weights", state_dict): one device-to-device copy into broker
                         memory; consumers follow c.watch("weights") and read it zero copy.
  torch IPC per tensor   the verl / SGLang way: a CUDA IPC handle per tensor (reduce_tensor),
                         pickled to each consumer, which opens them all (JAX: in torch, then
                         jnp.from_dlpack). No copy, but the consumers read the trainer's live
                         parameters: it must not touch them until both are done.
  torch IPC flat bucket  every tensor copied into one flat buffer (allocated once); one handle
                         and (name, shape, offset) per tensor; consumers take views.

A version's clock starts at t0, just before the publish (time.monotonic: system-wide on Linux).
"publish" is the publisher's own time (tensorbroker: put returned and its copy finished; flat
bucket: the copy, then the handles; per tensor: the handles made and sent). Only tensorbroker's
publisher may change its weights once it has published (the consumers read a copy); the IPC
publishers read their live parameters to the consumers, so they wait for the whole sync.
A consumer is "ready" once every tensor is an array of its framework,
"done" once its checksum is on the host; a sync ends when both are done, and GB/s is the
model's bytes over the median sync. A version is published only after both consumers reported
the last one and let go of it. The first publish pays one-time setup (handles opened, mappings)
and is shown apart; the JAX checksum is compiled before it, so no compile is timed.

    .venv/bin/python bench/weightsync.py [--model 7b|70b-slice] [--layers N] [--versions 5]
                                            [--tiny] [--out bench/results/weightsync.md]
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import pickle
import queue
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

GIB = 1 << 30
DEVICE = "cuda:0"
TIMEOUT = 600.0  # seconds any one step may take before the run is declared stuck
ALIGN = 128  # bf16 elements: each tensor of the flat bucket starts on 256 bytes

TB, PER_TENSOR, FLAT = "tensorbroker", "torch IPC per tensor", "torch IPC flat bucket"
METHODS = (TB, PER_TENSOR, FLAT)
CONSUMERS = ("torch", "jax")

# hidden, intermediate, rows of k_proj/v_proj, vocab (0: no embeddings), layers
MODELS = {"7b": (4096, 11008, 4096, 32000, 32), "70b-slice": (8192, 28672, 1024, 0, 8)}
TINY = {"7b": (256, 688, 256, 1000, 2), "70b-slice": (256, 896, 32, 0, 2)}

Spec = list[tuple[str, tuple[int, ...]]]


def model_spec(model: str, layers: int | None = None, tiny: bool = False) -> Spec:
    """(name, shape) of every tensor of the state_dict, in Hugging Face's names and order."""
    hidden, inter, kv, vocab, default_layers = (TINY if tiny else MODELS)[model]
    layer = [("self_attn.q_proj", (hidden, hidden)), ("self_attn.k_proj", (kv, hidden)),
             ("self_attn.v_proj", (kv, hidden)), ("self_attn.o_proj", (hidden, hidden)),
             ("mlp.gate_proj", (inter, hidden)), ("mlp.up_proj", (inter, hidden)),
             ("mlp.down_proj", (hidden, inter)), ("input_layernorm", (hidden,)),
             ("post_attention_layernorm", (hidden,))]  # fmt: skip
    spec: Spec = [("model.embed_tokens.weight", (vocab, hidden))] if vocab else []
    for i in range(layers or default_layers):
        spec += [(f"model.layers.{i}.{part}.weight", shape) for part, shape in layer]
    if vocab:
        spec += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return spec


def torch_checksum(tensors: list[Any]) -> int:
    """Sum of the bf16 bits as int16, mod 2**32: summed on the GPU, one transfer to the host."""
    import torch

    sums = torch.stack([t.view(torch.int16).sum(dtype=torch.int64) for t in tensors])
    return int(sums.sum().item()) % 2**32


def jax_checksum(spec: Spec) -> Callable[[list[Any]], int]:
    """The same checksum in JAX (uint32 addition wraps mod 2**32), compiled ahead of time for
    the model's shapes."""
    import jax
    import jax.numpy as jnp

    def checksum(xs: list[jax.Array]) -> jax.Array:
        total = jnp.zeros((), jnp.uint32)
        for x in xs:
            bits = jax.lax.bitcast_convert_type(x, jnp.int16).astype(jnp.uint32)
            total = total + jnp.sum(bits, dtype=jnp.uint32)
        return total

    shapes = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for _, shape in spec]
    compiled = jax.jit(checksum).lower(shapes).compile()
    return lambda xs: int(compiled(xs))


def publisher(
    method: str, spec: Spec, address: str | None, commands: Any, reports: Any, inboxes: list[Any]
) -> None:
    """Holds the weights; on each version number from `commands`, regenerates and publishes."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    import tensorbroker as tb

    bf16 = torch.bfloat16
    weights = {name: torch.empty(shape, dtype=bf16, device=DEVICE) for name, shape in spec}
    layout, offset = [], 0  # the flat bucket's (name, shape, offset)
    for name, shape in spec:
        layout.append((name, shape, offset))
        offset += -(-math.prod(shape) // ALIGN) * ALIGN
    flat = torch.empty(offset if method == FLAT else 0, dtype=bf16, device=DEVICE)
    client = tb.connect(address) if method == TB else None
    if client is not None:  # CuPy imported, the client's CUDA set up: not the first publish's cost
        client.put("warmup", torch.zeros(1, device=DEVICE))
        client.delete("warmup")
    stream = torch.cuda.current_stream()
    gpu = torch.cuda.get_device_name(0)
    reports.put(dict(who="publisher", version=0, gpu=gpu, torch=torch.__version__))
    while (version := commands.get()) is not None:
        for p in weights.values():  # new values in place, as an optimizer step makes them
            p.normal_()
        expected = torch_checksum(list(weights.values()))  # .item() waits for the stream
        t0 = time.monotonic()
        if client is not None:
            client.put("weights", weights)
            stream.synchronize()  # put only enqueued the copy: now the weights may change
        elif method == PER_TENSOR:
            for inbox in inboxes:  # one reduction per consumer, as torch's own Queue does
                handles = [(name, *reduce_tensor(p)) for name, p in weights.items()]
                inbox.put((version, pickle.dumps(handles)))
        else:
            for (_, _, off), p in zip(layout, weights.values(), strict=True):
                flat[off : off + p.numel()].copy_(p.view(-1))
            stream.synchronize()
            for inbox in inboxes:
                inbox.put((version, pickle.dumps((*reduce_tensor(flat), layout))))
        publish = time.monotonic() - t0
        reports.put(
            dict(who="publisher", version=version, t0=t0, publish=publish, checksum=expected)
        )
    if client is not None:
        client.close()


def _rebuild(method: str, inbox: Any, version: int) -> dict[str, Any]:
    """The torch tensors of the next version sent over torch CUDA IPC (nothing kept here)."""
    sent, payload = inbox.get(timeout=TIMEOUT)
    if sent != version:
        raise RuntimeError(f"{method}: expected version {version}, received {sent}")
    if method == PER_TENSOR:
        return {name: rebuild(*args) for name, rebuild, args in pickle.loads(payload)}
    rebuild, args, layout = pickle.loads(payload)
    flat = rebuild(*args)
    return {name: flat[off : off + math.prod(shape)].view(shape) for name, shape, off in layout}


def consumer(
    method: str, who: str, spec: Spec, address: str | None, inbox: Any, reports: Any, count: int
) -> None:
    """A torch or JAX process: follows the weights and checksums each of `count` versions."""
    import tensorbroker as tb

    info: dict[str, Any] = {}
    if who == "jax":
        import jax
        import jax.numpy as jnp

        if jax.default_backend() != "gpu":
            raise RuntimeError(f"JAX has no GPU backend here ({jax.default_backend()})")
        jnp.zeros(1).block_until_ready()
        checksum, convert = jax_checksum(spec), jnp.from_dlpack
        info["jax"] = jax.__version__
    else:
        checksum, convert = torch_checksum, (tb.Tensor.torch if method == TB else lambda x: x)
    if method != TB or who == "torch":
        import torch  # the IPC methods rebuild in torch, also for JAX

        torch.zeros(1, device=DEVICE)  # CUDA up before the first publish
    client, feed = None, None
    if method == TB:
        import cupy  # noqa: F401  (the client's CUDA runtime: imported before the first publish)

        client = tb.connect(address)
        client.ping()
        feed = client.watch("weights", timeout=TIMEOUT)
    reports.put({"who": who, "version": 0, **info})
    for version in range(1, count + 1):
        bundle = next(feed) if feed is not None else _rebuild(method, inbox, version)
        arrays = [convert(bundle[name]) for name, _ in spec]
        ready = time.monotonic()
        total = checksum(arrays)
        done = time.monotonic()
        del bundle, arrays  # let go of this version before the next is published
        reports.put(dict(who=who, version=version, ready=ready, done=done, checksum=total))
    if client is not None:
        client.close()


def _gather(reports: Any, procs: dict[str, Any], version: int, method: str) -> dict[str, Any]:
    """One report of `version` from every process; raises if one fails or stalls."""
    got: dict[str, Any] = {}
    deadline = time.monotonic() + TIMEOUT
    while len(got) < len(procs):
        try:
            report = reports.get(timeout=1.0)
        except queue.Empty:
            report = None
        if report is not None:
            if report["version"] != version:
                raise RuntimeError(f"{method}: expected version {version}, got {report}")
            got[report["who"]] = report
            continue
        failed = [f"{w} (exit code {p.exitcode})" for w, p in procs.items() if p.exitcode]
        if failed:
            raise RuntimeError(f"{method}: {', '.join(failed)} failed: see its traceback above")
        if time.monotonic() > deadline:
            missing = sorted(set(procs) - set(got))
            raise TimeoutError(f"{method}: no report of version {version} from {missing}")
    return got


def _run_method(
    method: str, spec: Spec, versions: int, address: str | None, info: dict[str, Any]
) -> list[dict[str, float]]:
    """Per version: publish seconds, each consumer's ready and done seconds from t0, sync.
    What the processes tell of themselves (GPU, versions) goes into `info`."""
    ctx, n = mp.get_context("spawn"), versions + 1
    reports, commands = ctx.Queue(), ctx.Queue()
    inboxes = {who: ctx.Queue() for who in CONSUMERS}
    procs = {
        who: ctx.Process(target=consumer, daemon=True,
                         args=(method, who, spec, address, inbox, reports, n))
        for who, inbox in inboxes.items()
    }  # fmt: skip
    procs["publisher"] = ctx.Process(target=publisher, daemon=True,
                                     args=(method, spec, address, commands, reports,
                                           list(inboxes.values())))  # fmt: skip
    print(f"{method}: starting the publisher and the consumers", flush=True)
    for p in procs.values():
        p.start()
    try:
        for report in _gather(reports, procs, 0, method).values():
            info.update({k: v for k, v in report.items() if k not in ("who", "version")})
        records = []
        for version in range(1, n + 1):
            commands.put(version)
            got = _gather(reports, procs, version, method)
            pub = got.pop("publisher")
            t0 = pub["t0"]
            rec = {"publish": pub["publish"]}
            for who, r in got.items():
                if r["checksum"] != pub["checksum"]:
                    raise RuntimeError(
                        f"{method}: the {who} consumer's checksum of version {version} is "
                        f"{r['checksum']}, the publisher's {pub['checksum']}"
                    )
                rec[f"{who}_ready"], rec[f"{who}_done"] = r["ready"] - t0, r["done"] - t0
            rec["sync"] = max(rec[f"{who}_done"] for who in CONSUMERS)
            records.append(rec)
            each = "; ".join(f"{w} ready {_ms(rec[w + '_ready'])}, done {_ms(rec[w + '_done'])}"
                             for w in CONSUMERS)  # fmt: skip
            print(f"{method}: version {version}/{n}: publish {_ms(rec['publish'])}, sync "
                  f"{_ms(rec['sync'])} ({info['bytes'] / rec['sync'] / 1e9:.1f} GB/s); {each}",
                  flush=True)  # fmt: skip
        for who in CONSUMERS:
            procs[who].join(TIMEOUT)
        commands.put(None)  # the publisher's weights may go once no consumer can read them
        procs["publisher"].join(TIMEOUT)
        failed = [f"{w} (exit code {p.exitcode})" for w, p in procs.items() if p.exitcode != 0]
        if failed:
            raise RuntimeError(f"{method}: {', '.join(failed)} did not end cleanly")
        return records
    finally:
        for p in procs.values():
            if p.is_alive():
                p.terminate()
                p.join()


def run(
    model: str = "7b", layers: int | None = None, versions: int = 5, *, tiny: bool = False
) -> list[dict[str, Any]]:
    """Run the three methods one after the other; one row per (method, measure)."""
    import tensorbroker as tb

    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # JAX takes 75% of the GPU otherwise
    spec = model_spec(model, layers, tiny)
    nbytes = 2 * sum(math.prod(shape) for _, shape in spec)
    n = sum(name.endswith("q_proj.weight") for name, _ in spec)
    label = f"Llama-2-{model} ({n} layers{', tiny' if tiny else ''})"
    info = dict(model=label, tensors=len(spec), bytes=nbytes, versions=versions)
    print(f"weight sync: {label}, {len(spec)} tensors, {_gb(nbytes)}, 1 + {versions} versions",
          flush=True)  # fmt: skip
    results = {}
    for method in METHODS:
        if method == TB:  # room for two versions (the one read, the one written) and slack
            gib = math.ceil((2 * nbytes + GIB) / GIB)
            with tb.start_broker(memory="256MiB", cuda_memory=f"0:{gib}GiB") as broker:
                results[method] = _run_method(method, spec, versions, broker.address, info)
        else:
            results[method] = _run_method(method, spec, versions, None, info)
    return [row for method, records in results.items() for row in _rows(method, records, info)]


def _rows(
    method: str, records: list[dict[str, float]], info: dict[str, Any]
) -> list[dict[str, Any]]:
    """Median and min over the republishes (records[1:]) of each measure; the first apart."""
    first, later = records[0], records[1:]
    rows: list[dict[str, Any]] = []
    for who in ("publish", *CONSUMERS, "sync"):
        key = f"{who}_done" if who in CONSUMERS else who
        median = statistics.median(r[key] for r in later)
        ready = [r[f"{who}_ready"] for r in later if who in CONSUMERS]
        rows.append(dict(info, method=method, who=who, median_s=median,
                         min_s=min(r[key] for r in later), first_s=first[key],
                         gbps=None if who == "publish" else info["bytes"] / median / 1e9,
                         ready_median_s=statistics.median(ready) if ready else None))  # fmt: skip
    return rows


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.3g} GB"


LABELS = {"publish": "publisher: publish", "torch": "torch consumer done",
          "jax": "JAX consumer done", "sync": "**sync** (both done)"}  # fmt: skip


def report(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table, with the model, the GPU and the versions under it."""
    head = rows[0]
    lines = [
        "| method | measure | median | min | GB/s (median) | ready (median) | first publish |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gbps = "" if r["gbps"] is None else f"{r['gbps']:.1f}"
        ready = "" if r["ready_median_s"] is None else _ms(r["ready_median_s"])
        lines.append(
            f"| {r['method']} | {LABELS[r['who']]} | {_ms(r['median_s'])} "
            f"| {_ms(r['min_s'])} | {gbps} | {ready} | {_ms(r['first_s'])} |"
        )
    lines += [
        "",
        f"Model: {head['model']} shapes, {head['tensors']} bf16 tensors, "
        f"{_gb(head['bytes'])}; median and min over {head['versions']} republishes "
        "(the first publish apart); seconds from the publish call to each consumer's checksum "
        "on the host, every checksum equal to the publisher's. The trainer may change its "
        "weights again: with tensorbroker once its publish returns (the consumers read a copy), "
        "with torch IPC only after the sync (the consumers read its live parameters).",
        f"GPU: {head.get('gpu', '?')}; torch {head.get('torch', '?')}; "
        f"jax {head.get('jax', '?')}; all processes on {DEVICE}.",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="7b")
    parser.add_argument("--layers", type=int, help="default: 32 (7b), 8 (70b-slice), 2 (--tiny)")
    parser.add_argument("--versions", type=int, default=5, help="republishes after the first")
    parser.add_argument("--tiny", action="store_true", help="hidden 256, 2 layers: a smoke run")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.versions < 1 or (args.layers is not None and args.layers < 1):
        parser.error("--versions and --layers must be at least 1")
    try:
        import cupy  # noqa: F401
        import jax  # noqa: F401
        import torch
    except ImportError as exc:
        print(f"bench/weightsync.py needs torch with CUDA, JAX and CuPy: {exc}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench/weightsync.py: no CUDA device (torch.cuda.is_available() is False)",
              file=sys.stderr)  # fmt: skip
        return 2
    text = report(run(args.model, args.layers, args.versions, tiny=args.tiny))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
