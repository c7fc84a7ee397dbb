"""The two plots of a search: predicted vs measured time, and best-so-far (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from planner.search.results import SearchResult


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _nothing_timed(result: SearchResult, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.axis("off")
    ax.text(0.5, 0.5, f"{result.graph}\nno candidate was timed: backend {result.backend} only verifies",
            ha="center", va="center", fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_predicted_vs_measured(result: SearchResult, path: Path) -> None:
    timed = result.timed
    if not timed:
        _nothing_timed(result, path)
        return
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    full = [e for e in timed if not e.stopped_early]
    early = [e for e in timed if e.stopped_early]
    ax.scatter([e.est_us for e in full], [e.meas_us for e in full], s=18, label="timed")
    if early:
        ax.scatter([e.est_us for e in early], [e.meas_us for e in early], s=18, marker="^", label="stopped early (median so far)")
    for e, name, colour in ((result.unfused_entry, "unfused", "tab:red"), (result.best_entry, "best", "tab:green")):
        if e.meas_us is not None:
            ax.scatter([e.est_us], [e.meas_us], s=60, facecolors="none", edgecolors=colour, label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"estimated time (µs, cost model {result.device})")
    ax.set_ylabel(f"measured time (µs, backend {result.backend})")
    rho = "n/a" if result.spearman is None else f"{result.spearman:.2f}"
    ax.set_title(f"{result.graph}\nSpearman ρ = {rho} over {len(timed)} timed", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_best_so_far(result: SearchResult, path: Path) -> None:
    timed = result.timed
    if not timed:
        _nothing_timed(result, path)
        return
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = list(range(1, len(timed) + 1))
    ax.scatter(xs, [e.meas_us for e in timed], s=12, color="tab:gray", label="candidate median")
    ax.step(xs, result.best_so_far(), where="post", color="tab:green", label="best so far")
    u = result.unfused_entry
    if u.meas_us is not None:
        ax.axhline(u.meas_us, color="tab:red", linestyle="--", linewidth=1, label="unfused")
    ax.set_yscale("log")
    ax.set_xlabel("candidates timed")
    ax.set_ylabel("measured time (µs)")
    sp = "" if result.speedup_vs_unfused is None else f", {result.speedup_vs_unfused:.2f}x vs unfused"
    ax.set_title(f"{result.graph} on {result.backend}{sp}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
