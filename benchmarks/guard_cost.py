"""What a planned module's guard costs per call (planner.torch.guards): the checks that the module and the
inputs' layouts are what a plan was made for, and the bound parameters' check (each still its holder's tensor,
unwritten: identity, version, memory, layout, sampled bytes) beside the planned call itself.

Usage: python benchmarks/guard_cost.py [--out docs/results/guard_cost.md] [--rounds 15]

One thread, pinned. For each model: the guarded call ``result(x)``, the same plan called unguarded
(``result.call_plan((x,))``: the bound parameters' check stays, it is part of binding), the guard's module and
layout checks alone, and the bound parameters' check alone; interleaved in rounds, medians of all rounds' samples.
Each check is timed twice: warm (called again and again) and cold, as a call finds it, just after the plan's own
kernels ran (``result.compiled.execute()``) and evicted the caches.
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
from cnn_blocks import build_model  # noqa: E402
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
    cnn, image = build_model("small-cnn", "fp32")
    return {"small-mlp 8x64": (small, torch.randn(8, 64)), "mlp 128x1024": (mlp, torch.randn(128, 1024)),
            "transformer block 128x768": (b.eval(), x), "small CNN 8x3x64x64": (cnn, image)}


def measure(name: str, module: nn.Module, x: torch.Tensor, rounds: int) -> dict[str, float]:
    result = planner.plan(module, (x,), backend="cpu", threads=1, max_candidates=8, cache=False)
    guard = result.guard
    result(x)  # binds the parameters
    watch = result.bound._watch  # noqa: SLF001 - the benchmark reads the binding

    def checks() -> object:
        return guard.state.changed(), input_signature((x,))

    def bound() -> object:
        return watch is None or watch.same()

    contenders: dict[str, Callable[[], object]] = {
        "guarded call": lambda: result(x),
        "unguarded call": lambda: result.call_plan((x,)),
        "checks": checks,
        "bound check": bound,
    }
    samples: dict[str, list[float]] = {k: [] for k in [*contenders, "checks cold", "bound check cold"]}
    with torch.no_grad():
        for fn in contenders.values():
            _time_us(fn, 3)
        for r in range(rounds):
            order = list(contenders)[r % len(contenders):] + list(contenders)[:r % len(contenders)]
            for k in order:
                samples[k] += _time_us(contenders[k], 5)
            for k, fn in (("checks cold", checks), ("bound check cold", bound)):
                for _ in range(3):
                    result.compiled.execute()
                    samples[k] += _time_us(fn, 1)
    out = {k: statistics.median(v) for k, v in samples.items()}
    out["guard share"] = out["checks cold"] / out["guarded call"]
    out["binding share"] = out["bound check cold"] / out["guarded call"]
    out["facts"] = len(guard.state.edges) + len(guard.state.attrs) + len(guard.state.tensors) + len(guard.state.derived)
    out["parameters"] = len(watch.tensors.tensors) if watch is not None else 0
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
        f"{args.rounds} interleaved rounds). *checks*: `ModuleState.changed()` and the input signature, run before "
        "every call, over *facts* guarded (submodule edges, plain attributes, parameter layouts, tensors values "
        "were computed from); *bound check*: `StateWatch.same()` over the bound *parameters* (part of binding, in "
        "the unguarded call too). *cold*: just after the plan's own kernels ran, as a call finds them; the shares "
        "are the cold checks over the guarded call.",
        "",
        "| model | guarded call | unguarded call | checks warm | checks cold | facts | bound check warm "
        "| bound check cold | parameters | guard share | binding share |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['guarded call']:,.1f} | {r['unguarded call']:,.1f} | {r['checks']:,.1f} | "
                     f"{r['checks cold']:,.1f} | {r['facts']:.0f} | {r['bound check']:,.1f} | "
                     f"{r['bound check cold']:,.1f} | {r['parameters']:.0f} | {100 * r['guard share']:.2f}% | "
                     f"{100 * r['binding share']:.2f}% |")
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
