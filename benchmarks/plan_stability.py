"""Does the measured search choose the same (or an equally fast) plan each time? Plan one model several times
from scratch and time the chosen plans against each other.

Usage: python benchmarks/plan_stability.py [--out docs/results/plan_stability.md] [--workloads block,attention,...]
                                           [--plans 3] [--rounds 11] [--noise]

For each workload of ``cpu_peers.py`` a child process pinned to one core (one thread, the environment of
``cpu_peers.py``'s mode ``1``) plans the module ``--plans`` times with ``planner.plan(..., backend="cpu",
cache=False)`` (every search from scratch; compiled kernels may come from the kernel cache, which decides
nothing), then times the chosen plans' calls in interleaved rounds (three calls each, the order rotating) and
reports each run's median and the spread of the distinct plans chosen (slowest over fastest, a plan chosen by
several runs timed over all their calls): runs that chose the same plan run the same kernels, and what their
calls' times differ by is the timing's noise and the memory each result owns, which the report gives beside it.
``--noise`` runs the whole child beside a neighbour process streaming memory on another core (``noise.py``), as
on a busy shared machine.

Target (issue 36): the chosen plans' times within 10% of each other under the noise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cpu_peers import _time_us, build_workload, child_env, run_child, versions
from noise import neighbour, pick_cores

WORKLOADS = ("ew8", "gpt2mlp", "block", "attention", "softmax", "layernorm", "rmsnorm")
TARGET_SPREAD = 1.10


def child(workload: str, plans: int, rounds: int) -> dict[str, Any]:
    import planner

    w = build_workload(workload)
    results, rows = [], []
    for _ in range(plans):
        t0 = time.perf_counter()
        result = planner.plan(w.module, w.inputs, backend="cpu", cache=False)
        plan_s = time.perf_counter() - t0
        results.append(result)
        rows.append({"plan_s": plan_s, "kernels": len(result.plan.kernels), "composition": result.plan.composition(),
                     "key": result.plan.key})
    calls = [(lambda r=r: r(*w.inputs)) for r in results]
    for call in calls:
        call()
    samples: list[list[float]] = [[] for _ in calls]
    for r in range(rounds):
        order = list(range(len(calls)))
        order = order[r % len(order):] + order[: r % len(order)]
        for i in order:
            samples[i] += _time_us(calls[i], 3)
    for row, s in zip(rows, samples, strict=True):
        row["median_us"] = statistics.median(s)
        row["samples_us"] = s
    return {"workload": workload, "plans": rows}


def spreads(plans: list[dict[str, Any]]) -> tuple[float, float | None]:
    """(The spread of the distinct plans chosen: each plan's median over the calls of every run that chose it,
    slowest over fastest; the widest spread among runs that chose the same plan, each timed in the buffers of its
    own result, or None where no plan was chosen twice.)"""
    by_key: dict[str, list[dict[str, Any]]] = {}
    for p in plans:
        by_key.setdefault(p["key"], []).append(p)
    times = [statistics.median([t for p in same for t in p["samples_us"]]) for same in by_key.values()]
    repeated = [[p["median_us"] for p in same] for same in by_key.values() if len(same) > 1]
    return max(times) / min(times), max((max(m) / min(m) for m in repeated), default=None)


def report(rows: list[dict[str, Any]], command: str, noise_line: str) -> str:
    from planner.core.machine import describe

    lines = [
        "# Plan stability: the same model planned from scratch several times",
        "",
        f"Command: `{command}`  ",
        f"Machine: {describe()}  ",
        f"Date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}  ",
        f"Versions: {versions()}  ",
        f"Noise: {noise_line}",
        "",
        "Method: benchmarks/plan_stability.py's docstring. One pinned thread; each run's planned call timed against "
        "the others in interleaved rounds (median µs); *spread*: the distinct plans chosen, each timed over the calls "
        "of every run that chose it, slowest over fastest (1.000: one plan chosen every time); *same plan*: the "
        "widest spread among runs that chose the same plan, each in its own result's buffers (the timing's own "
        "noise, for reading the spread; — where no plan was chosen twice).",
        "",
        "| workload | plans (kernels) | distinct plans | call µs per run | spread | same plan | planning s | "
        "target ≤ 1.10 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    met = 0
    for r in rows:
        ps = r["plans"]
        times = [p["median_us"] for p in ps]
        plan_s = [p["plan_s"] for p in ps]
        spread, same = spreads(ps)
        ok = spread <= TARGET_SPREAD
        met += ok
        lines.append(
            f"| {r['workload']} | {', '.join(str(p['kernels']) for p in ps)} | {len({p['key'] for p in ps})} | "
            f"{', '.join(f'{t:,.0f}' for t in times)} | {spread:.3f} | {'—' if same is None else f'{same:.3f}'} | "
            f"{', '.join(f'{q:.1f}' for q in plan_s)} | {'met' if ok else '**not met**'} |"
        )
    lines += ["", f"Target met on {met} of {len(rows)} workloads.", ""]
    lines += ["Plans chosen:", ""]
    for r in rows:
        for i, p in enumerate(r["plans"]):
            lines.append(f"- {r['workload']} #{i + 1}: {p['composition']}")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the markdown report here")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--plans", type=int, default=3, help="times each workload is planned from scratch")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--noise", action="store_true", help="a neighbour process streams memory on another core")
    p.add_argument("--child", nargs=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.plans, args.rounds)))
        return
    measured, busy = pick_cores()
    rows = []
    with tempfile.TemporaryDirectory() as caches, neighbour(busy if args.noise else None) as noise_line:
        if not args.noise:
            noise_line = "none (the machine as it was)"
        env = child_env("1", Path(caches))
        for wl in (w for w in args.workloads.split(",") if w):
            print(f"{wl}", file=sys.stderr)
            rows.append(run_child(["--plans", str(args.plans), "--rounds", str(args.rounds), "--child", wl], env,
                                  {measured}, script=__file__))
    command = "python benchmarks/plan_stability.py " + " ".join(sys.argv[1:])
    text = report(rows, command.strip(), noise_line)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
