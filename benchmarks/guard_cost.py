"""What a planned module's guard costs per call (planner.torch.guards): the checks that the module and the
inputs' layouts are what a plan was made for, and the parameter freshness checks (identity, version, memory,
sampled bytes) beside the planned call itself.

Usage: python benchmarks/guard_cost.py [--out docs/results/guard_cost.md] [--rounds 15]

One thread, pinned. For each model: the guarded call ``result(x)``, the same plan called unguarded
(``result.call_plan((x,))``: the parameter freshness checks stay, they are part of binding), the guard's module
and layout checks alone, and the sampled-byte check of every bound parameter alone; interleaved in rounds, medians
of all rounds' samples.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parent.parent

import torch  # noqa: E402
from cpu_peers import _time_us  # noqa: E402
from torch import nn  # noqa: E402

import planner  # noqa: E402
from planner.core.machine import describe  # noqa: E402
from planner.torch.guards import input_signature  # noqa: E402


def _models() -> dict[str, tuple[nn.Module, torch.Tensor]]:
    sys.path.insert(0, str(ROOT / "examples"))
    from transformer_block import build as block

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).eval()
    small = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)).eval()
    b, (x,) = block(batch=1, seq=128, d_model=768, heads=12)
    return {"small-mlp 8x64": (small, torch.randn(8, 64)), "mlp 128x1024": (mlp, torch.randn(128, 1024)),
            "transformer block 128x768": (b.eval(), x)}


def measure(name: str, module: nn.Module, x: torch.Tensor, rounds: int) -> dict[str, float]:
    result = planner.plan(module, (x,), backend="cpu", threads=1, max_candidates=8, cache=False)
    guard, bound = result.guard, result.bound
    held = list(bound._bound.values()) if bound is not None else []  # noqa: SLF001 - the benchmark reads the binding

    contenders: dict[str, Callable[[], object]] = {
        "guarded call": lambda: result(x),
        "unguarded call": lambda: result.call_plan((x,)),
        "module and layout checks": lambda: (guard.state.changed(), input_signature((x,))),
        "parameter byte samples": lambda: [h.fresh(h.tensor) for h in held],
    }
    samples: dict[str, list[float]] = {k: [] for k in contenders}
    with torch.no_grad():
        for fn in contenders.values():
            _time_us(fn, 3)
        for r in range(rounds):
            order = list(contenders)[r % len(contenders):] + list(contenders)[:r % len(contenders)]
            for k in order:
                samples[k] += _time_us(contenders[k], 5)
    out = {k: statistics.median(v) for k, v in samples.items()}
    out["guard share"] = (out["module and layout checks"]) / out["guarded call"]
    out["binding share"] = out["parameter byte samples"] / out["guarded call"]
    out["checks"] = len(guard.state.edges) + len(guard.state.attrs) + len(guard.state.tensors)
    out["parameters"] = len(held)
    print(f"{name}: {out}", file=sys.stderr)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    torch.set_num_threads(1)
    rows = {name: measure(name, m, x, args.rounds) for name, (m, x) in _models().items()}
    lines = [
        "# What a planned module's guard costs per call",
        "",
        f"Command: `python benchmarks/guard_cost.py{' --out ' + args.out if args.out else ''}`  ",
        f"Machine: {describe()}  ",
        f"Date: {datetime.date.today()}",
        "",
        "Method: benchmarks/guard_cost.py's docstring (one pinned thread, the cpu backend; medians in µs of "
        f"{args.rounds} interleaved rounds). *module and layout checks*: `ModuleState.changed()` and the input "
        "signature, run before every call; *parameter byte samples*: identity, version, memory and 64 sampled "
        "bytes of each bound parameter (part of binding, in the unguarded call too).",
        "",
        "| model | guarded call | unguarded call | module and layout checks | checks | parameter byte samples "
        "| parameters | guard share | binding share |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['guarded call']:,.1f} | {r['unguarded call']:,.1f} | "
                     f"{r['module and layout checks']:,.1f} | {r['checks']:.0f} | {r['parameter byte samples']:,.1f} | "
                     f"{r['parameters']:.0f} | {100 * r['guard share']:.2f}% | {100 * r['binding share']:.2f}% |")
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
