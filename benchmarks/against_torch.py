"""What the torch-module benchmarks share (``transformers_layers.py``, ``cnn_blocks.py``): a model planned by
fusion-planner, checked against eager torch, then timed against eager torch and torch.compile in interleaved
rounds, in a child process per thread mode and dtype; the report's table. With ``--first-call``, each model's
cold first call too: in a fresh process on one pinned core with empty caches (kernels, plans, calibration,
inductor), planning or compiling the model and calling it once, fusion-planner against torch.compile."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cpu_peers import _time_us, bf16_units, child_env, run_child, settle, versions

#: (module, its input or a tuple of its inputs) of a model by name and dtype
Build = Callable[[str, str], tuple[Any, Any]]


def _inputs(x: Any) -> tuple[Any, ...]:
    return x if isinstance(x, tuple) else (x,)


def steady(build: Build, name: str, dtype: str, rounds: int, mode: str) -> dict[str, Any]:
    """Plan ``name``, check the planned call against eager torch within the dtype's tolerance, then the median
    µs of eager torch, torch.compile and the planned call over ``rounds`` interleaved rounds (three calls each,
    the order rotating; on every core each turn first runs untimed for ``cpu_peers.SETTLE_S``)."""
    import torch

    import planner
    from planner.core.tolerance import allclose_report

    module, x = build(name, dtype)
    args = _inputs(x)
    result = planner.plan(module, args, backend="cpu")
    compiled = torch.compile(module)
    calls = {"torch": lambda: module(*args), "torch.compile": lambda: compiled(*args), "fp.call": lambda: result(*args)}
    with torch.no_grad():
        want = module(*args).float().numpy()
        ok, max_abs, _ = allclose_report(result(*args).float().numpy(), want, dtype)
        if not ok:
            raise SystemExit(f"{name} {dtype}: the planned call differs from eager torch (max abs {max_abs:.3g})")
        for fn in calls.values():
            fn(), fn()
        samples: dict[str, list[float]] = {c: [] for c in calls}
        order = list(calls)
        for r in range(rounds):
            for c in order[r % len(order):] + order[: r % len(order)]:
                settle(mode, calls[c])
                samples[c] += _time_us(calls[c], 3)
    kinds = [k.kind for k in result.plan.kernels]
    return {"name": name, "dtype": dtype, "median_us": {c: statistics.median(v) for c, v in samples.items()},
            "kernels": len(kinds), "opaque": kinds.count("opaque"), "composition": result.plan.composition()}


#: the contenders of the cold first call
FIRST_CONTENDERS = ("torch.compile", "fp.call")


def first_call(build: Build, name: str, dtype: str, contender: str) -> dict[str, Any]:
    """In a fresh process: plan (or compile) the model and call it once; wall seconds (fusion-planner's includes
    its check against eager torch and its interleaved re-measurement, as ``planner.plan`` makes them)."""
    import torch

    import planner

    module, x = build(name, dtype)
    args = _inputs(x)
    t0 = time.perf_counter()
    if contender == "fp.call":
        result = planner.plan(module, args, backend="cpu")
        call = lambda: result(*args)  # noqa: E731
    else:
        compiled = torch.compile(module)
        call = lambda: compiled(*args)  # noqa: E731
    with torch.no_grad():
        call()
    return {"first_call_s": time.perf_counter() - t0}


def first_calls(names: list[str], dtypes: list[str], script: str) -> list[dict[str, Any]]:
    """Each model's cold first call per contender, each in its own child on one pinned core with empty caches."""
    core = {max(os.sched_getaffinity(0))}
    rows = []
    for name in names:
        for dtype in dtypes:
            row: dict[str, Any] = {"name": name, "dtype": dtype}
            for c in FIRST_CONTENDERS:
                with tempfile.TemporaryDirectory() as caches:
                    row[c] = run_child(["--first", name, dtype, c], child_env("1", Path(caches)), core, script)
                print(f"[first] {name} {dtype} {c}: {row[c]['first_call_s']:.2f} s", file=sys.stderr)
            rows.append(row)
    return rows


def first_call_report(column: str, rows: list[dict[str, Any]]) -> list[str]:
    lines = ["## Cold first call (one thread, pinned; empty caches)", "",
             "Seconds from the model built to its first call returned: `planner.plan` (calibration, search, check "
             "against eager torch, re-measurement) or `torch.compile` (inductor), then one call.", "",
             f"| {column} | dtype | torch.compile cold | fusion-planner cold | ratio | ≤ torch.compile |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        tc, fp = row["torch.compile"]["first_call_s"], row["fp.call"]["first_call_s"]
        lines.append(f"| {row['name']} | {row['dtype']} | {tc:.2f} | {fp:.2f} | {tc / fp:.2f} | "
                     f"{'met' if fp <= tc else '**not met**'} |")
    met = sum(r["fp.call"]["first_call_s"] <= r["torch.compile"]["first_call_s"] for r in rows)
    return [*lines, "", f"Cold first call ≤ torch.compile's: {met} of {len(rows)}.", ""]


def report(title: str, column: str, script: str, rows: dict[str, list[dict[str, Any]]], command: str) -> str:
    from planner.core.machine import cpu_model

    lines = [
        f"# {title}: fusion-planner against eager torch and torch.compile", "",
        f"Command: `{command}`  ",
        f"Machine: {cpu_model()} ({platform.machine()}, CPUs as the modes say), Python {platform.python_version()}  ",
        f"Date: {datetime.date.today().isoformat()}  ",
        f"Versions: {versions()}  ",
        f"bf16 products: {bf16_units()}", "",
        f"Method: {script}'s docstring. Medians in µs; a ratio is the peer's time over the planned call's (> 1: "
        "fusion-planner is faster).", "",
    ]
    for mode, per in rows.items():
        lines += [f"## {'one thread, pinned' if mode == '1' else 'all cores'}", "",
                  f"| {column} | dtype | torch | torch.compile | fp call | vs torch | vs torch.compile | Opaque kernels | plan |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for row in per:
            m = row["median_us"]
            lines.append(f"| {row['name']} | {row['dtype']} | {m['torch']:,.0f} | {m['torch.compile']:,.0f} | "
                         f"{m['fp.call']:,.0f} | {m['torch'] / m['fp.call']:.2f} | {m['torch.compile'] / m['fp.call']:.2f} | "
                         f"{row['opaque']} of {row['kernels']} | {row['composition']} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(doc: str, build: Build, names: tuple[str, ...], title: str, column: str, script: str) -> None:
    """The command line of a benchmark script: its options, a child per thread mode, name and dtype, the report."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--out", help="write the markdown report here")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument(f"--{column}s", dest="names", default=",".join(names))
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--modes", default="1,all", help="thread modes: 1 (one pinned thread), all (every core)")
    p.add_argument("--first-call", action="store_true",
                   help="also each model's cold first call (one pinned thread, empty caches) against torch.compile's")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--first", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(steady(build, args.child[0], args.child[1], args.rounds, args.child[2])))
        return
    if args.first:
        print(json.dumps(first_call(build, *args.first)))
        return
    cores = os.sched_getaffinity(0)
    rows: dict[str, list[dict[str, Any]]] = {}
    for mode in filter(None, args.modes.split(",")):
        rows[mode] = []
        with tempfile.TemporaryDirectory() as caches:
            env = child_env(mode, Path(caches))
            for name in args.names.split(","):
                for dtype in args.dtypes.split(","):
                    print(f"[{mode}] {name} {dtype}", file=sys.stderr)
                    rows[mode].append(run_child(["--rounds", str(args.rounds), "--child", name, dtype, mode], env,
                                                {max(cores)} if mode == "1" else None, script))
    text = report(title, column, f"benchmarks/{Path(script).name}", rows,
                  (f"python benchmarks/{Path(script).name} " + " ".join(sys.argv[1:])).strip())
    if args.first_call:
        firsts = first_calls(args.names.split(","), args.dtypes.split(","), script)
        text += "\n" + "\n".join(first_call_report(column, firsts))
    if args.out:
        Path(args.out).write_text(text)
    print(text)
