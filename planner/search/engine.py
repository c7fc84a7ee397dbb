"""Measured search: compile, verify, then time candidate plans on a backend.

Order of work:

1. The unfused plan (one kernel per op) is compiled, verified and timed first,
   in full: it is the baseline of the reported speedup.  (A verify-only
   backend, ``measures = False`` and ``time`` raising ``BackendError`` like
   ``reference``, leaves every candidate "not timed"; the best is then the
   cost model's favourite among the verified candidates.)
2. Candidates in cost-model order (``CandidateSet.plans``).
3. When extraction did not enumerate the whole space, a genetic phase: parents
   are picked by tournament among the fastest measured plans and mutated with
   one operator of :mod:`planner.search.mutate`; one candidate in four is a fresh
   seeded sample of the space instead, to keep the population diverse.

Every candidate is compiled (compile time never counts), run once and checked
against the numpy reference of the unfused graph (``execute_graph`` in device
mode) with :mod:`planner.core.tolerance`; a tolerance breach, NaN/Inf or any
exception rejects it with the reason logged.  A verified candidate is timed
(warm-ups, repeats, median) and stopped early once its running median exceeds
best x ``early_stop`` (checked from the third sample on).  Duplicates (same plan key) are skipped.  A
backend that times kernels one by one inside a plan's runs (the CPU's) bounds the plans after it: a
candidate whose kernels timed in earlier plans already take longer, summed, than the best x ``early_stop``
is not compiled, verified or run (verdict "slower by its kernels"; each kernel's fastest time counts, so the
sum is a lower bound of the plan's, up to noise).  The search
ends at ``max_candidates`` candidates besides the baseline, after
``time_budget_s`` seconds of wall time, or when no new candidate turns up.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from planner.backend import Backend, BackendError, BackendUnavailable, CompiledPlan
from planner.core.errors import UsageError
from planner.core.kinds import Verdict, is_rejected, rejected
from planner.core.plans import Plan
from planner.core.reference import execute_graph, random_inputs
from planner.core.report import Count, count_json, log10_count
from planner.core.tolerance import check_outputs
from planner.egraph.candidates import CandidateSet
from planner.egraph.extract import Option, kernel_sig
from planner.search.mutate import Mutator
from planner.search.searchlog import SearchLog
from planner.torch import need_evaluator

log = logging.getLogger(__name__)

#: new plans bred, compiled together and then timed, per round of the genetic phase
GENERATION = 8
#: new candidates tried in a row that were all duplicates before the genetic phase gives up
STALL_LIMIT = 64
#: samples a candidate gets before the early stop may end its timing (one sample is too noisy)
MIN_SAMPLES_BEFORE_STOP = 3
#: parents for mutation are drawn from this many fastest measured plans
ELITE = 8


class SearchError(RuntimeError):
    """No candidate could be verified and timed (every one was rejected)."""


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

    def validate(self) -> None:
        if self.max_candidates < 1:
            raise UsageError(f"max candidates must be at least 1, got {self.max_candidates}")
        if not self.time_budget_s > 0:
            raise UsageError(f"time budget must be positive, got {self.time_budget_s}")
        if not self.early_stop >= 1.0:
            raise UsageError(f"early stop factor must be at least 1.0, got {self.early_stop}")
        if self.warmup < 0 or self.repeats < 1:
            raise UsageError(f"need warmup >= 0 and repeats >= 1, got {self.warmup} and {self.repeats}")
        for name in ("rtol", "atol"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise UsageError(f"{name} must be a finite non-negative number, got {v}")


@dataclass
class Entry:
    """One candidate's fate."""

    plan: Plan
    source: str  # "unfused baseline", "model order", "mutant: <operator> <tensors>", "sample"
    verdict: str = Verdict.NOT_TIMED  # a Verdict, or "rejected: <reason>" (kinds.rejected)
    meas_us: float | None = None
    samples_us: list[float] = field(default_factory=list)
    stopped_early: bool = False
    compile_s: float | None = None
    verified: bool = False
    max_abs: float | None = None
    max_rel: float | None = None
    facts: list[dict[str, Any]] = field(default_factory=list)
    choice: dict[str, Option] | None = field(default=None, repr=False)
    #: the median of the final interleaved re-measurement (the unfused plan and the finalists only)
    confirm_us: float | None = None
    #: a plan not run for its kernels' times: their sum (µs), from the plans timed before it
    bound_us: float | None = None

    @property
    def est_us(self) -> float:
        return self.plan.est_us

    @property
    def timed(self) -> bool:
        return self.meas_us is not None

    def to_json(self) -> dict[str, Any]:
        d = self.plan.to_json()
        for kj, facts in zip(d["kernels"], self.facts, strict=False):
            kj.update(facts)
        d.update(
            meas_us=None if self.meas_us is None else round(self.meas_us, 4),
            verdict=self.verdict,
            verified=self.verified,
            source=self.source,
            stopped_early=self.stopped_early,
            samples_us=[round(s, 4) for s in self.samples_us],
            compile_s=None if self.compile_s is None else round(self.compile_s, 4),
            max_abs_err=_json_float(self.max_abs),
            max_rel_err=_json_float(self.max_rel),
        )
        if self.confirm_us is not None:
            d["confirm_us"] = round(self.confirm_us, 4)
        if self.bound_us is not None:
            d["bound_us"] = round(self.bound_us, 4)
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
    stop: str
    options: SearchOptions

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
        return [e for e in self.entries if is_rejected(e.verdict)]

    @property
    def bounded(self) -> list[Entry]:
        """Candidates not run: their kernels timed in earlier plans already lose (see the module docstring)."""
        return [e for e in self.entries if e.verdict == Verdict.BOUNDED]

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
            "options": {k: _json_float(v) if isinstance(v, float) else v for k, v in vars(self.options).items()},
            "elapsed_s": round(self.elapsed_s, 4),
            "stop": self.stop,
            "timed": len(self.timed),
            "rejected": len(self.rejected),
            "bounded": len(self.bounded),
            "speedup_vs_unfused": None if self.speedup_vs_unfused is None else round(self.speedup_vs_unfused, 4),
            "spearman": None if self.spearman is None else round(self.spearman, 4),
            "best": self.best_entry.to_json(),
            "unfused": self.unfused_entry.to_json(),
            "candidates": cands,
            "log": self.log_lines,
        }


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman rank correlation (average ranks for ties); None below 3 points or for constant data."""
    if len(xs) != len(ys):
        raise ValueError("spearman needs two sequences of equal length")
    if len(xs) < 3:
        return None
    rx, ry = _ranks(np.asarray(xs, dtype=float)), _ranks(np.asarray(ys, dtype=float))
    if rx.std() == 0 or ry.std() == 0:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])


def _ranks(a: np.ndarray) -> np.ndarray:
    order = np.argsort(a, kind="mergesort")
    ranks = np.empty(len(a), dtype=float)
    ranks[order] = np.arange(len(a), dtype=float)
    for v in np.unique(a):  # ties share their average rank
        tie = a == v
        if tie.sum() > 1:
            ranks[tie] = ranks[tie].mean()
    return ranks


class _Run:
    """State of one search."""

    def __init__(
        self,
        cands: CandidateSet,
        backend: Backend,
        inputs: Mapping[str, np.ndarray],
        opts: SearchOptions,
        slog: SearchLog,
        on_candidate: Callable[[int, int], None] | None,
    ) -> None:
        self.cands, self.backend, self.inputs, self.opts, self.slog = cands, backend, inputs, opts, slog
        self.expected = execute_graph(cands.graph, inputs, "device")
        self.finite_inputs = all(bool(np.isfinite(v).all()) for v in inputs.values())
        self.oracle: list[np.ndarray] | None = None  # fp64 values, computed on the first tolerance miss
        self.entries: list[Entry] = []
        self.seen: set[str] = set()
        self.best: Entry | None = None
        self.kernel_min: dict[str, float] = {}  # kernel signature -> its fastest time in any plan timed (µs)
        self.tried = 0  # candidates besides the baseline
        self.t0 = time.perf_counter()
        self.on_candidate = on_candidate
        self.stop = ""

    # -- budgets
    def budget_left(self) -> bool:
        if self.tried >= self.opts.max_candidates:
            self.stop = self.stop or f"max candidates ({self.opts.max_candidates})"
            return False
        if time.perf_counter() - self.t0 >= self.opts.time_budget_s:
            self.stop = self.stop or f"time budget ({self.opts.time_budget_s:g}s)"
            return False
        return True

    # -- one candidate
    def consider(self, plan: Plan, choice: dict[str, Option] | None, source: str, baseline: bool = False) -> bool:
        """Compile, verify and time a new plan; False if it is a duplicate."""
        if plan.key in self.seen:
            return False
        self.seen.add(plan.key)
        if not baseline:
            self.tried += 1
        entry = Entry(plan, source, choice=choice)
        self.entries.append(entry)
        if not baseline and self._bounded(entry):
            return True
        try:
            self._evaluate(entry, baseline)
        except BackendUnavailable:  # the machine cannot run this backend at all: not the candidate's fault
            raise
        except Exception as exc:  # a crashing candidate never takes the search down
            log.debug("candidate %s failed", plan.key, exc_info=True)
            self._reject(entry, f"{type(exc).__name__}: {_one_line(exc)}")
        if self.on_candidate is not None:
            self.on_candidate(self.tried, self.opts.max_candidates)
        return True

    def _evaluate(self, entry: Entry, baseline: bool) -> None:
        compiled = self.backend.compile(entry.plan)
        entry.compile_s = compiled.compile_s
        entry.facts = [dict(f) for f in compiled.kernel_facts]
        if self._cannot_win(entry, compiled, baseline):
            return
        outs = compiled.run(self.inputs)
        reason = self._verify(entry, outs)
        if reason is not None:
            self._reject(entry, reason)
            return
        bound = math.inf if baseline or self.best is None else self.best.meas_us * self.opts.early_stop  # type: ignore[operator]
        stop_if = _Stopper(bound, deadline=self.t0 + self.opts.time_budget_s)
        entry.verified = True
        try:
            timing = compiled.time(self.inputs, warmup=self.opts.warmup, repeats=self.opts.repeats, stop_if=stop_if)
        except BackendError:
            if self.backend.measures:
                raise
            return  # a verify-only backend (reference): verified, "not timed"
        if not timing.samples_us:
            raise RuntimeError("backend returned no timing samples")
        entry.samples_us = list(timing.samples_us)
        entry.meas_us = timing.median_us
        entry.stopped_early = timing.stopped_early and stop_if.by_bound
        entry.verdict = Verdict.TIMED
        for kernel, us in zip(entry.plan.kernels, timing.kernel_min_us or (), strict=False):
            sig = kernel_sig(kernel)
            self.kernel_min[sig] = min(us, self.kernel_min.get(sig, math.inf))
        self._record(entry)

    def _bounded(self, entry: Entry) -> bool:
        """Record a candidate as slower, unrun, when the kernels it shares with plans timed before take longer
        than the best allows (the sum of their fastest times; its other kernels count as free)."""
        best = self.best
        if best is None or best.meas_us is None or not self.kernel_min:
            return False
        bound = sum(self.kernel_min.get(kernel_sig(k), 0.0) for k in entry.plan.kernels)
        if bound <= best.meas_us * self.opts.early_stop:
            return False
        entry.bound_us = bound
        entry.verdict = Verdict.BOUNDED
        self.slog.bounded(entry.plan, bound / best.meas_us, entry.est_us, bound, _origin(entry))
        return True

    def _cannot_win(self, entry: Entry, compiled: CompiledPlan, baseline: bool) -> bool:
        """On a backend whose timings are given, not measured (the cost model): record a candidate whose time
        cannot beat the best so far without executing it, since nothing would be decided by its numerics.
        Verification then costs the baseline plus each new best, not every candidate (a verify-only
        backend, which gives no time at all, still verifies everything)."""
        if self.backend.measures or baseline or self.best is None:
            return False
        try:
            timing = compiled.time(self.inputs, warmup=0, repeats=1)
        except BackendError:
            return False
        if not timing.samples_us or timing.median_us < self.best.meas_us:  # type: ignore[operator]
            return False
        entry.samples_us = list(timing.samples_us)
        entry.meas_us = timing.median_us
        entry.verdict = Verdict.TIMED  # timed by its given figure; not executed (entry.verified stays False)
        self._record(entry)
        return True

    def finalists(self) -> list[Entry]:
        """The best and the fully timed runners-up within :data:`FINAL_MARGIN` of it, fastest first, at most
        :data:`FINALISTS`: on a machine whose load drifts, timings minutes apart cannot tell them apart."""
        best = self.best
        assert best is not None and best.meas_us is not None
        if not self.backend.measures:  # given figures (the cost model) do not drift
            return [best]
        close = sorted((e for e in self.entries if e is not best and e.verdict == Verdict.TIMED and not e.stopped_early
                        and e.meas_us is not None and e.meas_us <= best.meas_us * FINAL_MARGIN),
                       key=lambda e: e.meas_us)  # type: ignore[arg-type, return-value]
        return [best, *close[: FINALISTS - 1]]

    def final_round(self, base: Entry, finalists: list[Entry], rounds: int = 5) -> tuple[Entry, float]:
        """The winner among ``finalists`` and its speedup over the unfused ``base``, from one interleaved
        re-measurement of all of them: they alternate round by round, so a machine that got busier during the
        search slows each alike.  Medians over all rounds; 1.0 when the unfused plan wins."""
        contenders = list({id(e): e for e in [base, *finalists]}.values())
        if len(contenders) == 1:
            return base, 1.0
        plans = [(e, self.backend.compile(e.plan)) for e in contenders]
        samples: dict[int, list[float]] = {id(e): [] for e in contenders}
        for _ in range(rounds):
            for e, compiled in plans:
                samples[id(e)] += compiled.time(self.inputs, warmup=1, repeats=3).samples_us
        for e in contenders:
            e.confirm_us = float(np.median(samples[id(e)]))
        winner = min(finalists, key=lambda e: e.confirm_us)  # type: ignore[arg-type, return-value]
        if len(finalists) > 1:
            self.slog.final_round([(e.plan, e.confirm_us) for e in finalists], winner.plan)  # type: ignore[misc]
        return winner, base.confirm_us / winner.confirm_us  # type: ignore[operator]

    def _verify(self, entry: Entry, outs: Sequence[np.ndarray]) -> str | None:
        reason, entry.max_abs, entry.max_rel = check_outputs(
            entry.plan, outs, self.expected, self.opts.rtol, self.opts.atol, finite_inputs=self.finite_inputs
        )
        if reason is not None and reason.startswith("tolerance"):  # the fp64 allowance, computed on demand
            if self.oracle is None:
                self.oracle = execute_graph(self.cands.graph, self.inputs, "oracle")
            reason, entry.max_abs, entry.max_rel = check_outputs(
                entry.plan, outs, self.expected, self.opts.rtol, self.opts.atol, self.oracle, self.finite_inputs
            )
        return reason

    def _reject(self, entry: Entry, reason: str) -> None:
        entry.verdict = rejected(reason)
        entry.meas_us = None
        self.slog.rejected(reason, entry.plan, _origin(entry))

    def _record(self, entry: Entry) -> None:
        meas = entry.meas_us
        assert meas is not None
        if self.best is None:
            self.best = entry
            self.slog.start(entry.plan, entry.est_us, meas, _origin(entry))
        elif meas < self.best.meas_us and not entry.stopped_early:  # type: ignore[operator]
            gain = self.best.meas_us / meas  # type: ignore[operator]
            self.best = entry
            self.slog.faster(entry.plan, entry.est_us, meas, gain, _origin(entry))
        else:
            ratio = meas / self.best.meas_us  # type: ignore[operator]
            stopped = len(entry.samples_us) if entry.stopped_early else None
            self.slog.slower(entry.plan, ratio, entry.est_us, meas, stopped, _origin(entry))

    # -- the genetic phase
    def evolve(self, rng: random.Random) -> None:
        """Generations of :data:`GENERATION` new plans, bred from the elite of what was timed so far; each
        generation's kernels are prepared (compiled) together, then its plans are considered in turn."""
        mutator = Mutator(self.cands.extractor)
        stall = 0
        while self.budget_left():
            if stall >= STALL_LIMIT:
                self.stop = f"no new candidate in {STALL_LIMIT} tries"
                return
            room = min(GENERATION, self.opts.max_candidates - self.tried)
            generation, stall = self._breed(mutator, rng, room, stall)
            self.backend.prepare([plan for plan, _, _ in generation])
            for plan, choice, source in generation:
                if not self.budget_left():
                    return
                self.consider(plan, choice, source)

    def _breed(self, mutator: Mutator, rng: random.Random, room: int,
               stall: int) -> tuple[list[tuple[Plan, dict[str, Option], str]], int]:
        """Up to ``room`` plans not seen before (samples, or mutants of a tournament winner), and the count of
        consecutive tries that gave nothing new."""
        ex = self.cands.extractor
        elite = sorted(
            (e for e in self.entries if e.timed and not e.stopped_early and e.choice is not None),
            key=lambda e: e.meas_us,  # type: ignore[arg-type, return-value]
        )[:ELITE]
        out: list[tuple[Plan, dict[str, Option], str]] = []
        keys = set(self.seen)
        while len(out) < room and stall < STALL_LIMIT:
            if not elite or rng.random() < 0.25:
                (choice,) = ex.sample(1, rng.randrange(2**31)) or [ex.unfused()]
                source = "sample"
            else:
                a, b = rng.choice(elite), rng.choice(elite)
                parent = a if a.meas_us <= b.meas_us else b  # type: ignore[operator]
                assert parent.choice is not None
                mutant = mutator.random_mutant(parent.choice, rng, exclude=keys)
                if mutant is None:
                    stall += 1
                    continue
                choice, source = mutant.choice, f"mutant: {mutant.label}"
            plan = ex.plan_of(choice)
            if plan.key in keys:
                stall += 1
                continue
            keys.add(plan.key)
            out.append((plan, choice, source))
            stall = 0
        return out, stall


def search(
    cands: CandidateSet,
    backend: Backend,
    inputs: Mapping[str, np.ndarray] | None = None,
    options: SearchOptions | None = None,
    log: SearchLog | None = None,
    *,
    on_candidate: Callable[[int, int], None] | None = None,
) -> SearchResult:
    """Verify and time candidates on ``backend``; see the module docstring.

    ``on_candidate(done, max_candidates)`` is called after each candidate (progress bars).
    Raises :class:`SearchError` if no candidate, the baseline included, passes verification.
    """
    opts = options or SearchOptions()
    opts.validate()
    need_evaluator(cands.graph)
    slog = log if log is not None else SearchLog()
    inputs = inputs if inputs is not None else random_inputs(cands.graph, seed=opts.seed)
    slog.header(cands.graph.name, cands.space, cands.complete, backend.name, cands.spec.name)
    run = _Run(cands, backend, inputs, opts, slog, on_candidate)
    ex = cands.extractor
    unfused_choice = ex.unfused()
    unfused = ex.plan_of(unfused_choice)
    backend.prepare([unfused, *cands.plans[: opts.max_candidates]])  # the CPU's kernels: a few batched builds
    run.consider(unfused, unfused_choice, "unfused baseline", baseline=True)
    try:
        for plan in cands.plans:
            if plan.key in run.seen:
                continue
            # the cost model's favourite is always compared with the baseline, however short the budget
            # (a long graph's segments share one budget: the last may find it spent)
            if run.tried and not run.budget_left():
                break
            run.consider(plan, cands.choices.get(plan.key), "model order")
        else:
            if cands.complete:
                run.stop = run.stop or "every candidate tried"
            else:
                run.evolve(random.Random(opts.seed))
    except KeyboardInterrupt:  # Ctrl-C: the best plan so far is still a verified plan
        if run.best is None:
            raise
        run.stop = INTERRUPTED
        logging.getLogger(__name__).warning("search interrupted: keeping the best plan found so far")
    for plan in cands.plans:  # the rest of the cost-model list, for the record
        if plan.key not in run.seen:
            run.entries.append(Entry(plan, "model order", choice=cands.choices.get(plan.key)))
    elapsed = time.perf_counter() - run.t0
    if run.best is None:
        verified = [e for e in run.entries if e.verified and not is_rejected(e.verdict)]
        if not verified:
            reasons = "; ".join(sorted({e.verdict for e in run.entries if is_rejected(e.verdict)}))
            raise SearchError(f"every candidate was rejected ({reasons})")
        # a verify-only backend: the model's favourite among the verified candidates
        run.best = min(verified, key=lambda e: e.plan.sort_key())
    base = run.entries[0]
    speedup = None
    if base.timed and run.best.timed and run.stop != INTERRUPTED:
        run.best, speedup = run.final_round(base, run.finalists())
    run.best.verdict = Verdict.BEST
    timed = [e for e in run.entries if e.timed]
    rho = spearman([e.est_us for e in timed], [e.meas_us for e in timed])  # type: ignore[misc]
    n_rejected = sum(is_rejected(e.verdict) for e in run.entries)
    n_bounded = sum(e.verdict == Verdict.BOUNDED for e in run.entries)
    slog.footer(elapsed, run.best.plan, speedup, len(timed), n_rejected, rho, run.stop or "done", n_bounded)
    return SearchResult(
        graph=cands.graph.name,
        backend=backend.name,
        measures=backend.measures,
        device=cands.spec.name,
        space=cands.space,
        enumerated=cands.complete,
        best=run.best.plan,
        unfused=unfused,
        entries=run.entries,
        log_lines=list(slog.lines),
        speedup_vs_unfused=speedup,
        spearman=rho,
        elapsed_s=elapsed,
        stop=run.stop or "done",
        options=opts,
    )


def _json_float(x: float | None) -> float | str | None:
    """Strict JSON has no Infinity/NaN: those become strings."""
    if x is None or math.isfinite(x):
        return x
    return str(x)


def _origin(entry: Entry) -> str:
    """Log suffix for candidates that did not come from the cost-model list."""
    return entry.source if entry.source.startswith(("mutant", "sample")) else ""


#: runners-up within this factor of the best's search timing are re-measured with it before one is chosen
FINAL_MARGIN = 1.15
#: at most this many plans (the best included) in that final round
FINALISTS = 3

#: SearchResult.stop of a search ended by Ctrl-C (its best is not kept in the plan cache)
INTERRUPTED = "interrupted (Ctrl-C)"


class _Stopper:
    """``stop_if`` for CompiledPlan.time: after :data:`MIN_SAMPLES_BEFORE_STOP` samples, stop when the
    running median is above ``bound`` (``by_bound``: the candidate is slower) or the search's time budget
    is spent (so a huge ``--repeats`` still obeys ``--time-budget``, and a candidate timed at the end of
    the budget still has a median of its own)."""

    def __init__(self, bound: float, deadline: float = math.inf) -> None:
        self.bound, self.deadline, self.calls, self.by_bound = bound, deadline, 0, False

    def __call__(self, median_us: float) -> bool:
        self.calls += 1
        if self.calls < MIN_SAMPLES_BEFORE_STOP:
            return False
        self.by_bound = median_us > self.bound
        return self.by_bound or time.perf_counter() > self.deadline


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else "(no message)"
