"""What a search is given and what it gives back: its options, each candidate's fate (:class:`Entry`), why the
search stopped (:class:`Stop`) and the result (:class:`SearchResult`), all as JSON as ``results.json`` holds them."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from planner.core.errors import UsageError
from planner.core.kinds import Verdict, rejected
from planner.core.plans import Plan
from planner.core.report import Count, count_json, log10_count
from planner.core.tolerance import check_tolerance_override
from planner.egraph.extract import Option


@dataclass
class SearchOptions:
    max_candidates: int = 64  # candidates besides the unfused baseline
    time_budget_s: float = 60.0
    early_stop: float = 1.5
    warmup: int = 2
    repeats: int = 7
    seed: int = 0
    rtol: float | None = None  # override the dtype's tolerance
    atol: float | None = None
    #: a candidate within the noise of the best is compared with it in interleaved rounds, at most this many,
    #: until this confidence separates them (planner.search.duel); a tie keeps the cost model's choice
    max_rounds: int = 24
    confidence: float = 0.95
    #: the genetic phase ends after this many candidates in a row brought no new best (0: never)
    patience: int = 16

    def validate(self) -> None:
        if self.max_candidates < 1:
            raise UsageError(f"max candidates must be at least 1, got {self.max_candidates}")
        if not self.time_budget_s > 0:
            raise UsageError(f"time budget must be positive, got {self.time_budget_s}")
        if not self.early_stop >= 1.0:
            raise UsageError(f"early stop factor must be at least 1.0, got {self.early_stop}")
        if self.warmup < 0 or self.repeats < 1:
            raise UsageError(f"need warmup >= 0 and repeats >= 1, got {self.warmup} and {self.repeats}")
        check_tolerance_override(self.rtol, self.atol)
        if self.max_rounds < 8:
            raise UsageError(f"max rounds must be at least 8 (a confidence interval needs them), got {self.max_rounds}")
        if not 0.5 <= self.confidence < 1.0:
            raise UsageError(f"confidence must be in [0.5, 1), got {self.confidence}")
        if self.patience < 0:
            raise UsageError(f"patience must be at least 0 (0: never stop for it), got {self.patience}")


class StopKind(StrEnum):
    """Why a search stopped."""

    MAX_CANDIDATES = "max candidates"
    TIME_BUDGET = "time budget"
    STALLED = "no new candidate"
    PATIENCE = "no faster plan"
    EXHAUSTED = "every candidate tried"
    SMALL_SHARE = "a small share of the model"
    INTERRUPTED = "interrupted (Ctrl-C)"
    DONE = "done"


@dataclass(frozen=True)
class Stop:
    """Why a search stopped, with the bound it reached (``detail``): printed as the log and files show it."""

    kind: StopKind
    detail: str = ""

    def __str__(self) -> str:
        if self.kind == StopKind.STALLED:
            return f"no new candidate in {self.detail} tries"
        if self.kind == StopKind.PATIENCE:
            return f"no faster plan in the last {self.detail} candidates"
        if self.kind == StopKind.SMALL_SHARE:
            return f"{self.detail} of the whole model's estimated time: the cost model's favourite only"
        return f"{self.kind} ({self.detail})" if self.detail else str(self.kind)


@dataclass
class Entry:
    """One candidate's fate."""

    plan: Plan
    source: str  # "unfused baseline", "model order", "mutant: <operator> <tensors>", "sample"
    verdict: Verdict = Verdict.NOT_TIMED
    reason: str = ""  # why it was rejected (verdict REJECTED)
    meas_us: float | None = None
    samples_us: list[float] = field(default_factory=list)
    stopped_early: bool = False
    #: timed until its median was slower than the best beyond the noise (``engine.SETTLE_BANDS``), not to the end
    settled: bool = False
    compile_s: float | None = None
    verified: bool = False
    max_abs: float | None = None
    max_rel: float | None = None
    facts: list[dict[str, Any]] = field(default_factory=list)
    choice: dict[str, Option] | None = field(default=None, repr=False)
    #: the median of the final interleaved re-measurement (the unfused plan and the finalists only)
    confirm_us: float | None = None
    #: a plan not run for its kernels' times, from the plans timed before it: the time they bound it by (the sum
    #: of its timed kernels' fastest runs), or predict for it (the best's, less the kernels they differ in)
    bound_us: float | None = None
    #: its comparison with the best of its time, where it was within the noise (planner.search.duel)
    duel: str | None = None
    #: seconds from the search's start to this candidate's verdict (the best-so-far plot's time axis)
    at_s: float | None = None

    @property
    def est_us(self) -> float:
        return self.plan.est_us

    @property
    def timed(self) -> bool:
        return self.meas_us is not None

    @property
    def time_us(self) -> float:
        """The measured median of a timed entry."""
        if self.meas_us is None:
            raise ValueError(f"candidate {self.plan.key} was not timed")
        return self.meas_us

    @property
    def confirmed_us(self) -> float:
        """The final round's median of a finalist."""
        if self.confirm_us is None:
            raise ValueError(f"candidate {self.plan.key} was not in the final round")
        return self.confirm_us

    @property
    def rejected(self) -> bool:
        return self.verdict == Verdict.REJECTED

    @property
    def verdict_text(self) -> str:
        """The verdict as files and tables show it: ``rejected: <reason>`` for a rejected candidate."""
        return rejected(self.reason) if self.rejected else str(self.verdict)

    def reject(self, reason: str) -> None:
        self.verdict, self.reason, self.meas_us = Verdict.REJECTED, reason, None

    def to_json(self) -> dict[str, Any]:
        d = self.plan.to_json()
        for kj, facts in zip(d["kernels"], self.facts, strict=False):
            kj.update(facts)
        d.update(
            meas_us=None if self.meas_us is None else round(self.meas_us, 4),
            verdict=self.verdict_text,
            verified=self.verified,
            source=self.source,
            stopped_early=self.stopped_early,
            settled=self.settled,
            samples_us=[round(s, 4) for s in self.samples_us],
            compile_s=None if self.compile_s is None else round(self.compile_s, 4),
            max_abs_err=json_float(self.max_abs),
            max_rel_err=json_float(self.max_rel),
        )
        if self.confirm_us is not None:
            d["confirm_us"] = round(self.confirm_us, 4)
        if self.bound_us is not None:
            d["bound_us"] = round(self.bound_us, 4)
        if self.duel is not None:
            d["duel"] = self.duel
        if self.at_s is not None:
            d["at_s"] = round(self.at_s, 4)
        return d


@dataclass
class SearchResult:
    graph: str
    backend: str
    measures: bool
    device: str
    space: Count
    enumerated: bool
    best: Plan
    unfused: Plan
    entries: list[Entry]
    log_lines: list[str]
    speedup_vs_unfused: float | None
    spearman: float | None
    elapsed_s: float
    stop: Stop
    options: SearchOptions
    #: what each candidate's check compared, for the report ("verified" means this check could have failed)
    verification: str = ""

    @property
    def best_entry(self) -> Entry:
        return next(e for e in self.entries if e.plan.key == self.best.key)

    @property
    def unfused_entry(self) -> Entry:
        return next(e for e in self.entries if e.plan.key == self.unfused.key)

    @property
    def timed(self) -> list[Entry]:
        """Timed entries in the order they were timed."""
        return [e for e in self.entries if e.timed]

    @property
    def rejected(self) -> list[Entry]:
        return [e for e in self.entries if e.rejected]

    @property
    def interrupted(self) -> bool:
        """Ended by Ctrl-C: it decided less than it was asked to (its best is not kept in the plan cache)."""
        return self.stop.kind == StopKind.INTERRUPTED

    @property
    def bounded(self) -> list[Entry]:
        """Candidates not run: their kernels timed in earlier plans already lose (see the module docstring)."""
        return [e for e in self.entries if e.verdict == Verdict.BOUNDED]

    @property
    def predicted(self) -> list[Entry]:
        """Candidates not run: their kernels, timed in earlier plans, predict no win beyond a duel's margin
        (``engine.Search._predicted``)."""
        return [e for e in self.entries if e.verdict == Verdict.PREDICTED]

    def best_so_far(self) -> list[float]:
        """Best fully-timed median after each timed candidate (for the plot)."""
        out: list[float] = []
        best = float("inf")
        for e in self.timed:
            if not e.stopped_early:
                best = min(best, e.meas_us or best)
            out.append(best)
        return out

    def to_json(self) -> dict[str, Any]:
        cands = []
        for e in self.entries:
            d = e.to_json()
            d["best"] = e.plan.key == self.best.key
            cands.append(d)
        return {
            "graph": self.graph,
            "backend": self.backend,
            "measures": self.measures,
            "device": self.device,
            "space": count_json(self.space),
            "space_log10": round(log10_count(self.space), 4),
            "enumerated": self.enumerated,
            "options": {k: json_float(v) if isinstance(v, float) else v for k, v in vars(self.options).items()},
            "elapsed_s": round(self.elapsed_s, 4),
            "stop": str(self.stop),
            "verification": self.verification,
            "timed": len(self.timed),
            "rejected": len(self.rejected),
            "bounded": len(self.bounded),
            "predicted": len(self.predicted),
            "speedup_vs_unfused": None if self.speedup_vs_unfused is None else round(self.speedup_vs_unfused, 4),
            "spearman": None if self.spearman is None else round(self.spearman, 4),
            "best": self.best_entry.to_json(),
            "unfused": self.unfused_entry.to_json(),
            "candidates": cands,
            "log": self.log_lines,
        }


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman rank correlation (average ranks for ties, as scipy's); None below 3 points or for constant data.
    Computed here: importing scipy.stats for it took 0.4-0.6 s, a cold plan's or a command's whole start."""
    if len(xs) != len(ys):
        raise ValueError("spearman needs two sequences of equal length")
    if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return None
    rx, ry = average_ranks(xs), average_ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))


def average_ranks(values: Sequence[float]) -> list[float]:
    """Each value's rank from 1, tied values sharing the mean of their ranks."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for k in range(start, end + 1):
            ranks[order[k]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def json_float(x: float | None) -> float | str | None:
    """Strict JSON has no Infinity/NaN: those become strings."""
    if x is None or math.isfinite(x):
        return x
    return str(x)
