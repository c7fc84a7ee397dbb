"""Markdown reports from one gpu_suite.sh run: c05_h200.md and mlp_epilogue_h200.md.

``python benchmarks/gpu_report.py RESULTS_DIR`` reads the JSON the suite wrote
(c05_sweep.json, c05_modes.json, measured_*.json, torch_*.json) and writes the
two markdown files beside them, with the exact commands, date and device.
Every figure printed comes from those files; nothing is estimated here.
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.cupy.c05 import SEED_MODES, SEED_SWEEP  # noqa: E402

SHAPES = (("mlp_4096", "M=N=K=4096 fp16"), ("mlp_decode16", "decode M=16, N=K=4096 fp16"))


def _load(d: Path, name: str) -> dict | None:
    p = d / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


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
        f"Measured device-to-device copy: {src['d2d_copy_gbps']:,.0f} GB/s (bytes read + written).",
        "",
    ]
    if sweep and "gpu" in sweep:
        lines += ["## Sweep", "", "| k | naive ms | naive+copy ms | fused ms | naive/fused | (naive+copy)/fused | "
                  "traffic bound (k, k+1) | seed RTX 5090 | fused BW / copy BW |", "|---|---|---|---|---|---|---|---|---|"]
        by_k: dict[int, dict] = {}
        for r in sweep["gpu"]:
            by_k.setdefault(r["k"], {})[r["tag"]] = r
        for k, t in sorted(by_k.items()):
            nv, fu = t["naive"], t["fused"]
            bw = 2 * sweep["n"] * 4 / (fu["median_ms"] * 1e-3) / 1e9
            seed = SEED_SWEEP.get(k)
            lines.append(
                f"| {k} | {nv['median_ms']:.3f} | {nv['with_copy_ms']:.3f} | {fu['median_ms']:.3f} | "
                f"{nv['median_ms'] / fu['median_ms']:.2f}x | {nv['with_copy_ms'] / fu['median_ms']:.2f}x | "
                f"{k}, {k + 1} | {f'{seed[0] / seed[1]:.2f}x' if seed else '-'} | {bw / sweep['d2d_copy_gbps']:.0%} |"
            )
        lines.append("")
    if modes and "gpu" in modes:
        lines += ["## Modes (k = 4)", "", "| tag | median ms | blocks/SM (driver) | regs | seed RTX 5090 |",
                  "|---|---|---|---|---|"]
        for r in modes["gpu"]:
            s_ms, s_occ = SEED_MODES[r["tag"]]
            lines.append(f"| {r['tag']} | {r['median_ms']:.3f} | {r['blocks_per_sm']} | {r['regs_max']} | "
                         f"{s_ms:.3f} ms, {s_occ} blocks/SM |")
        d_ = {r["tag"]: r for r in modes["gpu"]}
        lines += ["", f"fused/naive {d_['naive']['median_ms'] / d_['fused']['median_ms']:.2f}x; "
                      f"fat/fused {d_['fat']['median_ms'] / d_['fused']['median_ms']:.2f}x slower.", ""]
    return "\n".join(lines)


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
        lines += [f"## {label}", "", f"Device: {m.get('device')} ({m.get('sm_count')} SMs).", "",
                  "| plan | kernels | est us (h200 spec) | measured us | CUDA graph us | verdict |",
                  "|---|---|---|---|---|---|"]
        for c in sorted(meas["candidates"], key=lambda c: (c["meas_us"] is None, c["meas_us"] or 0)):
            meas_s = f"{c['meas_us']:.2f}" if c["meas_us"] is not None else "-"
            g = c.get("graph_us")
            lines.append(f"| {c['plan']} | {c['composition']} | {c['est_us']:.2f} | {meas_s} | "
                         f"{f'{g:.2f}' if g else '-'} | {c['verdict']} |")
        timed = [c for c in meas["candidates"] if c["meas_us"] is not None]
        lt = [c for c in timed if c["composition"].startswith("cublaslt(DEFAULT):1")]
        custom = [c for c in timed if c["composition"] == "gemm_epilogue:1"]
        if timed:
            best = min(timed, key=lambda c: c["meas_us"])
            lines += ["", f"Searched best: {best['plan']} {best['composition']} at {best['meas_us']:.2f} us."]
            if custom and lt:
                pct = min(c["meas_us"] for c in lt) / custom[0]["meas_us"]
                lines.append(f"Custom fused GEMM+epilogue kernel [4]: {custom[0]['meas_us']:.2f} us, "
                             f"{pct:.0%} of the speed of the fastest cuBLASLt(DEFAULT)-based plan.")
            if torch:
                te, tc = torch["torch_eager"]["meas_us"], torch["torch_compile"]["meas_us"]
                lines.append(f"torch {torch['torch']}: eager {te} us, torch.compile {tc} us.")
                faster = min(t for t in (te, tc) if t is not None) if (te or tc) else None
                if faster is not None:
                    verdict = "no slower than" if best["meas_us"] <= faster else "SLOWER than"
                    lines.append(f"The searched best is {verdict} the faster torch baseline "
                                 f"({best['meas_us']:.2f} vs {faster:.2f} us).")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    d = Path(sys.argv[1])
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    (d / "c05_h200.md").write_text(c05_markdown(d, when))
    (d / "mlp_epilogue_h200.md").write_text(mlp_markdown(d, when))
    print(f"wrote {d / 'c05_h200.md'} and {d / 'mlp_epilogue_h200.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
