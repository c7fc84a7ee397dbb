"""The device run's markdown reports (benchmarks/gpu_report.py), from result files shaped as the device writes them."""

from __future__ import annotations

import json
import random

import pytest
from scipy import stats
from testpaths import benchmark_script


@pytest.fixture(scope="module")
def report():
    return benchmark_script("gpu_report")


def test_spearman_matches_scipy_with_ties(report):
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(3, 12)
        xs = [float(rng.randint(0, 4)) for _ in range(n)]
        ys = [rng.random() for _ in range(n)]
        want = stats.spearmanr(xs, ys).statistic
        got = report.spearman(xs, ys)
        assert (got is None) if len(set(xs)) == 1 else got == pytest.approx(want)
    assert report.spearman([1.0, 2.0], [2.0, 1.0]) is None


def _candidate(plan, est, meas, graph):
    return {"plan": plan, "composition": "gemm_epilogue:1", "est_us": est, "meas_us": meas, "graph_us": graph,
            "verdict": "timed"}


@pytest.mark.parametrize("all_captured", [True, False])
def test_the_mlp_report_ranks_by_graph_time_only_when_every_candidate_has_one(report, tmp_path, all_captured):
    cands = [_candidate("[4]", 1.0, 30.0, 5.0), _candidate("[1,3]", 2.0, 20.0, 9.0), _candidate("[2,2]", 3.0, 25.0, 12.0)]
    if not all_captured:
        cands[2]["graph_us"] = None
    (tmp_path / "measured_mlp_decode16.json").write_text(json.dumps(
        {"machine": {"device": "H200", "sm_count": 132}, "candidates": cands}))
    text = report.mlp_markdown(tmp_path, "now")
    if all_captured:
        assert "Ranked by CUDA-graph replay time" in text and "Searched best: [4] gemm_epilogue:1 at 5.00 us" in text
        assert "Spearman rho" in text and "candidates: 1.00." in text  # estimates and graph times agree in order
    else:
        assert "Ranked by event-timed median" in text and "Searched best: [1,3] gemm_epilogue:1 at 20.00 us" in text


def test_the_c05_report_puts_the_seed_program_before_the_planners_kernels(report, tmp_path):
    row = {"blocks_per_sm": 8, "regs_max": 32}
    sweep = {"mode": "sweep", "n": 1 << 24, "d2d_copy_gbps": 4000.0,
             "machine": {"device": "H200", "sm_count": 132, "cupy": "14.2", "cuda_runtime": 13000},
             "seed": [{"source": "seed", "tag": "naive", "k": 2, "median_ms": 0.3, **row},
                      {"source": "seed", "tag": "fused", "k": 2, "median_ms": 0.05, **row}],
             "gpu": [{"source": "planner", "tag": "naive", "k": 2, "median_ms": 0.2, "with_copy_ms": 0.25, **row},
                     {"source": "planner", "tag": "fused", "k": 2, "error": "RuntimeError: boom"}]}
    (tmp_path / "c05_sweep.json").write_text(json.dumps(sweep))
    text = report.c05_markdown(tmp_path, "now")
    assert text.index("## Sweep: the seed's program") < text.index("## Sweep: the planner's kernels")
    assert "| 2 | 0.300 | 0.300 | 0.050 | 6.000x |" in text
    assert "- failed: fused k=2: RuntimeError: boom" in text


def test_the_search_report_ranks_every_candidate_and_breaks_the_best_into_kernels(report, tmp_path):
    def cand(comp, est, graph, kernels):
        return {"plan": comp, "composition": comp, "est_us": est, "meas_us": graph + 10, "graph_us": graph,
                "verdict": "timed", "kernels": kernels}

    fused = [{"kind": "elementwise", "name": "fp_ew_x", "regs": 21, "occupancy": 8, "meas_us": 13.6},
             {"kind": "cublaslt", "epilogue": "BIAS", "meas_us": 45.9}]
    unfused = [{"kind": "elementwise", "name": f"k{i}", "meas_us": 10.0} for i in range(5)]
    (tmp_path / "measured_transformer_l1.json").write_text(json.dumps(
        {"machine": {"device": "H200"}, "date": "2026-12-04T18:14:12+00:00",
         "candidates": [cand("unfused", 148.0, 800.0, unfused), cand("fused", 49.0, 125.0, fused),
                        {**cand("lost", 50.0, 1.0, []), "meas_us": None, "graph_us": None, "verdict": "rejected: x"}]}))
    (tmp_path / "torch_transformer_l1.json").write_text(json.dumps(
        {"torch": "2.11", "torch_eager": {"meas_us": 540.0}, "torch_compile": {"meas_us": 270.0}}))
    text = report.search_markdown(tmp_path, report.measured_when(tmp_path))
    assert "eager 540.0 us, torch.compile 270.0 us" in text
    assert "The best plan, event-timed (135.00 us), is 2.00x the faster of them." in text
    assert "| 1 | fused | 49.00 | 135.00 | 125.00 | timed |" in text
    assert "| 3 | lost | 50.00 | - | - | rejected: x |" in text  # untimed candidates stay, last
    assert "Best: fused at 125.00 us, 6.40x the most decomposed plan (5 kernels, 800.00 us)." in text
    assert "| cublaslt(BIAS) | - | - | 45.90 |" in text and "| elementwise fp_ew_x | 21 | 8 | 13.60 |" in text
    assert "## heavy example" in text and "Not run." in text  # a search the run left out says so
    assert report.measured_when(tmp_path) == "2026-12-04 18:14 UTC"  # when it was measured, not when written
