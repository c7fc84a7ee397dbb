"""Markdown reports from one gpu_suite.sh run: c05_h200.md, mlp_epilogue_h200.md and gpu_search_h200.md.

``python benchmarks/gpu_report.py RESULTS_DIR`` reads the JSON the suite wrote
(c05_sweep.json, c05_modes.json, measured_*.json, torch_*.json) and writes the
three markdown files beside them, with the exact commands, date and device.
Every figure printed comes from those files; nothing is estimated here.
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from backends.cupy.c05 import c05_table  # noqa: E402
from backends.cupy.runner import ranks_by_graph  # noqa: E402

SHAPES = (("mlp_4096", "M=N=K=4096 fp16"), ("mlp_decode16", "decode M=16, N=K=4096 fp16"))


def _load(d: Path, name: str) -> dict | None:
    p = d / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def _markdown_table(result: dict, rows: list[dict]) -> list[str]:
    header, cells, failures = c05_table(result, rows)
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(c) + " |" for c in cells]
    return out + [f"- failed: {f}" for f in failures] + [""]


def c05_markdown(d: Path, when: str) -> str:
    sweep, modes = _load(d, "c05_sweep"), _load(d, "c05_modes")
    lines = ["# C-05 on H200 (seed 001)", ""]
    src = sweep or modes
    if src is None or "gpu" not in src:
        return "\n".join([*lines, "No GPU results in this run.", ""])
    m = src["machine"]
    lines += [
        f"Device: {m['device']} ({m['sm_count']} SMs), cupy {m['cupy']}, CUDA runtime {m['cuda_runtime']}. Date: {when}.",
        "Commands: `fusion-planner bench c05 --mode sweep|modes --export F` (CPU), then "
        "`python -m backends.cupy c05 F -o RESULT` (H200). n = 2^24 fp32, block 256, grid 8 x SMs, "
        "CUDA events, 2 warm-ups, median of 7.",
        "",
        "The seed's program (backends/cupy/c05_seed.py: its scalar-load kernels; naive with its device copies, "
        "one in and one more out when k is even; fat with its warp reduction, atomicAdd and memset) is the "
        "reproduction; the planner's own kernels (vectorised loads) follow as separate rows.",
        "",
        f"Measured device-to-device copy: {src['d2d_copy_gbps']:,.0f} GB/s (bytes read + written).",
        "",
    ]
    for title, result in (("Sweep", sweep), ("Modes (k = 4)", modes)):
        if not result or "gpu" not in result:
            continue
        lines += [f"## {title}: the seed's program", "", *_markdown_table(result, result.get("seed", []))]
        lines += [f"## {title}: the planner's kernels", "", *_markdown_table(result, result["gpu"])]
    return "\n".join(lines)


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rho (average ranks for ties); None below 3 points or with a constant side. Numpy only: the
    device has no scipy."""
    if len(xs) < 3:
        return None

    def ranks(v: list[float]) -> np.ndarray:
        a = np.asarray(v, dtype=np.float64)
        order = np.argsort(a, kind="stable")
        r = np.empty(len(a))
        r[order] = np.arange(1, len(a) + 1)
        for value in np.unique(a):  # ties share their average rank
            r[a == value] = r[a == value].mean()
        return r

    rx, ry = ranks(xs), ranks(ys)
    if rx.std() == 0 or ry.std() == 0:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])


def mlp_markdown(d: Path, when: str) -> str:
    lines = ["# mlp-epilogue search on H200", "", f"Date: {when}.",
             "Commands: `fusion-planner export-candidates --example mlp-epilogue --m M --n 4096 --k 4096 --dtype fp16 "
             "-o F` (CPU), `python -m backends.cupy time F -o measured.json` and "
             "`python benchmarks/torch_baseline.py F -o torch.json` (H200, same run). Every candidate is verified "
             "against the numpy reference before it is timed (CUDA events, 2 warm-ups, median of 7).", ""]
    for name, label in SHAPES:
        meas, torch = _load(d, f"measured_{name}"), _load(d, f"torch_{name}")
        if meas is None:
            lines += [f"## {label}", "", "Not run.", ""]
            continue
        m = meas["machine"]
        by_graph = ranks_by_graph(meas["candidates"])

        def rank_us(c: dict, by_graph: bool = by_graph) -> float:
            return c["graph_us"] if by_graph else c["meas_us"]

        basis = ("CUDA-graph replay time (every timed candidate was captured)" if by_graph else
                 "event-timed median (not every candidate was captured as a CUDA graph)")
        lines += [f"## {label}", "", f"Device: {m.get('device')} ({m.get('sm_count')} SMs). Ranked by {basis}.", "",
                  "| plan | kernels | est us (h200 spec) | measured us | CUDA graph us | verdict |",
                  "|---|---|---|---|---|---|"]
        timed = [c for c in meas["candidates"] if c["meas_us"] is not None]
        for c in sorted(timed, key=rank_us) + [c for c in meas["candidates"] if c["meas_us"] is None]:
            meas_s = f"{c['meas_us']:.2f}" if c["meas_us"] is not None else "-"
            g = c.get("graph_us")
            lines.append(f"| {c['plan']} | {c['composition']} | {c['est_us']:.2f} | {meas_s} | "
                         f"{f'{g:.2f}' if g else '-'} | {c['verdict']} |")
        lt = [c for c in timed if c["composition"].startswith("cublaslt(DEFAULT):1")]
        custom = [c for c in timed if c["composition"] == "gemm_epilogue:1"]
        if timed:
            best = min(timed, key=rank_us)
            rho = spearman([c["est_us"] for c in timed], [rank_us(c) for c in timed])
            lines += ["", f"Searched best: {best['plan']} {best['composition']} at {rank_us(best):.2f} us.",
                      f"Spearman rho, the cost model's estimate against the ranking time over {len(timed)} timed "
                      f"candidates: {'n/a' if rho is None else f'{rho:.2f}'}."]
            if custom and lt:
                pct = min(rank_us(c) for c in lt) / rank_us(custom[0])
                lines.append(f"Custom fused GEMM+epilogue kernel [4]: {rank_us(custom[0]):.2f} us, "
                             f"{pct:.0%} of the speed of the fastest cuBLASLt(DEFAULT)-based plan.")
            if torch:
                te, tc = torch["torch_eager"]["meas_us"], torch["torch_compile"]["meas_us"]
                lines.append(f"torch {torch['torch']}: eager {te} us, torch.compile {tc} us.")
                faster = min(t for t in (te, tc) if t is not None) if (te or tc) else None
                if faster is not None:
                    # torch's figures are event-timed, launches included: compared with our event time
                    verdict = "no slower than" if best["meas_us"] <= faster else "SLOWER than"
                    lines.append(f"The searched best is {verdict} the faster torch baseline "
                                 f"({best['meas_us']:.2f} vs {faster:.2f} us, both event-timed).")
        lines.append("")
    return "\n".join(lines)


SEARCHES = (("heavy", "heavy example, n = 2^26 fp16", "--example heavy --dtype fp16"),
            ("transformer_l1", "one transformer layer, d_model 1024, 128 tokens, fp16 (16 best of the cost model)",
             "--example transformer --layers 1 --dtype fp16 --top 16"),
            ("transformer_s1024", "one transformer layer, d_model 1024, 1024 tokens, fp16 (8 best of the cost model)",
             "--example transformer --layers 1 --dtype fp16 --seq 1024 --top 8"))


def _kernel_label(f: dict) -> str:
    return f"cublaslt({f.get('epilogue')})" if f.get("kind") == "cublaslt" else f"{f.get('kind')} {f.get('name', '')}"


def _torch_lines(torch: dict | None, best: dict) -> list[str]:
    """torch eager and torch.compile on the same graph and inputs (event-timed, as our ``meas_us``)."""
    if torch is None:
        return []
    te, tc = torch["torch_eager"]["meas_us"], torch["torch_compile"]["meas_us"]
    lines = ["", f"torch {torch['torch']} on the same graph (op by op, `benchmarks/torch_graph.py`) and inputs: "
             f"eager {te} us, torch.compile {tc} us (event-timed, no CUDA graph)."]
    timed = [t for t in (te, tc) if t is not None]
    if timed:
        ratio = min(timed) / best["meas_us"]
        lines.append(f"The best plan, event-timed ({best['meas_us']:.2f} us), is {ratio:.2f}x the faster of them.")
    return lines


def search_markdown(d: Path, when: str) -> str:
    """The planner's own searches beside the seed's tables: every candidate ranked, the estimate beside the
    measurement, and where the best plan's time goes, kernel by kernel."""
    lines = ["# The planner's search on H200", "", f"Date: {when}.",
             "Commands: `fusion-planner export-candidates ARGS --device h200 -o F` (CPU), then "
             "`python -m backends.cupy time F -o measured.json` (H200). Every candidate is verified against the "
             "numpy reference before it is timed: CUDA events, 2 warm-ups, median of 7, L2 flushed before each run; "
             "each kernel's time within the run (an event after each) beside its registers and occupancy.", ""]
    for name, label, args in SEARCHES:
        meas = _load(d, f"measured_{name}")
        lines += [f"## {label}", "", f"`export-candidates {args}`", ""]
        if meas is None:
            lines += ["Not run.", ""]
            continue
        by_graph = ranks_by_graph(meas["candidates"])

        def rank_us(c: dict, by_graph: bool = by_graph) -> float:
            return c["graph_us"] if by_graph else c["meas_us"]

        timed = sorted((c for c in meas["candidates"] if c["meas_us"] is not None), key=rank_us)
        lines += [f"Device: {meas['machine'].get('device')}. Ranked by "
                  f"{'CUDA-graph replay' if by_graph else 'event-timed'} time.", "",
                  "| # | kernels | est us (h200 spec) | measured us | CUDA graph us | verdict |", "|---|---|---|---|---|---|"]
        for i, c in enumerate(timed + [c for c in meas["candidates"] if c["meas_us"] is None], 1):
            g = c.get("graph_us")
            meas_s = f"{c['meas_us']:.2f}" if c["meas_us"] is not None else "-"
            lines.append(f"| {i} | {c['composition']} | {c['est_us']:.2f} | {meas_s} | {f'{g:.2f}' if g else '-'} | "
                         f"{c['verdict']} |")
        if not timed:
            lines.append("")
            continue
        best = timed[0]
        unfused = max(meas["candidates"], key=lambda c: len(c.get("kernels", [])))
        rho = spearman([c["est_us"] for c in timed], [rank_us(c) for c in timed])
        lines += _torch_lines(_load(d, f"torch_{name}"), best)
        lines += ["", f"Best: {best['composition']} at {rank_us(best):.2f} us"
                  + (f", {rank_us(unfused) / rank_us(best):.2f}x the most decomposed plan ({len(unfused['kernels'])} "
                     f"kernels, {rank_us(unfused):.2f} us)." if unfused["meas_us"] is not None else "."),
                  f"Spearman rho, estimate against measurement, {len(timed)} candidates: "
                  f"{'n/a' if rho is None else f'{rho:.2f}'}.", "", "The best plan, kernel by kernel:", "",
                  "| kernel | regs | blocks/SM | measured us |", "|---|---|---|---|"]
        for f in best.get("kernels", []):
            us = f.get("meas_us")
            lines.append(f"| {_kernel_label(f)} | {f.get('regs', '-')} | {f.get('occupancy', '-')} | "
                         f"{'-' if us is None else f'{us:.2f}'} |")
        lines.append("")
    return "\n".join(lines)


def measured_when(d: Path) -> str:
    """When the results were measured: the newest ``date`` of the measured files (the runner writes it), else
    now (a report written on the device, right after the run)."""
    dates = [json.loads(p.read_text()).get("date") for p in sorted(d.glob("measured_*.json"))]
    stamps = sorted(datetime.fromisoformat(x) for x in dates if isinstance(x, str))
    return (stamps[-1] if stamps else datetime.now(UTC)).strftime("%Y-%m-%d %H:%M UTC")


def main() -> int:
    d = Path(sys.argv[1])
    when = measured_when(d)
    (d / "c05_h200.md").write_text(c05_markdown(d, when))
    (d / "mlp_epilogue_h200.md").write_text(mlp_markdown(d, when))
    (d / "gpu_search_h200.md").write_text(search_markdown(d, when))
    print(f"wrote {d / 'c05_h200.md'}, {d / 'mlp_epilogue_h200.md'} and {d / 'gpu_search_h200.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
