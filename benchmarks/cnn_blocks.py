"""Convolutional blocks, planned by fusion-planner, against eager torch and torch.compile.

Usage: python benchmarks/cnn_blocks.py [--out docs/results/cnn_blocks.md] [--rounds 11]
                                      [--models basic,bottleneck,stem,small-cnn] [--dtypes fp32,bf16] [--modes 1,all]

Plain torch modules, random weights and BatchNorm statistics, eval mode, batch 1 (the small CNN: 8): ``basic`` is
ResNet-18's basic block at its first stage (64 channels, 56x56: two 3x3 convolutions with BatchNorm, ReLU and the
residual), ``bottleneck`` ResNet-50's bottleneck at its third stage (1,024 channels squeezed to 256, 14x14: 1x1,
3x3, 1x1), ``stem`` ResNet's stem (7x7 stride-2 convolution of a 224x224 image, BatchNorm, ReLU, 3x3 stride-2 max
pooling), ``small-cnn`` a whole network (a stride-2 stem, max pooling, two basic blocks of 32 channels, global
average pooling and a linear head) on 64x64 images.  Per thread mode and dtype a child process (``1``: one thread
pinned to one core; ``all``: every core; the environment of ``cpu_peers.py``) plans the model with
``planner.plan(..., backend="cpu")``, checks the planned call against eager torch within the dtype's tolerance,
then times eager, torch.compile (inductor) and the planned call in interleaved rounds (three calls each, the order
rotating); a figure is the median in µs.  The report lists how many kernels of the plan are Opaque torch calls.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from cpu_peers import _time_us, bf16_units, child_env, run_child, settle, versions

MODELS = ("basic", "bottleneck", "stem", "small-cnn")


def build_model(name: str, dtype: str) -> tuple[Any, Any]:
    """(module, its input) for one model, eval mode, BatchNorm statistics drawn at random."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Basic(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
            self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.relu(self.bn1(self.conv1(x)))
            return self.relu(self.bn2(self.conv2(y)) + x)

    class Bottleneck(nn.Module):
        def __init__(self, c: int, mid: int) -> None:
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(c, mid, 1, bias=False), nn.BatchNorm2d(mid)
            self.conv2, self.bn2 = nn.Conv2d(mid, mid, 3, padding=1, bias=False), nn.BatchNorm2d(mid)
            self.conv3, self.bn3 = nn.Conv2d(mid, c, 1, bias=False), nn.BatchNorm2d(c)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = F.relu(self.bn1(self.conv1(x)))
            y = F.relu(self.bn2(self.conv2(y)))
            return F.relu(self.bn3(self.conv3(y)) + x)

    class Stem(nn.Module):
        def __init__(self, c: int, kernel: int) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, c, kernel, stride=2, padding=kernel // 2, bias=False), nn.BatchNorm2d(c)
            self.pool = nn.MaxPool2d(3, 2, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.pool(F.relu(self.bn(self.conv(x))))

    class SmallCnn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem, self.blocks = Stem(32, 3), nn.Sequential(Basic(32), Basic(32))
            self.pool, self.head = nn.AdaptiveAvgPool2d(1), nn.Linear(32, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))

    torch.manual_seed(0)
    model, shape = {
        "basic": (lambda: Basic(64), (1, 64, 56, 56)),
        "bottleneck": (lambda: Bottleneck(1024, 256), (1, 1024, 14, 14)),
        "stem": (lambda: Stem(64, 7), (1, 3, 224, 224)),
        "small-cnn": (SmallCnn, (8, 3, 64, 64)),
    }.get(name, (None, None))
    if model is None:
        raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    module = model()
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.1)
    kind = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    return module.eval().to(kind), torch.randn(*shape, dtype=kind)


def steady(name: str, dtype: str, rounds: int, mode: str) -> dict[str, Any]:
    import torch

    import planner
    from planner.core.tolerance import allclose_report

    module, x = build_model(name, dtype)
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
    return {"model": name, "dtype": dtype, "median_us": {c: statistics.median(v) for c, v in samples.items()},
            "kernels": len(kinds), "opaque": kinds.count("opaque"), "composition": result.plan.composition()}


def report(rows: dict[str, list[dict[str, Any]]], command: str) -> str:
    from planner.core.machine import cpu_model

    lines = [
        "# Convolutional blocks: fusion-planner against eager torch and torch.compile", "",
        f"Command: `{command}`  ",
        f"Machine: {cpu_model()} ({platform.machine()}, CPUs as the modes say), Python {platform.python_version()}  ",
        f"Date: {datetime.date.today().isoformat()}  ",
        f"Versions: {versions()}  ",
        f"bf16 products: {bf16_units()}", "",
        "Method: benchmarks/cnn_blocks.py's docstring. Medians in µs; a ratio is the peer's time over the planned "
        "call's (> 1: fusion-planner is faster).", "",
    ]
    for mode, per in rows.items():
        lines += [f"## {'one thread, pinned' if mode == '1' else 'all cores'}", "",
                  "| model | dtype | torch | torch.compile | fp call | vs torch | vs torch.compile | Opaque kernels | plan |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for row in per:
            m = row["median_us"]
            lines.append(f"| {row['model']} | {row['dtype']} | {m['torch']:,.0f} | {m['torch.compile']:,.0f} | "
                         f"{m['fp.call']:,.0f} | {m['torch'] / m['fp.call']:.2f} | {m['torch.compile'] / m['fp.call']:.2f} | "
                         f"{row['opaque']} of {row['kernels']} | {row['composition']} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the markdown report here")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--modes", default="1,all", help="thread modes: 1 (one pinned thread), all (every core)")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(steady(args.child[0], args.child[1], args.rounds, args.child[2])))
        return
    cores = os.sched_getaffinity(0)
    rows: dict[str, list[dict[str, Any]]] = {}
    for mode in args.modes.split(","):
        rows[mode] = []
        with tempfile.TemporaryDirectory() as caches:
            env = child_env(mode, Path(caches))
            for name in args.models.split(","):
                for dtype in args.dtypes.split(","):
                    print(f"[{mode}] {name} {dtype}", file=sys.stderr)
                    rows[mode].append(run_child(["--rounds", str(args.rounds), "--child", name, dtype, mode], env,
                                                {max(cores)} if mode == "1" else None, __file__))
    text = report(rows, ("python benchmarks/cnn_blocks.py " + " ".join(sys.argv[1:])).strip())
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
