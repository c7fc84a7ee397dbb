"""What the torch-module benchmarks share (``transformers_layers.py``, ``cnn_blocks.py``): a model planned by
fusion-planner, checked against eager torch, then timed against eager torch and torch.compile in interleaved
rounds, in a child process per thread mode and dtype; the report's table."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cpu_peers import _time_us, bf16_units, child_env, run_child, settle, versions

#: (module, its input) of a model by name and dtype
Build = Callable[[str, str], tuple[Any, Any]]


def steady(build: Build, name: str, dtype: str, rounds: int, mode: str) -> dict[str, Any]:
    """Plan ``name``, check the planned call against eager torch within the dtype's tolerance, then the median
    µs of eager torch, torch.compile and the planned call over ``rounds`` interleaved rounds (three calls each,
    the order rotating; on every core each turn first runs untimed for ``cpu_peers.SETTLE_S``)."""
    import torch

    import planner
    from planner.core.tolerance import allclose_report

    module, x = build(name, dtype)
    result = planner.plan(module, (x,), backend="cpu")
    compiled = torch.compile(module)
    calls = {"torch": lambda: module(x), "torch.compile": lambda: compiled(x), "fp.call": lambda: result(x)}
    with torch.no_grad():
        want = module(x).float().numpy()
        ok, max_abs, _ = allclose_report(result(x).float().numpy(), want, dtype)
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
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(steady(build, args.child[0], args.child[1], args.rounds, args.child[2])))
        return
    cores = os.sched_getaffinity(0)
    rows: dict[str, list[dict[str, Any]]] = {}
    for mode in args.modes.split(","):
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
    if args.out:
        Path(args.out).write_text(text)
    print(text)
