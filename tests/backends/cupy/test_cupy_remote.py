"""Remote timing on the CPU: export-candidates -> python -m backends.cupy time --executor numpy -> load_measured."""

import copy
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from testpaths import ROOT

from backends.cupy.bundle import (
    BundleError,
    bundle_from_json,
    export_bundle,
    kernel_to_json,
    load_bundle,
)
from backends.cupy.runner import MeasuredError, NumpyExecutor, load_measured, time_bundle
from planner.cli import main
from planner.core.cost import load_device
from planner.core.examples import ew_chain, mlp_epilogue, mlp_stack
from planner.core.plans import expr_from_json
from planner.core.reference import execute_graph, execute_plan, random_inputs
from planner.core.tolerance import check_outputs
from planner.egraph.candidates import build_candidates

BLOCK_EGGLOG = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name == "egglog" or name.startswith("egglog."):
            raise ImportError("egglog is blocked in this test")
        return None
sys.meta_path.insert(0, _Block())
"""


@pytest.fixture(scope="module")
def bundle_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bundle") / "cands.json"
    rc = main(["export-candidates", "--example", "mlp-epilogue", "--m", "24", "--n", "40", "--k", "36", "-o", str(path)])
    assert rc == 0
    return path


def test_bundle_is_self_contained_and_reproduces_every_plan(bundle_file):
    """The JSON alone re-executes every candidate bit-for-bit like the in-memory plan."""
    cands = build_candidates(mlp_epilogue(24, 40, 36, "fp16"), load_device("h200"))
    bundle = load_bundle(bundle_file)
    assert [c.plan.key for c in bundle.candidates] == [p.key for p in cands.plans]
    inputs = bundle.make_inputs()
    for cand, plan in zip(bundle.candidates, cands.plans, strict=True):
        got = execute_plan(cand.plan, inputs, mode="device")
        want = execute_plan(plan, inputs, mode="device")
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
        for bk in cand.kernels:
            assert (bk.cuda is not None) != (bk.cublas is not None)
            if bk.cublas is not None:
                assert (bk.cublas.m, bk.cublas.n, bk.cublas.k) == (24, 40, 36)
                assert (bk.cublas.bias is not None) == ("BIAS" in bk.cublas.epilogue)


def test_export_time_merge_end_to_end_without_egglog(bundle_file, tmp_path):
    out = tmp_path / "measured.json"
    code = BLOCK_EGGLOG + (
        "from backends.cupy.__main__ import main\n"
        f"rc = main(['time', {str(bundle_file)!r}, '-o', {str(out)!r}, '--executor', 'numpy', '--repeats', '2'])\n"
        "assert not any(m == 'egglog' or m.startswith(('egglog.', 'planner.egraph.program', 'planner.egraph.candidates', "
        "'planner.egraph.extract')) for m in sys.modules), sorted(sys.modules)\n"
        # only what the GPU machine's image holds (the standard library, numpy, ml_dtypes, cupy) and the pure-Python
        # fastjsonschema that benchmarks/gpu_suite.sh carries there
        "tops = {m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names)\n"
        "extra = {t for t in tops if not t.startswith('_') and t != 'cython_runtime'} - {'numpy', 'ml_dtypes', 'cupy', "
        "'planner', 'backends', 'fastjsonschema'}\n"
        "assert not extra, extra\n"
        "raise SystemExit(rc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "15/15 candidates verified and timed on numpy" in proc.stdout
    measured = load_measured(out)
    bundle = load_bundle(bundle_file)
    assert set(measured) == {c.plan.key for c in bundle.candidates}
    for m in measured.values():
        assert m.verdict == "timed" and m.meas_us > 0 and len(m.samples_us) == 2
        assert m.executor == "numpy"
    raw = json.loads(out.read_text())
    assert sum(1 for c in raw["candidates"] if c.get("best_so_far")) >= 1


def _first_affine(body):
    node = body
    while node.get("op") != "Affine":
        node = node["args"][0]
    return node


def test_a_wrong_kernel_is_rejected_not_timed(tmp_path):
    """A kernel that computes something else (a planner bug, its device code made from the wrong body)
    is verified, rejected and not timed; the others still are."""
    cands = build_candidates(ew_chain(2, 64, "fp32"), load_device("h200"))
    bad = cands.plans[0]
    data = export_bundle(cands)
    raw = data["candidates"][0]["kernels"][0]
    _first_affine(raw["body"])["attrs"]["a"] = 3.0  # a different Affine constant than the graph's
    kernel = dataclasses.replace(bad.kernels[0], body=expr_from_json(raw["body"]))
    data["candidates"][0]["kernels"][0] = kernel_to_json(kernel, bad.tensors)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    result = time_bundle(load_bundle(path), NumpyExecutor(), warmup=0, repeats=1)
    first, rest = result["candidates"][0], result["candidates"][1:]
    assert first["verdict"].startswith("rejected: mismatch") and first["meas_us"] is None
    assert all(c["verdict"] == "timed" for c in rest)


def test_device_code_that_is_not_its_bodys_is_refused(tmp_path):
    """The GPU runs only code the body generates: a bundle whose CUDA source, launch shape or cuBLASLt
    call was edited is refused when it is read, by the runner's command with exit 2."""
    from backends.cupy.__main__ import main as runner_main

    data = export_bundle(build_candidates(mlp_epilogue(24, 40, 36, "fp32"), load_device("h200")))
    edits = {
        "source": lambda k: k["cuda"].update(source=k["cuda"]["source"] + "\n__device__ int evil;"),
        "block": lambda k: k["cuda"].update(block=k["cuda"]["block"] * 2),
        "cuBLASLt call": lambda k: k["cublaslt"].update(k=k["cublaslt"]["k"] + 1),
    }
    for what, edit in edits.items():
        doc = copy.deepcopy(data)
        field = "cublaslt" if what == "cuBLASLt call" else "cuda"
        kernel = next(k for c in doc["candidates"] for k in c["kernels"] if k.get(field))
        edit(kernel)
        path = tmp_path / f"{field}.json"
        path.write_text(json.dumps(doc))
        with pytest.raises(BundleError, match="not what its body generates"):
            load_bundle(path)
        assert runner_main(["time", str(path), "-o", str(tmp_path / "m.json"), "--executor", "numpy"]) == 2, what


def test_bad_files_name_the_problem(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"schema": "nope"}))
    with pytest.raises(BundleError, match="not a candidates bundle"):
        load_bundle(p)
    with pytest.raises(MeasuredError, match="not a measured-results file"):
        load_measured(p)
    p.write_text(json.dumps({"schema": "fusion-planner/measured/1", "candidates": [{"key": "k", "verdict": "timed",
                                                                                  "meas_us": -1}]}))
    with pytest.raises(MeasuredError, match="meas_us"):
        load_measured(p)


def test_runner_cli_rejects_a_missing_bundle(tmp_path):
    from backends.cupy.__main__ import main as runner_main

    assert runner_main(["time", str(tmp_path / "none.json"), "-o", str(tmp_path / "m.json"), "--executor", "numpy"]) == 2


@pytest.mark.nvcc
def test_bench_c05_offline_modes(capsys):
    assert main(["bench", "c05", "--mode", "modes", "--offline"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[1]: line.split() for line in out.splitlines() if line[:3].strip() == "4"}
    assert set(rows) == {"naive", "fused", "fat"}
    # columns: k tag plan kernels regs spill blocks/SM est
    assert int(rows["fat"][4]) > 128 and rows["fat"][6] == "1"
    assert int(rows["fused"][4]) < 64 and rows["fused"][6] == "8"
    assert rows["naive"][3] == "4" and rows["fused"][3] == "1"


@pytest.mark.nvcc
def test_explain_kernel_facts_json(capsys):
    assert main(["explain", "--example", "ew-chain", "--n", "4096", "--device", "h200", "--kernel-facts", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for c in data["candidates"]:
        for k in c["kernels"]:
            assert {"regs", "spill_bytes", "occupancy"} <= set(k)


def test_bench_rejects_bad_block(capsys):
    assert main(["bench", "c05", "--block", "100", "--offline"]) == 2
    assert "--block" in capsys.readouterr().err


def test_bench_without_nvcc_is_a_clear_error(capsys, monkeypatch, tmp_path):
    from backends.cupy import facts

    monkeypatch.setenv("PATH", str(tmp_path))  # no nvcc here
    facts.nvcc_version.cache_clear()
    try:
        assert main(["bench", "c05", "--mode", "modes", "--offline"]) == 2
    finally:
        facts.nvcc_version.cache_clear()
    assert "needs nvcc on PATH" in capsys.readouterr().err


def test_gpu_bundles_match_the_current_code_generator():
    """tests/data/gpu holds what the GPU tests run: each stored kernel source must be what the code
    generator makes of its stored body today (regenerate with `python -m tests.gpu_bundles`)."""
    from backends.cupy.codegen import generate
    from tests import gpu_bundles

    assert sorted(p.stem for p in gpu_bundles.DATA.glob("*.json")) == gpu_bundles.names()
    for name in gpu_bundles.names():
        bundle = load_bundle(gpu_bundles.path(name))
        assert bundle.candidates, name
        for cand in bundle.candidates:
            for bk in cand.kernels:
                if bk.cuda is not None:
                    assert bk.cuda == generate(bk.kernel, cand.plan.tensors), f"{name}: stale; regenerate"


def test_plan_measured_merges_remote_results_into_the_search(bundle_file, tmp_path, capsys, monkeypatch):
    """export -> time (numpy executor) -> plan --measured: the search and its log use the remote timings."""
    from backends.cupy.__main__ import main as runner_main

    out = tmp_path / "measured.json"
    assert runner_main(["time", str(bundle_file), "-o", str(out), "--executor", "numpy", "--repeats", "2"]) == 0
    measured = load_measured(out)
    # drop one candidate and mark another rejected: the search must show both verdicts
    raw = json.loads(out.read_text())
    dropped = raw["candidates"].pop()["key"]
    raw["candidates"][1]["verdict"] = "rejected: tolerance: planted for this test"
    raw["candidates"][1]["meas_us"] = None
    rejected_key = raw["candidates"][1]["key"]
    out.write_text(json.dumps(raw))
    capsys.readouterr()
    monkeypatch.setenv("SEARCH_LOG", "1")
    rc = main(["plan", "--example", "mlp-epilogue", "--m", "24", "--n", "40", "--k", "36", "--measured", str(out),
               "--max-candidates", "32", "--json"])
    assert rc == 0
    cap = capsys.readouterr()
    res = json.loads(cap.out)
    verdicts = [c["verdict"] for c in res["candidates"]]
    assert any(v.startswith("rejected") and "remote rejected: tolerance" in v for v in verdicts)
    assert any("not measured remotely" in v for v in verdicts)
    timed = [c for c in res["candidates"] if c["meas_us"] is not None]
    best = min(timed, key=lambda c: c["meas_us"])
    assert res["best"]["plan"] == best["plan"]
    remote = sorted(m.meas_us for k, m in measured.items() if k not in (dropped, rejected_key))
    assert sorted(c["meas_us"] for c in timed) == pytest.approx(remote, rel=1e-4)
    assert "measured(numpy; events)" in cap.err and "Searched in" in cap.err
    assert dropped and rejected_key


@pytest.mark.parametrize("all_captured", [True, False])
def test_plans_are_ranked_by_their_cuda_graph_time_only_when_every_one_has_it(bundle_file, tmp_path, capsys,
                                                                                all_captured):
    """A launch-bound plan's event time is mostly host work: with a graph replay time for every candidate the
    merge ranks by it (here the one with the slowest events has the fastest graph), else by events for all."""
    from backends.cupy.__main__ import main as runner_main

    out = tmp_path / "measured.json"
    assert runner_main(["time", str(bundle_file), "-o", str(out), "--executor", "numpy", "--repeats", "2"]) == 0
    raw = json.loads(out.read_text())
    timed = [c for c in raw["candidates"] if c["meas_us"] is not None]
    slowest = max(timed, key=lambda c: c["meas_us"])
    for c in timed:
        c["graph_us"] = 1.0 if c is slowest else 5.0
    if not all_captured:
        next(c for c in timed if c is not slowest)["graph_us"] = None
    out.write_text(json.dumps(raw))
    capsys.readouterr()
    assert main(["plan", "--example", "mlp-epilogue", "--m", "24", "--n", "40", "--k", "36", "--measured", str(out),
                 "--max-candidates", "32", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    best = next(c for c in res["candidates"] if c["verdict"] == "best")
    assert (best["meas_us"] == 1.0) == all_captured  # the slowest by events, the fastest by its graph
    assert res["backend"] == ("measured(numpy; CUDA-graph replays)" if all_captured else "measured(numpy; events)")


def test_plan_measured_refuses_another_graphs_timings(bundle_file, tmp_path, capsys):
    """Plan keys do not encode shapes: timings of the 24x40x36 bundle must not merge into a 48x40x36 plan."""
    from backends.cupy.__main__ import main as runner_main

    out = tmp_path / "measured.json"
    assert runner_main(["time", str(bundle_file), "-o", str(out), "--executor", "numpy", "--repeats", "1"]) == 0
    capsys.readouterr()
    rc = main(["plan", "--example", "mlp-epilogue", "--m", "48", "--n", "40", "--k", "36", "--measured", str(out)])
    assert rc == 2
    assert "timed for graph 'mlp-epilogue-24x40x36-fp16-tanh', not 'mlp-epilogue-48x40x36" in capsys.readouterr().err


def test_plan_measured_refuses_a_same_named_graph_with_other_shapes(tmp_path, capsys):
    """Same graph name, other shapes: the structural fingerprint in the bundle tells them apart."""
    from backends.cupy.__main__ import main as runner_main
    from planner.core.graph import GraphBuilder

    def graph(m: int) -> dict:
        b = GraphBuilder("same-name")
        b.input("x", (m, 8), "fp32")
        b.op("r", "Relu", ["x"])
        b.op("s", "Silu", ["r"])
        return json.loads(b.build(["s"]).dumps())

    (tmp_path / "a.json").write_text(json.dumps(graph(4)))
    (tmp_path / "b.json").write_text(json.dumps(graph(6)))
    bundle, out = tmp_path / "cands.json", tmp_path / "measured.json"
    assert main(["export-candidates", "--graph", str(tmp_path / "a.json"), "-o", str(bundle)]) == 0
    assert runner_main(["time", str(bundle), "-o", str(out), "--executor", "numpy", "--repeats", "1"]) == 0
    assert json.loads(out.read_text())["graph_sha256"]
    capsys.readouterr()
    assert main(["plan", "--graph", str(tmp_path / "a.json"), "--measured", str(out)]) == 0
    capsys.readouterr()
    assert main(["plan", "--graph", str(tmp_path / "b.json"), "--measured", str(out)]) == 2
    assert "another graph of the same name 'same-name'" in capsys.readouterr().err


def test_the_remote_runner_draws_the_same_inputs_and_checks_like_the_search():
    """One input recipe and one output check: a deep fp16 stack's candidates get the same verdicts
    from the runner (numpy executor) as from the local check with the fp64-oracle allowance."""
    graph = mlp_stack(6, 32, 8, "fp16")
    cands = build_candidates(graph, load_device("h200"), cap=16, k=8)
    bundle = bundle_from_json(json.loads(json.dumps(export_bundle(cands))))
    inputs = random_inputs(graph, 0)
    for name, x in bundle.make_inputs().items():
        np.testing.assert_array_equal(x, inputs[name])
    device, oracle = execute_graph(graph, inputs), execute_graph(graph, inputs, "oracle")
    local = {p.key: check_outputs(p, execute_plan(p, inputs), device, oracle=oracle)[0] is None for p in cands.plans}
    remote = {c["key"]: not c["verdict"].startswith("rejected") for c in time_bundle(bundle, NumpyExecutor(),
                                                                                      warmup=0, repeats=1)["candidates"]}
    assert remote == local and any(local.values())


def test_a_candidate_whose_timing_fails_is_rejected_and_the_run_goes_on(bundle_file):
    """Timing (and graph capture) failures reject that candidate only; library handles are freed."""
    bundle = load_bundle(bundle_file)
    closed = []

    class FlakyTiming(NumpyExecutor):
        def prepare(self, cand, inputs):
            prepared = super().prepare(cand, inputs)
            if cand is bundle.candidates[0]:
                def broken(warmup, repeats):
                    raise RuntimeError("capture invalidated")

                prepared.time = broken
            prepared.close = lambda: closed.append(cand.plan.key)
            return prepared

    result = time_bundle(bundle, FlakyTiming(), warmup=0, repeats=1, max_candidates=3)
    first, *rest = result["candidates"]
    assert first["verdict"] == "rejected: timing failed: RuntimeError: capture invalidated" and first["meas_us"] is None
    assert all(c["verdict"] == "timed" for c in rest)
    assert closed == [c.plan.key for c in bundle.candidates[:3]]


def _device_phase(tmp_path, **env_over):
    out, res = tmp_path / "out", tmp_path / "res"
    env = {**os.environ, "OUT": str(out), "RES": str(res), "PYTHON": sys.executable,
           "WHEELS": str(tmp_path / "no-wheels"), **env_over}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), "device"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out, (out / "suite.log").read_text()


def test_the_device_phase_dry_runs_on_the_cpu_and_always_leaves_its_files(tmp_path):
    """Without a GPU every GPU step fails: each failure is one logged line (no traceback), the rest still runs,
    and the reports and the tarball are written (at most 8 files come back from the device)."""
    out, log = _device_phase(tmp_path)
    files = sorted(p.name for p in out.iterdir())
    assert {"suite.log", "smoke.md", "results.tar.gz", "c05_h200.md", "mlp_epilogue_h200.md"} <= set(files)
    assert len(files) <= 8
    assert "Traceback" not in log
    assert "carried (run 'gpu_suite.sh prepare' here and carry" in log  # the missing wheels: one line
    assert "PASS headers" in log or "FAIL headers" in log  # the smoke script ran
    # the main tables first (C-05, then the MLP plans beside torch), checks and calibration after them
    order = [log.index(f"== {step} (") for step in ("c05 sweep", "time mlp_4096", "torch mlp_decode16", "report",
                                                     "smoke", "calibrate", "gpu tests")]
    assert order == sorted(order)
    for step in ("smoke", "calibrate", "time mlp_4096", "torch mlp_4096"):
        failed = [line for line in log.splitlines() if line.startswith(f"== {step} FAILED")]
        assert len(failed) == 1, step
    assert "== report (" in log and "== done at" in log


def test_the_device_phase_skips_what_its_deadline_leaves_no_time_for(tmp_path):
    out, log = _device_phase(tmp_path, DEADLINE_S="0")
    assert "== smoke SKIPPED (deadline of 0s reached)" in log and "== report SKIPPED" in log
    assert {"suite.log", "results.tar.gz"} <= {p.name for p in out.iterdir()}
