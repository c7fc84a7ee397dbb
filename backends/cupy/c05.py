"""Seed 001 (C-05) on a GPU, from a bundle: ``python -m backends.cupy c05 c05.json``.

``fusion-planner bench c05`` builds the plans (naive: one kernel per stage,
fused, fat) with the planner and either measures them in-process or writes
them with ``--export`` for a machine without egglog.  This module only needs
the bundle: on a GPU it first runs the seed's own program (``backends.cupy.c05_seed``: its scalar-load kernels, its copies,
its fat probe) for the reproduction table, then verifies each of the planner's plans against the numpy
reference and times it with CUDA events (median of repeats) as extra, labelled rows: naive again with the
seed program's device-to-device copies (one before; one more after when k is even, where the ping-pong leaves
the result in the scratch buffer), measures a plain device-to-device copy and prints both tables.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from backends.cupy.backend import plan_candidate
from backends.cupy.bundle import BundleError, Candidate, plan_to_json, read_bundle_json, variant_candidate
from backends.cupy.c05_seed import copies, run_seed
from backends.cupy.verify import allclose_report
from planner.core.cost import DeviceSpec
from planner.core.reference import execute_plan

log = logging.getLogger(__name__)

SCHEMA = "fusion-planner/c05/1"
#: seed 001 ("C-05"), the project's second design note, timed a chain of k affine+ReLU stages on an
#: RTX 5090, one kernel per stage (naive) against one fused kernel: k -> (naive ms, fused ms)
SEED_SWEEP = {2: (0.318, 0.082), 3: (0.333, 0.084), 4: (0.490, 0.083), 6: (0.662, 0.083), 8: (0.832, 0.085)}
#: seed 001's modes at k = 4: tag -> (median ms, blocks/SM)
SEED_MODES = {"naive": (0.491, 6), "fused": (0.083, 6), "fat": (0.667, 1)}


def c05_bundle(variants: list[tuple[str, int, Any]], mode: str, n: int, block: int, spec: DeviceSpec,
               offline: list[dict[str, Any]]) -> dict[str, Any]:
    """JSON of the C-05 plans: ``variants`` are (tag, k, Plan)."""
    return {
        "schema": SCHEMA,
        "mode": mode,
        "n": n,
        "block": block,
        "device_spec": spec.name,
        "sm_count_spec": spec.sm_count,
        "offline": offline,
        "variants": [
            {
                "tag": tag,
                "k": k,
                "graph": plan.graph,
                "tensors": {t: {"shape": list(tt.shape), "dtype": tt.dtype} for t, tt in plan.tensors.items()},
                **plan_to_json(plan),
            }
            for tag, k, plan in variants
        ],
    }


def write_json(data: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(data, indent=1))


def load_c05(path: str | Path) -> dict[str, Any]:
    data = read_bundle_json(path)
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("variants"), list):
        raise BundleError(f"{path}: not a C-05 bundle (schema {SCHEMA!r} with a list of 'variants' expected)")
    return data


def bundle_variants(data: dict[str, Any]) -> list[tuple[str, int, Candidate]]:
    out = []
    for i, v in enumerate(data["variants"]):
        cand = variant_candidate(v, i)  # checks that v is an object
        try:
            out.append((str(v["tag"]), int(v["k"]), cand))
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise BundleError(f"variants[{i}]: needs 'tag' and an integer 'k' ({exc})") from None
    return out


def gpu_executor() -> Any | None:
    try:
        from backends.cupy.gpu import CupyExecutor

        return CupyExecutor()
    except Exception as exc:  # no cupy, no driver or no device: the offline part still prints
        log.info("no GPU timing: %s", exc)
        print(f"no GPU timing on this machine ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
        return None


def gpu_row(tag: str, k: int, cand: Candidate, ex: Any, block: int, warmup: int, repeats: int) -> dict[str, Any]:
    from backends.cupy import gpu  # needs cupy: only on a GPU machine

    cand = dataclasses.replace(
        cand,
        kernels=tuple(
            dataclasses.replace(bk, cuda=dataclasses.replace(bk.cuda, block=block) if bk.cuda is not None else None)
            for bk in cand.kernels
        ),
    )
    x = np.random.default_rng(0).standard_normal(cand.plan.tensors["x"].shape).astype(np.float32)
    prep = ex.prepare(cand, {"x": x})
    (got,) = prep.run()
    (want,) = execute_plan(cand.plan, {"x": x}, mode="oracle")
    ok, max_abs, _ = allclose_report(got, want, "fp32")
    if not ok:
        raise RuntimeError(f"C-05 {tag} k={k}: GPU result differs from the reference (max_abs {max_abs:.3g})")
    med = statistics.median(prep.time(warmup, repeats))
    row: dict[str, Any] = {"tag": tag, "k": k, "median_ms": med / 1e3, "max_abs": max_abs}
    row["kernel_facts"] = prep.kernel_facts
    row["blocks_per_sm"] = min(f["occupancy"] for f in prep.kernel_facts)
    row["regs_max"] = max(f["regs"] for f in prep.kernel_facts)
    if tag == "naive":
        rt = gpu.cp.cuda.runtime
        src = prep.bufs["x"]
        dst = gpu.cp.empty_like(src)

        def copy() -> None:
            rt.memcpyAsync(dst.data.ptr, src.data.ptr, x.nbytes, rt.memcpyDeviceToDevice, prep.stream.ptr)

        trailing = copies("naive", k) - 1  # the seed's rule: a last copy when k is even

        def with_copies() -> None:
            copy()
            prep.launch()
            for _ in range(trailing):
                copy()

        row["with_copy_ms"] = statistics.median(gpu.event_times(with_copies, prep.stream, warmup, repeats)) / 1e3
    return row


def run_bundle(variants: list[tuple[str, int, Any]], data: dict[str, Any], ex: Any | None, warmup: int,
               repeats: int) -> dict[str, Any]:
    """The offline rows, plus GPU rows and the copy bandwidth when ``ex`` is a CupyExecutor."""
    result = {k: data[k] for k in ("mode", "n", "block", "device_spec", "sm_count_spec", "offline")}
    result["bench"] = "c05"
    if ex is None:
        return result
    from backends.cupy import gpu  # needs cupy: only on a GPU machine

    cands = [(t, k, c if isinstance(c, Candidate) else _candidate(c)) for t, k, c in variants]
    result["machine"] = ex.machine()
    result["seed"] = seed_rows([(t, k) for t, k, _ in cands], data["n"], warmup, repeats)
    result["gpu"] = [_planner_row(t, k, c, ex, data["block"], warmup, repeats) for t, k, c in cands]
    copy_us = gpu.d2d_copy_us(data["n"] * 4, warmup, repeats)
    result["d2d_copy_us"] = copy_us
    result["d2d_copy_gbps"] = 2 * data["n"] * 4 / (copy_us * 1e-6) / 1e9
    return result


def _planner_row(tag: str, k: int, cand: Candidate, ex: Any, block: int, warmup: int, repeats: int) -> dict[str, Any]:
    try:
        return gpu_row(tag, k, cand, ex, block, warmup, repeats) | {"source": "planner"}
    except Exception as exc:  # one failing row is reported in its place; the table stays
        log.warning("C-05 planner %s k=%d failed: %s", tag, k, exc)
        return {"source": "planner", "tag": tag, "k": k, "error": f"{type(exc).__name__}: {exc}"}


def seed_rows(runs: list[tuple[str, int]], n: int, warmup: int, repeats: int) -> list[dict[str, Any]]:
    """The seed program's rows for each (mode, k); one that fails is a row with its error, not a lost table."""
    rows = []
    for tag, k in runs:
        try:
            rows.append(run_seed(tag, k, n=n, warmup=warmup, repeats=repeats))
        except Exception as exc:  # a failing row is reported in its place
            log.warning("C-05 seed %s k=%d failed: %s", tag, k, exc)
            rows.append({"source": "seed", "tag": tag, "k": k, "error": f"{type(exc).__name__}: {exc}"})
    return rows


def _candidate(plan: Any) -> Candidate:

    return plan_candidate(plan)


# ---------------------------------------------------------------- printing


def print_result(result: dict[str, Any]) -> None:
    print_offline(result)
    if "gpu" in result:
        print_gpu(result)


def print_offline(result: dict[str, Any]) -> None:
    print(
        f"C-05 offline: n={result['n']:,} fp32, block {result['block']}, grid 8 x {result['sm_count_spec']} SMs; "
        f"registers and spills from nvcc -arch=sm_90 --resource-usage, blocks/SM from the {result['device_spec']} "
        "spec (no timing)"
    )
    print(f"{'k':>2}  {'tag':<6} {'plan':<18} {'kernels':>7} {'regs':>5} {'spill B':>7} {'blocks/SM':>9} {'est us':>9}")
    for r in result["offline"]:
        print(
            f"{r['k']:>2}  {r['tag']:<6} {r['plan']:<18} {r['kernels']:>7} {r['regs_max']:>5} "
            f"{r['spill_bytes_max']:>7} {r['blocks_per_sm_min']:>9} {r['est_us']:>9.2f}"
        )


def print_gpu(result: dict[str, Any]) -> None:
    m = result["machine"]
    print(f"\nmeasured on {m['device']} ({m['sm_count']} SMs), CUDA events, median of repeats")
    print("\nthe seed's program (its kernels, scalar loads; naive with its copies: one in, one out when k is even):")
    print_rows(result, result.get("seed", []))
    print("\nthe planner's kernels for the same chains (vectorised loads), extra rows:")
    print_rows(result, result["gpu"])
    print(f"device-to-device copy: {result['d2d_copy_gbps']:,.0f} GB/s (bytes read + written)")


def _ms(row: dict[str, Any] | None, key: str = "median_ms") -> float | None:
    return None if row is None or "error" in row or key not in row else float(row[key])


def _cell(v: float | None, unit: str = "") -> str:
    return "-" if v is None or math.isnan(v) else f"{v:.3f}{unit}"


def c05_table(result: dict[str, Any], rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]], list[str]]:
    """(header, cells, failures) of one table of C-05 rows (the seed program's or the planner's): the sweep's
    per-k table or the modes table; a failed row is listed among the failures, its cells shown as '-'."""
    failures = [f"{r['tag']} k={r['k']}: {r['error'][:200]}" for r in rows if "error" in r]
    by_k: dict[int, dict[str, Any]] = {}
    for r in rows:
        by_k.setdefault(r["k"], {})[r["tag"]] = r
    if result["mode"] == "sweep":
        header = ["k", "naive ms", "naive+copy ms", "fused ms", "fused/naive", "(naive+copy)/fused", "seed RTX 5090",
                  "fused BW / copy BW"]
        cells = []
        for k, d in sorted(by_k.items()):
            nv = d.get("naive")
            naive, fused = _ms(nv), _ms(d.get("fused"))
            # the seed's naive run includes its copies; the planner's naive plan has them as an extra timing
            with_copy = naive if nv is not None and nv.get("source") == "seed" else _ms(nv, "with_copy_ms")
            seed = SEED_SWEEP.get(k)
            bw = None if fused is None else 2 * result["n"] * 4 / (fused * 1e-3) / 1e9 / result["d2d_copy_gbps"]
            cells.append([str(k), _cell(naive), _cell(with_copy), _cell(fused),
                          _cell(None if naive is None or fused is None else naive / fused, "x"),
                          _cell(None if with_copy is None or fused is None else with_copy / fused, "x"),
                          f"{seed[0] / seed[1]:.2f}x" if seed else "-", "-" if bw is None else f"{bw:.0%}"])
        return header, cells, failures
    d = next(iter(by_k.values()), {})
    times = {tag: _ms(d.get(tag)) for tag in ("naive", "fused", "fat")}
    header = ["tag", "median ms", "blocks/SM", "regs", "relative", "seed RTX 5090"]
    cells = []
    for tag, ms in times.items():
        if ms is None:
            continue
        row = d[tag]
        other = times["naive"] if tag == "fused" else times["fused"]
        rel = {"naive": f"with copies {_ms(row, 'with_copy_ms') or ms:.3f} ms",
               "fused": f"fused/naive {(other or math.nan) / ms:.2f}x",
               "fat": f"fat/fused {ms / (other or math.nan):.2f}x slower"}[tag]
        s_ms, s_occ = SEED_MODES[tag]
        cells.append([tag, f"{ms:.3f}", str(row["blocks_per_sm"]), str(row["regs_max"]), rel,
                      f"{s_ms:.3f} ms, {s_occ} blocks/SM"])
    return header, cells, failures


def print_rows(result: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    header, cells, failures = c05_table(result, rows)
    for f in failures:
        print(f"  FAILED {f}")
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(header)]
    for line in [header, *cells]:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)))
