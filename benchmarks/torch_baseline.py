"""torch eager and torch.compile on a bundle's graph, same inputs, same timing.

``python benchmarks/torch_baseline.py BUNDLE.json -o torch.json``: the
competitor for ``python -m backends.cupy time`` on the GPU machine (no
egglog).  The graph is the bundle's reference plan run op by op in torch
(``benchmarks/torch_graph.py``: ``gelu(x @ w + b) + r`` for mlp-epilogue, a whole
transformer layer, ...), so torch.compile fuses what Inductor fuses.  Both are
verified against the bundle's numpy reference before they are timed with CUDA
events (2 warm-ups after compilation, median of 7, the L2 flushed before each
timed call as for the plans).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.cupy.bundle import load_bundle  # noqa: E402
from benchmarks.torch_graph import TorchFormError, torch_program  # noqa: E402
from planner.core.reference import execute_plan  # noqa: E402
from planner.core.tolerance import check_outputs  # noqa: E402

TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def event_median_us(torch, fn, warmup: int, repeats: int) -> float:
    """Median µs of ``fn`` between CUDA events; each timed call follows an untimed memset of twice the L2, as the
    planner's runs do (backends/cupy/gpu.py, ``l2_flusher``), so both sides are timed with a cold L2."""
    scratch = torch.empty(2 * torch.cuda.get_device_properties(0).L2_cache_size, dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        scratch.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--check-cpu", action="store_true", help="dry run: verify torch eager on the CPU, time nothing")
    args = ap.parse_args()

    import torch

    bundle = load_bundle(args.bundle)
    try:
        program = torch_program(torch, bundle.reference)
    except TorchFormError as exc:
        print(f"{ap.prog}: error: {bundle.graph}: {exc}", file=sys.stderr)
        return 2
    inputs = bundle.make_inputs()
    device_out = execute_plan(bundle.reference, inputs, mode="device")
    oracle = execute_plan(bundle.reference, inputs, mode="oracle")
    dev = "cpu" if args.check_cpu else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        print(f"{ap.prog}: error: torch {torch.__version__} sees no CUDA device", file=sys.stderr)
        return 2
    tensors = {name: torch.from_numpy(np.asarray(v, np.float32)).to(dev, getattr(torch, TORCH_DTYPES[
        bundle.tensors[name].dtype])) for name, v in inputs.items()}

    def eager() -> list:
        return program(tensors)

    def verdict(fn) -> tuple[str | None, float, float]:
        got = [o.float().cpu().numpy() for o in fn()]  # the first call compiles (outside any timed region)
        return check_outputs(bundle.reference, got, device_out, oracle=oracle)

    if args.check_cpu:
        reason, max_abs, _ = verdict(eager)
        print(f"{bundle.graph} torch eager on the CPU: {'verified' if reason is None else 'MISMATCH: ' + reason} "
              f"(max_abs {max_abs:.3g})")
        return 0 if reason is None else 1

    compiled = torch.compile(eager)
    out = {"graph": bundle.graph, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with torch.no_grad():
        for name, fn in (("torch_eager", eager), ("torch_compile", compiled)):
            reason, max_abs, max_rel = verdict(fn)
            entry = {"ok": reason is None, "max_abs": max_abs, "max_rel": max_rel, "meas_us": None}
            if reason is None:
                entry["meas_us"] = round(event_median_us(torch, fn, args.warmup, args.repeats), 3)
            out[name] = entry
            print(f"{bundle.graph} {name}: {'verified' if reason is None else 'MISMATCH: ' + reason} "
                  f"(max_abs {max_abs:.3g})  {entry['meas_us']} us")
    Path(args.output).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
