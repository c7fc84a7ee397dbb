"""``fusion-planner plan`` and ``run``: outputs, plan.json round trip, refusals, bad input."""

from __future__ import annotations

import importlib.util
import json

import pytest
from _fake_backend import TimedReferenceBackend

from planner.cli import main
from planner.commands import plan as plan_cmd
from planner.commands import run as run_cmd
from planner.core.planfile import content_hash

CHAIN = ["--example", "ew-chain", "--k", "4", "--n", "256", "--device", "seed-k4", "--warmup", "0", "--repeats", "2"]


@pytest.fixture
def fake_backend(monkeypatch):
    made = []

    def get(name, spec, threads=None):
        made.append(name)
        return TimedReferenceBackend(spec)

    monkeypatch.setattr(plan_cmd, "get_backend", get)
    monkeypatch.setattr(run_cmd, "get_backend", get)
    return made


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    import planner.commands.plan as pc
    import planner.commands.run as rc

    old = pc.get_backend, rc.get_backend
    pc.get_backend = rc.get_backend = lambda name, spec, threads=None: TimedReferenceBackend(spec)
    try:
        d = tmp_path_factory.mktemp("plan")
        assert main(["plan", *CHAIN, "--max-candidates", "6", "--out", str(d), "--no-cache"]) == 0
    finally:
        pc.get_backend, rc.get_backend = old
    return d


def test_plan_json_output(fake_backend, capsys):
    assert main(["plan", *CHAIN, "--max-candidates", "4", "--json", "--backend", "cpu"]) == 0
    assert fake_backend == ["cpu"]
    out = json.loads(capsys.readouterr().out)
    assert out["timed"] == 5 and out["rejected"] == 0
    assert out["best"]["verdict"] == "best" and out["best"]["meas_us"] > 0
    verdicts = {c["verdict"] for c in out["candidates"]}
    assert verdicts == {"best", "timed", "not timed"}
    assert all((c["meas_us"] is None) == (c["verdict"] == "not timed") for c in out["candidates"])


def test_plan_text_output_and_log(fake_backend, capsys):
    assert main(["plan", *CHAIN, "--max-candidates", "3", "--search-log"]) == 0
    cap = capsys.readouterr()
    assert "meas_us" in cap.out and "speedup vs unfused (one kernel per op):" in cap.out
    assert cap.out.splitlines()[-1].startswith("spearman rho")
    err = cap.err.splitlines()
    assert err[0].startswith("Search ew-chain-k4-256-fp32") and err[-1].startswith("Searched in ")


def test_the_model_backend_says_est_and_never_meas(capsys, tmp_path):
    assert main(["plan", *CHAIN, "--backend", "model", "--search-log", "--cache-dir", str(tmp_path)]) == 0
    cap = capsys.readouterr()
    text = cap.out + cap.err
    for word in ("meas_us", " meas ", "re-measurement", "spearman", "timed"):
        assert word not in text, word
    assert "est " in cap.err and "(estimated)" in cap.err.splitlines()[-1] and " costed, " in cap.err
    assert "does not measure: every figure is the cost model's estimate" in cap.out


def test_out_dir_files(out_dir):
    names = sorted(p.name for p in out_dir.iterdir())
    assert names == ["best_so_far.png", "pareto.png", "plan.json", "predicted_vs_measured.png", "results.json"]
    for png in ("best_so_far.png", "pareto.png", "predicted_vs_measured.png"):
        assert (out_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = json.loads((out_dir / "results.json").read_text())
    doc = json.loads((out_dir / "plan.json").read_text())
    assert doc["plan"]["notation"] == res["best"]["plan"]
    assert doc["meta"]["meas_us"] == pytest.approx(res["best"]["meas_us"], rel=1e-3)
    assert doc["sha256"] == content_hash(doc)


def test_run_saved_plan(out_dir, fake_backend, capsys):
    assert main(["run", str(out_dir / "plan.json"), "--json", "--repeats", "2"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["verified"] and rep["meas_us"] > 0 and rep["graph"] == "ew-chain-k4-256-fp32"
    # the same graph given explicitly is accepted
    assert main(["run", str(out_dir / "plan.json"), "--example", "ew-chain", "--k", "4", "--n", "256"]) == 0


def _tamper(out_dir, tmp_path, edit, rehash):
    doc = json.loads((out_dir / "plan.json").read_text())
    edit(doc)
    if rehash:
        doc["sha256"] = content_hash(doc)
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(doc))
    return p


def _first_op(doc):
    body = doc["plan"]["kernels"][0]["body"]
    while body["args"] and "op" in body["args"][0]:
        body = body["args"][0]
    return body


def _loads(body):
    return {body["load"]} if "load" in body else set().union(*(_loads(a) for a in body["args"]))


def _read_own_output(kernel):
    """Make the first kernel load the tensor it writes (whatever the searched plan's kernel count)."""
    body = kernel["body"]
    while "load" not in body["args"][0]:
        body = body["args"][0]
    body["args"][0] = {"load": kernel["out"]}
    kernel["reads"] = sorted(_loads(kernel["body"]))


@pytest.mark.parametrize(
    "edit, rehash, message",
    [
        (lambda d: _first_op(d)["attrs"].update(a=3.0), False, "content hash mismatch"),
        (lambda d: _first_op(d)["attrs"].update(a=3.0), True, "does not compute its graph"),
        (lambda d: _read_own_output(d["plan"]["kernels"][0]), True, "before any kernel wrote it"),
        (lambda d: _first_op(d).update(op="__import__"), True, "unknown op"),
        (lambda d: d.update(version=99), True, "unsupported plan version"),
    ],
)
def test_run_refuses_bad_plans(out_dir, tmp_path, fake_backend, capsys, edit, rehash, message):
    p = _tamper(out_dir, tmp_path, edit, rehash)
    assert main(["run", str(p)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_run_refuses_other_graph(out_dir, fake_backend, capsys):
    assert main(["run", str(out_dir / "plan.json"), "--example", "ew-chain", "--k", "4", "--n", "512"]) == 2
    assert "differs from the given graph" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--backend", "tpu"], "unknown backend 'tpu'"),
        (["--device", "/no/such/device.json"], "no such file"),
        (["--time-budget", "0"], "time budget must be positive"),
        (["--max-candidates", "0"], "max candidates must be at least 1"),
        (["--early-stop", "0.9"], "early stop factor"),
    ],
)
def test_bad_input_exits_2(extra, message, capsys):
    assert main(["plan", *CHAIN, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_run_missing_plan_file(capsys):
    assert main(["run", "/no/such/plan.json"]) == 2
    assert "plan file not found" in capsys.readouterr().err


def test_a_cached_plan_does_not_hide_the_search_evidence(fake_backend, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SEARCH_LOG", raising=False)
    run = ["plan", *CHAIN, "--max-candidates", "2"]
    assert main(run) == 0 and main(run) == 0
    assert "plan from the cache" in capsys.readouterr().out  # a plain repeat uses the cache
    assert main([*run, "--search-log"]) == 0
    assert capsys.readouterr().err.splitlines()[-1].startswith("Searched in ")
    assert main([*run, "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "results.json").exists() and (tmp_path / "o" / "best_so_far.png").exists()


def test_json_reads_the_plan_cache_and_says_so(fake_backend, capsys, monkeypatch):
    monkeypatch.delenv("SEARCH_LOG", raising=False)
    run = ["plan", *CHAIN, "--max-candidates", "2", "--json"]
    assert main(run) == 0
    searched = json.loads(capsys.readouterr().out)
    assert "candidates" in searched and "from_cache" not in searched
    assert main(run) == 0
    cached = json.loads(capsys.readouterr().out)
    assert cached["from_cache"] is True and "candidates" not in cached and cached["cache_key"]
    assert cached["best"]["plan"] == searched["best"]["plan"]
    assert main([*run, "--no-cache"]) == 0
    assert "candidates" in json.loads(capsys.readouterr().out)  # --no-cache searches again


@pytest.mark.parametrize("cmd", [["plan", *CHAIN], ["explain", *CHAIN[:6]], ["run", "plan.json"], ["check-rules"]])
def test_negative_seed_exits_2(cmd, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*cmd, "--seed", "-1"])
    assert exc.value.code == 2
    assert "--seed: must be a non-negative integer" in capsys.readouterr().err


def test_the_plan_cache_is_keyed_by_the_search_options(fake_backend, capsys, monkeypatch):
    monkeypatch.delenv("SEARCH_LOG", raising=False)

    def cached(*extra: str) -> bool:
        assert main(["plan", *CHAIN, *extra]) == 0
        return "plan from the cache" in capsys.readouterr().out

    assert not cached("--max-candidates", "1")
    assert not cached("--max-candidates", "3")  # a bigger budget searches again
    assert not cached("--max-candidates", "3", "--seed", "1")
    assert cached("--max-candidates", "3", "--seed", "1")


def test_a_layer_stack_repeat_with_the_search_log_searches_again(fake_backend, capsys, monkeypatch):
    monkeypatch.delenv("SEARCH_LOG", raising=False)
    stack = ["plan", "--example", "mlp-stack", "--layers", "2", "--m", "8", "--d-model", "16", "--max-candidates", "2"]
    assert main(stack) == 0 and main(stack) == 0
    assert "(1 from the cache)" in capsys.readouterr().out
    assert main([*stack, "--search-log"]) == 0
    cap = capsys.readouterr()
    assert "(0 from the cache)" in cap.out and cap.err.splitlines()[0].startswith("Search mlp-stack")


def test_out_dir_of_a_layer_stack_has_per_region_plots(fake_backend, tmp_path):
    stack = ["plan", "--example", "mlp-stack", "--layers", "2", "--m", "8", "--d-model", "16", "--max-candidates", "2"]
    assert main([*stack, "--out", str(tmp_path)]) == 0
    names = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert names == ["best_so_far.r0.png", "pareto.r0.png", "plan.json", "predicted_vs_measured.r0.png", "results.json"]


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--time-limit", "nan"], "--time-limit must be a positive number"),
        (["--time-limit", "inf"], "--time-limit must be a positive number"),
        (["--time-budget", "nan"], "time budget"),
        (["--rtol", "nan"], "rtol must be a number from 0 to"),
        (["--graph", "/dev/zero"], "not a regular file"),
        (["--device", "/dev/zero"], "is not a regular file"),
        (["--out", "/proc/1/no-such-dir"], "cannot write there"),
    ],
)
def test_bad_flags_and_endless_files_exit_2(capsys, extra, needle):
    base = ["--example", "ew-chain", "--n", "64"] if "--graph" not in extra else []
    assert main(["plan", *base, "--backend", "reference", *extra]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def _set_kind(kind, epilogue=None):
    def edit(doc):
        k = doc["plan"]["kernels"][0]
        k["kind"], k["epilogue"] = kind, epilogue
    return edit


@pytest.mark.parametrize(
    "edit, message",
    [
        (_set_kind("gemm_epilogue"), "does not fit kind gemm_epilogue"),
        (_set_kind("cublaslt", "MADEUP"), "does not fit kind cublaslt"),
        (_set_kind("opaque"), "does not fit kind opaque"),
        (_set_kind("elementwise", "RELU"), "only a cublaslt kernel has an epilogue"),
    ],
)
def test_tampered_kernels_are_refused_before_any_backend_sees_them(out_dir, tmp_path, capsys, edit, message):
    p = _tamper(out_dir, tmp_path, edit, True)
    for backend in ("reference", "cpu"):
        assert main(["run", str(p), "--backend", backend]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_body_nested_20000_deep_is_refused(out_dir, tmp_path, capsys):
    doc = json.loads((out_dir / "plan.json").read_text())
    relu = '{"op": "Relu", "shape": [256], "dtype": "fp32", "node": "r", "args": ['
    deep = relu * 20000 + '{"load": "x"}' + "]}" * 20000
    text = json.dumps(doc).replace(json.dumps(doc["plan"]["kernels"][0]["body"]), deep, 1)
    p = tmp_path / "deep.json"
    p.write_text(text)
    assert main(["run", str(p)]) == 2
    err = capsys.readouterr().err
    assert "plan file" in err and "Traceback" not in err and err.count("\n") == 1



def test_version_prints_the_installed_version(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"fusion-planner {metadata.version('fusion-planner')}"


def test_v_logs_the_planner_and_egglog_only_when_asked(monkeypatch, caplog):
    import logging

    monkeypatch.delenv("FUSION_PLANNER_LOGS", raising=False)
    with caplog.at_level(logging.INFO):
        assert main(["-v", "explain", "--example", "ew-chain", "--k", "2", "--n", "64"]) == 0
    assert any(r.name == "planner.egraph.candidates" and "e-nodes after" in r.getMessage() for r in caplog.records)
    assert logging.getLogger("egglog").level == logging.WARNING  # its program dump stays out of -v
    monkeypatch.setenv("FUSION_PLANNER_LOGS", "+egglog")
    assert main(["-v", "explain", "--example", "ew-chain", "--k", "2", "--n", "64"]) == 0
    assert logging.getLogger("egglog").level == logging.NOTSET  # follows -v like every other logger



def test_torch_missing_is_one_line_naming_the_install(monkeypatch, capsys):
    """``make explain`` installs no torch: --torch then says how to get it, exit 2, no traceback."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    assert main(["plan", "--torch", "examples/mlp.py:build", "--backend", "reference"]) == 2
    err = capsys.readouterr().err
    assert "--torch needs PyTorch" in err and "make install" in err and err.count("\n") == 1
