"""The plots of a search, drawn from its results document (``SearchResult.to_json()``, the ``results.json`` that
``plan --out`` writes): estimated vs measured time, the Pareto front of the three ledgers, and the best plan so
far over the search's time (matplotlib, Agg). ``fusion-planner plot`` and ``plan --out`` both draw them here."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from planner.core.errors import UsageError
from planner.core.files import read_json
from planner.core.report import pareto_front
from planner.core.schema import check_document

#: the plots of one search, by file stem
PLOTS = ("predicted_vs_measured", "pareto", "best_so_far")
FORMATS = ("png", "svg")
class ResultsFileError(UsageError):
    """A results document the plots cannot read; the message names the file and the offending path."""


def _pyplot() -> Any:
    try:
        import matplotlib  # optional dependency: the plots extra
    except ImportError:
        raise UsageError("plots need matplotlib (pip install 'fusion-planner[plots]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def check_search(doc: Any, where: str) -> dict[str, Any]:
    """``doc`` as one search's results document (its schema, ``planner/core/schemas/results.json``), else
    :class:`ResultsFileError` naming ``where`` and the offending path."""
    check_document(doc, "results", where, ResultsFileError)
    return dict(doc)


def load_results(path: str | Path) -> dict[str, dict[str, Any]]:
    """The searches of a results file: one search (``plan --out`` on a graph) under its graph's name, or a
    layer stack's searches by region."""
    doc = read_json(Path(path), ResultsFileError, "results file")
    if isinstance(doc, dict) and ("candidates" in doc or "graph" in doc):
        return {"": check_search(doc, f"{path}")}
    if not isinstance(doc, dict) or not doc:
        raise ResultsFileError(f"{path}: not a results file of 'fusion-planner plan --out' (an object with "
                               "'candidates', or one such object per region)")
    return {name: check_search(d, f"{path}: {name}") for name, d in doc.items()}


def _timed(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [c for c in doc["candidates"] if c["meas_us"] is not None]


def _marked(doc: Mapping[str, Any], key: str) -> dict[str, Any] | None:
    if key == "best":
        return next(c for c in doc["candidates"] if c.get("best") is True)
    unfused = doc.get("unfused")
    return unfused if isinstance(unfused, dict) and unfused.get("meas_us") is not None else None


def _save(fig: Any, plt: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _nothing_timed(doc: Mapping[str, Any], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.axis("off")
    ax.text(0.5, 0.5, f"{doc['graph']}\nno candidate was timed: backend {doc['backend']} only verifies",
            ha="center", va="center", fontsize=9)
    _save(fig, plt, path)


def plot_predicted_vs_measured(doc: Mapping[str, Any], path: Path) -> None:
    """Each timed candidate's estimate (cost model) against its measured median, log-log, best and unfused
    ringed; the title gives Spearman's rho."""
    timed = _timed(doc)
    if not timed:
        _nothing_timed(doc, path)
        return
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for early, label, marker in ((False, "timed", "o"), (True, "stopped early (median so far)", "^")):
        group = [c for c in timed if c["stopped_early"] is early]
        if group:
            ax.scatter([c["est_us"] for c in group], [c["meas_us"] for c in group], s=18, marker=marker, label=label)
    for key, colour in (("unfused", "tab:red"), ("best", "tab:green")):
        c = _marked(doc, key)
        if c is not None and c["meas_us"] is not None:
            ax.scatter([c["est_us"]], [c["meas_us"]], s=70, facecolors="none", edgecolors=colour, label=key)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"estimated time (µs, cost model {doc['device']})")
    ax.set_ylabel(f"measured time (µs, backend {doc['backend']})")
    rho = "n/a" if doc["spearman"] is None else f"{doc['spearman']:.2f}"
    ax.set_title(f"{doc['graph']}\nSpearman ρ = {rho} over {len(timed)} timed", fontsize=9)
    ax.legend(fontsize=8)
    _save(fig, plt, path)


def plot_pareto(doc: Mapping[str, Any], path: Path) -> None:
    """Every candidate's DRAM bytes against its launches, coloured by register peak; the Pareto front of the
    three ledgers ringed and joined, the chosen plan starred."""
    cands = list(doc["candidates"])
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    dots = ax.scatter([c["launches"] for c in cands], [c["bytes"] for c in cands], c=[c["reg_peak"] for c in cands],
                      cmap="viridis", s=20, alpha=0.8)
    fig.colorbar(dots, ax=ax, label="register peak (per thread)")
    on_front = pareto_front(cands, lambda c: (c["bytes"], c["launches"], c["reg_peak"]))
    front = sorted((cands[i] for i in on_front), key=lambda c: (c["launches"], c["bytes"]))
    ax.plot([c["launches"] for c in front], [c["bytes"] for c in front], color="tab:orange", linewidth=1,
            marker="o", markersize=9, markerfacecolor="none", label=f"Pareto front ({len(front)})")
    best = _marked(doc, "best")
    if best is not None:
        ax.scatter([best["launches"]], [best["bytes"]], marker="*", s=160, color="tab:red", label="chosen")
    ax.set_xlabel("kernel launches")
    ax.set_ylabel("DRAM bytes")
    ax.set_yscale("log")
    ax.set_title(f"{doc['graph']}: the three ledgers of {len(cands)} candidates", fontsize=9)
    ax.legend(fontsize=8)
    _save(fig, plt, path)


def plot_best_so_far(doc: Mapping[str, Any], path: Path) -> None:
    """Each timed candidate's median at the time the search decided it, the best fully timed plan so far as a
    step, the unfused plan as a line."""
    timed = _timed(doc)
    if not timed:
        _nothing_timed(doc, path)
        return
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    clock = all("at_s" in c for c in timed)
    order = sorted(timed, key=lambda c: c["at_s"]) if clock else timed
    xs = [c["at_s"] * 1e3 for c in order] if clock else list(range(1, len(order) + 1))
    best, steps = math.inf, []
    for c in order:
        if not c["stopped_early"]:
            best = min(best, c["meas_us"])
        steps.append(best)
    ax.scatter(xs, [c["meas_us"] for c in order], s=12, color="tab:gray", label="candidate median")
    ax.step(xs, steps, where="post", color="tab:green", label="best so far")
    unfused = _marked(doc, "unfused")
    if unfused is not None:
        ax.axhline(unfused["meas_us"], color="tab:red", linestyle="--", linewidth=1, label="unfused")
    ax.set_yscale("log")
    ax.set_xlabel("search time (ms)" if clock else "candidates timed")
    ax.set_ylabel("measured time (µs)")
    sp = "" if doc["speedup_vs_unfused"] is None else f", {doc['speedup_vs_unfused']:.2f}x vs unfused"
    ax.set_title(f"{doc['graph']} on {doc['backend']}{sp}", fontsize=9)
    ax.legend(fontsize=8)
    _save(fig, plt, path)


_DRAW = {"predicted_vs_measured": plot_predicted_vs_measured, "pareto": plot_pareto, "best_so_far": plot_best_so_far}


def write_plots(doc: Mapping[str, Any], out: Path, tag: str = "", fmt: str = "png") -> list[Path]:
    """The three plots of one search in ``out``: ``predicted_vs_measured[.tag].fmt``, ``pareto...``,
    ``best_so_far...``."""
    if fmt not in FORMATS:
        raise UsageError(f"plot format {fmt!r}: choose one of {', '.join(FORMATS)}")
    paths = []
    for stem in PLOTS:
        path = out / f"{stem}{'.' + tag if tag else ''}.{fmt}"
        _DRAW[stem](doc, path)
        paths.append(path)
    return paths
