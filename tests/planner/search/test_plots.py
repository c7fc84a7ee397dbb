"""The plots of a search, drawn from its results document; ``fusion-planner plot`` reads results.json."""

from __future__ import annotations

import json

import pytest
from _fake_backend import TimedReferenceBackend

from planner.cli import main
from planner.core import examples
from planner.core.cost import load_device
from planner.core.report import pareto_front
from planner.egraph.candidates import build_candidates
from planner.search.engine import search
from planner.search.plots import PLOTS, ResultsFileError, load_results, write_plots

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def results_doc():
    spec = load_device("h200")
    cands = build_candidates(examples.ew_chain(4, 4096, "fp32"), spec)
    return search(cands, TimedReferenceBackend(spec)).to_json()


def test_every_timed_candidate_has_its_time_in_the_search(results_doc):
    times = [c["at_s"] for c in results_doc["candidates"] if c["meas_us"] is not None]
    assert times and all(t >= 0 for t in times)


def test_write_plots_draws_three_pngs_or_svgs(results_doc, tmp_path):
    paths = write_plots(results_doc, tmp_path)
    assert [p.name for p in paths] == [f"{stem}.png" for stem in PLOTS]
    assert all(p.read_bytes()[:8] == PNG for p in paths)
    svgs = write_plots(results_doc, tmp_path, tag="r1", fmt="svg")
    assert [p.name for p in svgs] == [f"{stem}.r1.svg" for stem in PLOTS]
    assert all(b"<svg" in p.read_bytes()[:400] for p in svgs)


def test_pareto_front_keeps_only_undominated_plans():
    cands = [{"bytes": 10, "launches": 3, "reg_peak": 8, "plan": "a"},
             {"bytes": 20, "launches": 1, "reg_peak": 8, "plan": "b"},
             {"bytes": 20, "launches": 3, "reg_peak": 8, "plan": "dominated"},
             {"bytes": 30, "launches": 3, "reg_peak": 4, "plan": "c"}]
    front = pareto_front(cands, lambda c: (c["bytes"], c["launches"], c["reg_peak"]))
    assert [cands[i]["plan"] for i in front] == ["a", "b", "c"]


def test_plot_command_redraws_from_results_json(results_doc, tmp_path, capsys):
    f = tmp_path / "results.json"
    f.write_text(json.dumps(results_doc))
    assert main(["plot", str(f), "--json"]) == 0
    written = json.loads(capsys.readouterr().out)["written"]
    assert sorted(p.rsplit("/", 1)[1] for p in written) == sorted(f"{stem}.png" for stem in PLOTS)


def test_a_layer_stacks_results_give_plots_per_region(results_doc, tmp_path):
    f = tmp_path / "results.json"
    f.write_text(json.dumps({"stack.r0": results_doc, "stack.r2": results_doc}))
    assert set(load_results(f)) == {"stack.r0", "stack.r2"}
    out = tmp_path / "plots"
    out.mkdir()
    assert main(["plot", str(f), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{s}.{t}.png" for s in PLOTS for t in ("r0", "r2"))


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d.pop("candidates"), "the document must contain ['candidates'] properties"),
    (lambda d: d["candidates"][1].update(bytes="many"), "candidates[1].bytes must be integer"),
    (lambda d: d["candidates"][0].update(meas_us=True), "candidates[0].meas_us must be number or null"),
    (lambda d: [c.pop("best", None) for c in d["candidates"]], "candidates must contain one of contains definition"),
])
def test_a_broken_results_file_names_the_path(results_doc, tmp_path, capsys, edit, needle):
    doc = json.loads(json.dumps(results_doc))
    edit(doc)
    f = tmp_path / "results.json"
    f.write_text(json.dumps(doc))
    with pytest.raises(ResultsFileError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        load_results(f)
    assert main(["plot", str(f)]) == 2
    err = capsys.readouterr().err
    assert needle in err and str(f) in err and err.count("\n") == 1


def test_plot_of_no_results_file_exits_2(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "missing.json")]) == 2
    (tmp_path / "list.json").write_text("[1, 2]")
    assert main(["plot", str(tmp_path / "list.json")]) == 2
    assert "not a results file" in capsys.readouterr().err
