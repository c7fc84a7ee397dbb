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
best x ``early_stop`` (checked from the third sample on); on a backend that times live, it is *settled* once
that running median lies beyond the best by ``SETTLE_BANDS`` noise bands (``SETTLE_BANDS_NOT_PREFERRED`` for a
candidate the cost model does not prefer, which a tie never crowns), or once the kernels it differs in from the best,
timed in those runs, already make it a tie (``_decided_by_kernels``): its median kept as its time (for the final
round and as a parent of mutants), without the runs that could only confirm it.  Duplicates (same plan key) are skipped.  A
backend that times kernels one by one inside a plan's runs (the CPU's) bounds the plans after it: a
candidate whose kernels timed in earlier plans already take longer, summed, than the best x ``early_stop``
is not compiled, verified or run (verdict "slower by its kernels"; each kernel's fastest time counts, so the
sum is a lower bound of the plan's, up to noise).  The search
ends at ``max_candidates`` candidates besides the baseline, after
``time_budget_s`` seconds of wall time, when no new candidate turns up, or when the genetic phase has gone
``patience`` candidates without a new best.  A region of a whole model whose share of the model's time is below
``SMALL_SHARE`` (the pipeline's estimate, corrected by its baseline's measurement) compares the cost model's
favourite with the unfused plan and stops: not even a free region could make the model faster by a duel's margin.
"""

from __future__ import annotations

import logging
import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from planner.backend import Backend, BackendError, BackendUnavailable, CompiledPlan
from planner.core.errors import UsageError
from planner.core.inputs import NonnegativeRecipe
from planner.core.kinds import Verdict
from planner.core.plans import Plan
from planner.core.reference import execute_graph, recipe_inputs
from planner.core.tolerance import check_outputs, vacuous_inputs, vacuous_reference, verification_text
from planner.egraph.candidates import CandidateSet
from planner.egraph.extract import Option, kernel_sig
from planner.search.duel import Outcome, duel, looks, noise, ratio_interval
from planner.search.mutate import Mutator
from planner.search.results import Entry, SearchOptions, SearchResult, Stop, StopKind, spearman
from planner.search.searchlog import SearchLog
from planner.torch import need_evaluator

log = logging.getLogger(__name__)

#: new plans bred, compiled together and then timed, per round of the genetic phase
GENERATION = 8
#: new candidates tried in a row that were all duplicates before the genetic phase gives up
STALL_LIMIT = 64
#: samples a candidate gets before the early stop may end its timing (one sample is too noisy)
MIN_SAMPLES_BEFORE_STOP = 3
#: where its region's unfused plan runs this long (µs), a candidate's verification run is its only warm-up: what one
#: run leaves in the caches is well under 1% of such a run, and a padded BERT's MLP half (27 ms a run) spent a
#: fifth of its search on the second warm-up of each candidate
LONG_RUN_US = 5_000.0
#: a candidate whose running median (from its third sample on) lies beyond the best's time by this many noise
#: bands is slower, settled: its timing ends there and its median stands (for the final round and the parents of
#: mutants) where the other runs could only confirm it (a 45 ms BERT took 9 runs a candidate, its cold plan 18 s)
SETTLE_BANDS = 1.5
#: the same for a candidate the cost model does not prefer to the best: half a band above the best's time, its
#: median could turn lower only by a quieter moment, and even a lower one needs a duel's 1% to win, a tie keeping
#: the best
SETTLE_BANDS_NOT_PREFERRED = 0.5
#: parents for mutation are drawn from this many fastest measured plans
ELITE = 8
#: candidates whose kernels are built with the baseline's, in the search's first batched build; the rest of the cost
#: model's list is built in one more batch when the search reaches it, less the candidates whose kernels timed by
#: then rule them out (an attention's 63 decomposed softmax forms once the fused kernel is timed: 30 kernels
#: compiled in 1 s of a 3 s cold plan, most for candidates never run). One more compiler start costs ~40 ms.
FIRST_BUILD = 4
#: candidates a region below ``SMALL_SHARE`` of its whole model's time tries besides the unfused plan: the cost
#: model's favourite (an embedding's search of 18 candidates was 1.3 s of BERT's 14 s cold plan, for 0.3% of its
#: call; 0.5 s with this)
BRIEF_CANDIDATES = 1


class SearchError(RuntimeError):
    """No candidate could be verified and timed (every one was rejected)."""


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
        expected: list[np.ndarray] | None = None,
    ) -> None:
        """``expected``: the reference's outputs on ``inputs``, where already computed."""
        self.cands, self.backend, self.inputs, self.opts, self.slog = cands, backend, inputs, opts, slog
        graph_inputs = {n.id: inputs[n.id] for n in cands.graph.inputs if n.id in inputs}
        problem = vacuous_inputs(graph_inputs)
        self.expected = execute_graph(cands.graph, inputs, "device") if expected is None else expected
        problem = problem or vacuous_reference(cands.graph.outputs, self.expected)
        if problem:
            raise UsageError(f"{cands.graph.name}: no candidate can be verified: {problem}; plan with inputs of "
                             "varied finite values")
        self.finite_inputs = all(bool(np.isfinite(v).all()) for v in inputs.values())
        self.oracle: list[np.ndarray] | None = None  # fp64 values, computed on the first tolerance miss
        self.entries: list[Entry] = []
        self.seen: set[str] = set()
        self.best: Entry | None = None
        self.kernel_min: dict[str, float] = {}  # kernel signature -> its fastest time in any plan timed (µs)
        #: (the best's key, the kernels a challenger had and the best lacked, those the best had, the duel's
        #: figures) of each duel that ended in a tie
        self.tied_swaps: list[tuple[str, Counter[str], Counter[str], str]] = []
        self.tried = 0  # candidates besides the baseline
        self.t0 = time.perf_counter()
        self.on_candidate = on_candidate
        #: candidates the search will try besides the baseline, where known: the cost model's whole list, else
        #: (a sampled space) up to max_candidates
        self.total = min(len(cands.plans), opts.max_candidates) if cands.complete else opts.max_candidates
        self.stop: Stop | None = None
        self.best_compiled: CompiledPlan | None = None  # the best's compiled plan, for interleaved comparisons
        self.band = 0.0  # a candidate within this fraction of the best is compared with it in rounds
        self.crowned_at = 0  # candidates tried when a faster best was last found (the genetic phase's patience)
        self.small_share: float | None = None  # a small region's share of its model (``weigh``): a brief search

    # -- budgets
    def budget_left(self) -> bool:
        if self.small_share is not None and self.tried >= BRIEF_CANDIDATES:
            self.stop = self.stop or Stop(StopKind.SMALL_SHARE, f"{self.small_share:.2%}")
            return False
        if self.tried >= self.opts.max_candidates:
            self.stop = self.stop or Stop(StopKind.MAX_CANDIDATES, str(self.opts.max_candidates))
            return False
        if time.perf_counter() - self.t0 >= self.opts.time_budget_s:
            self.stop = self.stop or Stop(StopKind.TIME_BUDGET, f"{self.opts.time_budget_s:g}s")
            return False
        return True

    def weigh(self, share: float) -> None:
        """Make the search brief where the region's ``share`` of its model's estimated time, with its estimate
        replaced by its baseline's measurement, is below ``SMALL_SHARE``."""
        base = self.entries[0]
        if share >= 1.0:
            return
        if base.timed and base.est_us > 0:
            measured = share * base.time_us / base.est_us
            share = measured / (measured + 1.0 - share)
        if share < SMALL_SHARE:
            self.small_share = share

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
        if not baseline and (self._bounded(entry) or self._predicted(entry)):
            return True
        try:
            self._evaluate(entry, baseline)
        except BackendUnavailable:  # the machine cannot run this backend at all: not the candidate's fault
            raise
        except Exception as exc:  # a crashing candidate never takes the search down
            log.debug("candidate %s failed", plan.key, exc_info=True)
            self._reject(entry, f"{type(exc).__name__}: {_one_line(exc)}")
        entry.at_s = time.perf_counter() - self.t0
        if self.on_candidate is not None:
            self.on_candidate(self.tried, max(self.total, self.tried))
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
        entry.verified = True
        try:
            self._time(entry, compiled, baseline)
        except BackendError:
            if self.backend.measures:
                raise
            return  # a verify-only backend (reference): verified, "not timed"
        entry.verdict = Verdict.TIMED
        self._record(entry, compiled)

    def _time(self, entry: Entry, compiled: CompiledPlan, baseline: bool) -> None:
        """Time a verified candidate: :data:`MIN_SAMPLES_BEFORE_STOP` runs, then one at a time up to ``repeats``
        while more could change what is decided about it: none once its median passes the early stop (stopped
        early) or settles it (not faster beyond the noise, or the kernels it differs in, just timed, already decide
        it: ``_decided_by_kernels``), nor once the time budget is spent. A backend of given figures (the cost
        model's, or remote results) gives all it has at once: timing again would only repeat them."""
        opts = self.opts
        bound, settle = self._stop_bounds(entry, baseline)
        # the verification run just made is the first warm-up: the same kernels on the same inputs (the only one
        # where the region's runs are long)
        warmup = 0 if not baseline and self._long_runs() else max(0, opts.warmup - 1)
        timing = compiled.time(self.inputs, warmup=warmup, repeats=min(MIN_SAMPLES_BEFORE_STOP, opts.repeats))
        samples = list(timing.samples_us)
        if not samples:
            raise RuntimeError("backend returned no timing samples")
        self._note_kernels(entry, timing.kernel_min_us)
        while len(samples) < opts.repeats and time.perf_counter() <= self.t0 + opts.time_budget_s:
            median = statistics.median(samples)
            if median > bound:
                entry.stopped_early = True
                break
            if not baseline and (median > settle or self._decided_by_kernels(entry, median)):
                entry.settled = True
                break
            if not self.backend.times_live:
                break
            more = compiled.time(self.inputs, warmup=0, repeats=1)
            samples += more.samples_us
            self._note_kernels(entry, more.kernel_min_us)
        entry.samples_us = samples
        entry.meas_us = statistics.median(samples)

    def _long_runs(self) -> bool:
        """Does the unfused plan's median reach :data:`LONG_RUN_US` (its region's plans run long)?"""
        base = self.entries[0]
        return base.timed and base.time_us >= LONG_RUN_US

    def _stop_bounds(self, entry: Entry, baseline: bool) -> tuple[float, float]:
        """The running medians beyond which a candidate's timing ends: stopped early (best x ``early_stop``), and
        settled (:data:`SETTLE_BANDS` noise bands beyond the best, :data:`SETTLE_BANDS_NOT_PREFERRED` for a
        candidate the cost model does not prefer); none for the first plan."""
        best = self.best
        if baseline or best is None:
            return math.inf, math.inf
        if not self.backend.times_live:  # given figures: no noise band to settle by
            return best.time_us * self.opts.early_stop, math.inf
        preferred = entry.plan.sort_key() < best.plan.sort_key()
        bands = SETTLE_BANDS if preferred else SETTLE_BANDS_NOT_PREFERRED
        return best.time_us * self.opts.early_stop, best.time_us * (1 + bands * self.band)

    def _note_kernels(self, entry: Entry, kernel_min_us: Sequence[float] | None) -> None:
        """Keep each kernel's fastest time over the plans timed so far (by its signature)."""
        for kernel, us in zip(entry.plan.kernels, kernel_min_us or (), strict=False):
            sig = kernel_sig(kernel)
            self.kernel_min[sig] = min(us, self.kernel_min.get(sig, math.inf))

    def _decided_by_kernels(self, entry: Entry, median_us: float) -> bool:
        """Would :meth:`_record` call ``entry`` a tie with the best on the evidence of the kernels they differ in
        (all timed now), whatever its median within the noise: near twins, no win beyond the duel's margin
        predicted for a plan the cost model does not prefer, or a swap a duel already tied?"""
        best = self.best
        if best is None or not self.backend.times_live or not self._close(median_us, best.time_us):
            return False
        differ = self._differing_us(entry, best)
        return differ is not None and (_near_twins(differ, best.time_us) or _no_win_predicted(entry, differ, best)
                                       or self._swap_tied_before(entry, best)) is not None

    def _close(self, median_us: float, best_us: float) -> bool:
        """Is a median too close to the best's to be judged on it alone (within the noise band, or lower short of
        :data:`CONFIRM_BEYOND`: a quiet moment can lower one plan's median)?"""
        return abs(median_us / best_us - 1) <= self.band or best_us / CONFIRM_BEYOND < median_us < best_us

    def _bounded(self, entry: Entry) -> bool:
        """Record a candidate as slower, unrun, when the kernels it shares with plans timed before take longer
        than the best allows (the sum of their fastest times; its other kernels count as free)."""
        bound = self.kernel_bound(entry.plan)
        if bound is None:
            return False
        best = self.best
        assert best is not None and best.meas_us is not None
        entry.bound_us = bound
        entry.verdict = Verdict.BOUNDED
        self.slog.bounded(entry.plan, bound / best.meas_us, entry.est_us, bound, _origin(entry))
        return True

    def prepare(self, plans: Sequence[Plan]) -> None:
        """Build the kernels of ``plans`` in a batch, less those of plans their kernels timed so far rule out."""
        worth = [plan for plan in plans if self.kernel_bound(plan) is None]
        if worth:
            self.backend.prepare(worth)

    def kernel_bound(self, plan: Plan) -> float | None:
        """The sum of the fastest times of ``plan``'s kernels timed in earlier plans, where it already exceeds
        what the best allows (best x ``early_stop``); else None."""
        best = self.best
        if best is None or best.meas_us is None or not self.kernel_min:
            return None
        bound = sum(self.kernel_min.get(kernel_sig(k), 0.0) for k in plan.kernels)
        return bound if bound > best.meas_us * self.opts.early_stop else None

    def _predicted(self, entry: Entry) -> bool:
        """Record a candidate as not faster, unrun, when every kernel it differs from the best in was timed in
        earlier plans, their fastest runs predict it no more than :data:`DUEL_MARGIN` faster than the best, and
        the cost model does not prefer it: a duel could crown it only by showing it faster beyond the margin,
        and a tie keeps the best. A region's candidates are mostly such recombinations of kernels timed before
        (a LLaMA MLP's three GEMMs, each in two or three forms); one the cost model prefers is timed."""
        best = self.best
        if best is None or best.meas_us is None or not self.backend.times_live:
            return False
        if entry.plan.sort_key() < best.plan.sort_key():
            return False
        differ = self._differing_us(entry, best)
        if differ is None or _margin_win(differ, best.time_us):
            return False
        own, other = differ
        entry.verdict = Verdict.PREDICTED
        ratio = (best.time_us + own - other) / best.time_us
        entry.bound_us = best.time_us * ratio
        self.slog.predicted(entry.plan, ratio, own, other, _origin(entry))
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
        if not timing.samples_us or timing.median_us < self.best.time_us:
            return False
        entry.samples_us = list(timing.samples_us)
        entry.meas_us = timing.median_us
        entry.verdict = Verdict.TIMED  # timed by its given figure; not executed (entry.verified stays False)
        self._record(entry)
        return True

    def finalists(self) -> list[Entry]:
        """The best and the fully timed runners-up within :data:`FINAL_MARGIN` of it, fastest first, at most
        :data:`FINALISTS`: on a machine whose load drifts, timings minutes apart cannot tell them apart. A
        runner-up whose kernels' fastest runs predict it no more than :data:`DUEL_MARGIN` faster than the best
        is left out: the round could crown it only by a quieter moment (a layer's near-twins, 24 rounds of
        each). The plan the cost model prefers among those timed takes the last place whatever its
        search timing, when it is not the best: one slow moment in its runs (a neighbour's burst) must not
        hand its place to a plan that only ties it (a norm's one row kernel, displaced by two)."""
        best = self.best
        assert best is not None and best.meas_us is not None
        if not self.backend.times_live:  # given figures (the cost model, remote results) do not drift
            return [best]
        close = sorted((e for e in self.entries if e is not best and e.verdict == Verdict.TIMED and not e.stopped_early
                        and e.meas_us is not None and e.meas_us <= best.meas_us * FINAL_MARGIN
                        and self._may_be_faster(e, best)),
                       key=lambda e: e.time_us)[: FINALISTS - 1]
        preferred = self._preferred_timed()
        if preferred is not None and preferred is not best and preferred not in close:
            close = [*close[: FINALISTS - 2], preferred]
        return [best, *close]

    def _preferred_timed(self) -> Entry | None:
        """The timed plan the cost model prefers (the lowest :meth:`Plan.sort_key`), stopped early or not."""
        timed = [e for e in self.entries if e.verdict == Verdict.TIMED and e.meas_us is not None]
        return min(timed, key=lambda e: e.plan.sort_key(), default=None)

    def _may_be_faster(self, entry: Entry, best: Entry) -> bool:
        """Do the kernels ``entry`` differs from the best in leave it a chance to be faster beyond the margin (or
        were some of them never timed)?"""
        differ = self._differing_us(entry, best)
        return differ is None or _margin_win(differ, best.time_us)

    def final_round(self, base: Entry, finalists: list[Entry]) -> tuple[Entry, float]:
        """The winner among ``finalists`` and its speedup over the unfused ``base``, from one interleaved
        re-measurement of all of them: one run of each in turn, round by round (the leading plan rotating), so a
        machine that got busier during the search slows each alike, and no plan is timed with its own arrays
        left in the caches by its previous run (a duel's runs alternate alike). A runner-up displaces the cost
        model's choice only when its per-round ratio to it lies below 1 with the search's confidence (as in a
        duel); 1.0 when the unfused plan wins. The unfused plan runs in the first :data:`SPEEDUP_ROUNDS` rounds
        only (the speedup's ratio of medians needs no more), and the rounds end at a look (every
        :data:`SPEEDUP_ROUNDS`, as a duel's) where no runner-up can still displace that choice."""
        contenders = list({id(e): e for e in [base, *finalists]}.values())
        if len(contenders) == 1:
            return base, 1.0
        plans = [(e, self.backend.compile(e.plan)) for e in contenders]
        for _, compiled in plans:  # untimed: the inputs bound, the fresh buffers' pages faulted in
            compiled.time(self.inputs, warmup=1, repeats=1)
        # a best without runners-up only gives the speedup its numerator: fewer rounds suffice for a ratio of medians
        rounds = FINAL_ROUNDS if len(finalists) > 1 else SPEEDUP_ROUNDS
        marks = looks(SPEEDUP_ROUNDS, rounds)
        samples: dict[int, list[float]] = {id(e): [] for e in contenders}
        # past the speedup's rounds, the finalists only (the unfused plan among them where it is one)
        later = [p for p in plans if any(p[0] is e for e in finalists)]
        for r in range(rounds):
            now = plans if r < SPEEDUP_ROUNDS else later
            for e, compiled in now[r % len(now):] + now[: r % len(now)]:
                samples[id(e)].append(self._once(compiled))
            if r + 1 in marks[:-1] and self._final_settled(finalists, samples):
                break
        for e in contenders:
            e.confirm_us = float(np.median(samples[id(e)]))
        winner, evidence = self._final_winner(finalists, samples)
        if len(finalists) > 1:
            self.slog.final_round([(e.plan, e.confirmed_us) for e in finalists], winner.plan, evidence)
        return winner, base.confirmed_us / winner.confirmed_us

    def _final_settled(self, finalists: list[Entry], samples: dict[int, list[float]]) -> bool:
        """Can no runner-up displace the finalist the cost model prefers any more (a futility stop: it only ever
        keeps that choice)? Each one's ratio interval to it lies above ``1 - DUEL_MARGIN`` (not faster beyond the
        margin) or inside ``1 ± EQUIVALENCE`` (a tie), and none lies below ``1 - DUEL_MARGIN`` (a win, which the
        rounds' end confirms)."""
        _, compared = self._against_preferred(finalists, samples)
        return all(not high < 1.0 - DUEL_MARGIN and (low > 1.0 - DUEL_MARGIN
                                                     or (low > 1.0 - EQUIVALENCE and high < 1.0 + EQUIVALENCE))
                   for _, _, low, high in compared)

    def _against_preferred(self, finalists: list[Entry], samples: dict[int, list[float]]
                           ) -> tuple[Entry, list[tuple[Entry, float, float, float]]]:
        """The finalist the cost model prefers, and each other one's per-round time ratio to it (estimate, low,
        high) at the search's confidence shared over them (Bonferroni)."""
        reference = min(finalists, key=lambda e: e.plan.sort_key())
        challengers = [e for e in finalists if e is not reference]
        per_test = 1.0 - (1.0 - self.opts.confidence) / max(1, len(challengers))
        return reference, [(e, *ratio_interval(_paired_ratios(samples[id(e)], samples[id(reference)]), per_test))
                           for e in challengers]

    def _final_winner(self, finalists: list[Entry], samples: dict[int, list[float]]) -> tuple[Entry, str]:
        """The finalist the cost model prefers, unless another beats it in the paired rounds beyond the noise (the
        clearest one): a tie keeps the cost model's choice, as a duel's does. That is the search's best unless
        the plan the cost model prefers joined the round (:meth:`finalists`)."""
        reference, compared = self._against_preferred(finalists, samples)
        if not compared:
            return reference, ""
        name = "the search's best" if reference is finalists[0] else "the cost model's choice"
        winner, evidence, lowest = reference, "", math.inf
        for e, med, low, high in compared:
            if high < 1.0 - DUEL_MARGIN and med < lowest:
                winner, lowest = e, med
                evidence = f"ratio to {name} {med:.3f} [{low:.3f}, {high:.3f}] in {len(samples[id(e)])} rounds"
        if reference is finalists[0]:
            return winner, evidence or "no runner-up beats the search's best beyond the noise"
        return winner, evidence or "no finalist beats the cost model's choice beyond the noise"

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
        entry.reject(reason)
        self.slog.rejected(reason, entry.plan, _origin(entry))

    def _record(self, entry: Entry, compiled: CompiledPlan | None = None) -> None:
        meas = entry.time_us
        best = self.best
        if best is None:
            self._crown(entry, compiled)
            self.slog.start(entry.plan, entry.est_us, meas, _origin(entry))
            if self.backend.times_live:
                spread = noise(entry.samples_us)
                self.band = max(MIN_BAND, 2 * spread)
                self.slog.noise_floor(spread, len(entry.samples_us), self.band)
            return
        stopped = len(entry.samples_us) if entry.stopped_early else None
        close = not entry.stopped_early and self._close(meas, best.time_us)
        if not close or compiled is None or self.best_compiled is None or not self.backend.times_live:
            if meas < best.time_us and not entry.stopped_early:  # given figures, or far beyond the noise
                self._crown(entry, compiled)
                self.slog.faster(entry.plan, entry.est_us, meas, best.time_us / meas, _origin(entry))
            else:
                self.slog.slower(entry.plan, meas / best.time_us, entry.est_us, meas, stopped, _origin(entry),
                                 _settled(entry).removeprefix(", "))
            return
        if meas >= best.time_us and entry.plan.sort_key() >= best.plan.sort_key():
            # no duel could crown it: a tie keeps the best (the cost model's choice), and a median that is
            # not lower gives no sign of a win worth the rounds (the final round re-measures close runners-up)
            self.slog.tie(entry.plan, f"median x{meas / best.time_us:.3f} within the noise, not lower{_settled(entry)}",
                          best.plan, _origin(entry))
            return
        differ = self._differing_us(entry, best)
        evidence = None if differ is None else (_near_twins(differ, best.time_us)
                                                or _no_win_predicted(entry, differ, best)
                                                or self._swap_tied_before(entry, best))
        if evidence is not None:
            if entry.plan.sort_key() < best.plan.sort_key():
                self._crown(entry, compiled, faster=False)
            entry.duel = f"tie: {evidence}, not timed in rounds"
            self.slog.tie(entry.plan, evidence + _settled(entry), self.best.plan if self.best else best.plan, _origin(entry))
            return
        self._duel(entry, compiled, best)

    def _differing_us(self, entry: Entry, best: Entry) -> tuple[float, float] | None:
        """The fastest times, summed, of the kernels ``entry`` has and the best lacks, and of those the best has
        and ``entry`` lacks; None while one of them was never timed."""
        return self._summed(*_difference(entry.plan, best.plan))

    def _summed(self, own: Counter[str], other: Counter[str]) -> tuple[float, float] | None:
        if any(sig not in self.kernel_min for sig in (*own, *other)):
            return None
        return (sum(self.kernel_min[sig] * n for sig, n in own.items()),
                sum(self.kernel_min[sig] * n for sig, n in other.items()))

    def _swap_tied_before(self, entry: Entry, best: Entry) -> str | None:
        """Why no duel is needed, or None: ``entry`` differs from the best by a swap of kernels that a duel against
        this best already called a tie, and by kernels that, at their fastest, take within the margin either way
        (near twins). Its rounds would time that swap again: a region's candidates often share one such choice (a
        gated MLP's two forms 1% apart, each with a different split of a small elementwise group), and a layer's
        search once ran twelve duels of 8-24 rounds on it, 4 s of a 9 s search."""
        own, other = _difference(entry.plan, best.plan)
        for key, tied_own, tied_other, said in self.tied_swaps:
            if key != best.plan.key or not (_holds(own, tied_own) and _holds(other, tied_other)):
                continue
            rest = self._summed(own - tied_own, other - tied_other)
            if rest is not None and _near_twins(rest, best.time_us) is not None:
                return (f"it swaps the kernels a duel with the best called a tie ({said}); the rest take "
                        f"{rest[0]:,.0f} and {rest[1]:,.0f} µs: within the {DUEL_MARGIN:.0%} margin")
        return None

    def _duel(self, entry: Entry, compiled: CompiledPlan, best: Entry) -> None:
        """A candidate within the noise of the best: paired, interleaved rounds decide; a tie keeps the plan the
        cost model prefers (fewer bytes, then launches)."""
        incumbent = self.best_compiled
        assert incumbent is not None
        d = duel(lambda: self._once(compiled), lambda: self._once(incumbent), max_rounds=self.opts.max_rounds,
                 confidence=self.opts.confidence, margin=DUEL_MARGIN, equivalence=EQUIVALENCE)
        entry.duel = f"{d.outcome}: {d.describe()} against {best.plan.key}"
        evidence = d.describe()
        if d.outcome == Outcome.FASTER:
            self._crown(entry, compiled)
            self.slog.faster(entry.plan, entry.est_us, entry.time_us, 1 / d.ratio, _origin(entry), evidence)
        elif d.outcome == Outcome.SLOWER:
            self.slog.slower(entry.plan, d.ratio, entry.est_us, entry.time_us, None, _origin(entry), evidence)
        else:
            self.tied_swaps.append((best.plan.key, *_difference(entry.plan, best.plan), d.describe()))
            if entry.plan.sort_key() < best.plan.sort_key():
                self._crown(entry, compiled, faster=False)
            self.slog.tie(entry.plan, evidence, self.best.plan if self.best else best.plan, _origin(entry))

    def _crown(self, entry: Entry, compiled: CompiledPlan | None, faster: bool = True) -> None:
        """``entry`` is the best now: faster than the last, or a tie the cost model prefers (not ``faster``)."""
        self.best, self.best_compiled = entry, compiled
        if faster:
            self.crowned_at = self.tried

    def _once(self, compiled: CompiledPlan) -> float:
        """One timed run of a compiled plan (µs)."""
        return compiled.time(self.inputs, warmup=0, repeats=1).samples_us[0]

    # -- the genetic phase
    def evolve(self, rng: random.Random) -> None:
        """Generations of :data:`GENERATION` new plans, bred from the elite of what was timed so far; each
        generation's kernels are prepared (compiled) together, less those of plans whose kernels timed so far
        rule them out, then its plans are considered in turn."""
        mutator = Mutator(self.cands.extractor)
        stall = 0
        while self.budget_left():
            if stall >= STALL_LIMIT:
                self.stop = Stop(StopKind.STALLED, str(STALL_LIMIT))
                return
            if self.out_of_patience():
                return
            room = min(GENERATION, self.opts.max_candidates - self.tried)
            generation, stall = self._breed(mutator, rng, room, stall)
            self.prepare([plan for plan, _, _ in generation])
            for plan, choice, source in generation:
                if not self.budget_left() or self.out_of_patience():
                    return
                self.consider(plan, choice, source)

    def out_of_patience(self) -> bool:
        """Has the genetic phase gone ``patience`` candidates without a new best (the stop recorded)?"""
        patience = self.opts.patience
        if patience and self.tried - self.crowned_at >= patience:
            self.stop = self.stop or Stop(StopKind.PATIENCE, str(patience))
            return True
        return False

    def _breed(self, mutator: Mutator, rng: random.Random, room: int,
               stall: int) -> tuple[list[tuple[Plan, dict[str, Option], str]], int]:
        """Up to ``room`` plans not seen before (samples, or mutants of a tournament winner), and the count of
        consecutive tries that gave nothing new."""
        ex = self.cands.extractor
        elite = sorted(
            (e for e in self.entries if e.timed and not e.stopped_early and e.choice is not None),
            key=lambda e: e.time_us,
        )[:ELITE]
        out: list[tuple[Plan, dict[str, Option], str]] = []
        keys = set(self.seen)
        while len(out) < room and stall < STALL_LIMIT:
            if not elite or rng.random() < 0.25:
                (choice,) = ex.sample(1, rng.randrange(2**31)) or [ex.unfused()]
                source = "sample"
            else:
                a, b = rng.choice(elite), rng.choice(elite)
                parent = a if a.time_us <= b.time_us else b
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
    share: float = 1.0,
) -> SearchResult:
    """Verify and time candidates on ``backend``; see the module docstring.

    ``share``: the graph's share of a whole model's estimated time (a region's, its instances counted), which
    makes a small region's search brief.

    ``on_candidate(done, total)`` is called before the first candidate and after each one (progress bars);
    ``total`` is what the search expects to try (it stops earlier on a budget or a stall).
    Raises :class:`SearchError` if no candidate, the baseline included, passes verification.
    """
    opts = options or SearchOptions()
    opts.validate()
    need_evaluator(cands.graph)
    slog = log if log is not None else SearchLog()
    drawn = inputs is None
    expected = None
    if inputs is None:
        inputs, expected = recipe_inputs(cands.graph, opts.seed)
    slog.header(cands.graph.name, cands.space, cands.complete, backend.name, cands.spec.name, backend.measures)
    if isinstance(inputs, NonnegativeRecipe):
        slog.emit(f"{cands.graph.name}: inputs: the recipe's absolute values (its reference is NaN or infinite on "
                  "the recipe itself)")
    run = _Run(cands, backend, inputs, opts, slog, on_candidate, expected)
    ex = cands.extractor
    unfused_choice = ex.unfused()
    unfused = ex.plan_of(unfused_choice)
    if on_candidate is not None:
        on_candidate(0, run.total)
    listed = cands.plans[: opts.max_candidates]
    first = BRIEF_CANDIDATES if share < SMALL_SHARE else FIRST_BUILD
    backend.prepare([unfused, *listed[:first]])  # the CPU's kernels: a few batched builds
    later = {p.key for p in listed[first:]}
    run.consider(unfused, unfused_choice, "unfused baseline", baseline=True)
    run.weigh(share)
    try:
        for plan in cands.plans:
            if plan.key in run.seen:
                continue
            # the cost model's favourite is always compared with the baseline, however short the budget
            # (a long graph's segments share one budget: the last may find it spent)
            if run.tried and not run.budget_left():
                break
            if plan.key in later:  # the rest in one more build, less the candidates their kernels timed rule out
                run.prepare([p for p in listed if p.key in later and p.key not in run.seen])
                later.clear()
            run.consider(plan, cands.choices.get(plan.key), "model order")
        else:
            if cands.complete:
                run.stop = run.stop or Stop(StopKind.EXHAUSTED)
            else:
                run.evolve(random.Random(opts.seed))
    except KeyboardInterrupt:  # Ctrl-C: the best plan so far is still a verified plan
        if run.best is None:
            raise
        run.stop = Stop(StopKind.INTERRUPTED)
        logging.getLogger(__name__).warning("search interrupted: keeping the best plan found so far")
    for plan in cands.plans:  # the rest of the cost-model list, for the record
        if plan.key not in run.seen:
            run.entries.append(Entry(plan, "model order", choice=cands.choices.get(plan.key)))
    elapsed = time.perf_counter() - run.t0
    if run.best is None:
        verified = [e for e in run.entries if e.verified and not e.rejected]
        if not verified:
            reasons = "; ".join(sorted({e.verdict_text for e in run.entries if e.rejected}))
            raise SearchError(f"every candidate was rejected ({reasons})")
        # a verify-only backend: the model's favourite among the verified candidates
        run.best = min(verified, key=lambda e: e.plan.sort_key())
    base = run.entries[0]
    speedup = None
    stop = run.stop or Stop(StopKind.DONE)
    if base.timed and run.best.timed and stop.kind != StopKind.INTERRUPTED:
        run.best, speedup = run.final_round(base, run.finalists())
    run.best.verdict = Verdict.BEST
    timed = [e for e in run.entries if e.timed]
    rho = spearman([e.est_us for e in timed], [e.time_us for e in timed])
    n_rejected = sum(e.rejected for e in run.entries)
    n_bounded = sum(e.verdict == Verdict.BOUNDED for e in run.entries)
    n_predicted = sum(e.verdict == Verdict.PREDICTED for e in run.entries)
    slog.footer(elapsed, run.best.plan, speedup, len(timed), n_rejected, rho, str(stop), n_bounded, n_predicted)
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
        stop=stop,
        options=opts,
        verification=verification_text(unfused, opts.rtol, opts.atol,
                                       _inputs_text(inputs, opts.seed) if drawn else "the given inputs"),
    )


def _settled(entry: Entry) -> str:
    """The SEARCH_LOG's note of a settled candidate's runs (``, settled after n runs``), or nothing."""
    return f", settled after {len(entry.samples_us)} runs" if entry.settled else ""


def _origin(entry: Entry) -> str:
    """Log suffix for candidates that did not come from the cost-model list."""
    return entry.source if entry.source.startswith(("mutant", "sample")) else ""


#: the least relative difference from the best that still sends a candidate to interleaved rounds with it
MIN_BAND = 0.02
#: a candidate whose median is lower than the best's is crowned on it alone only when this many times lower;
#: closer, interleaved rounds with the best decide (a neighbour's quiet moment can lower one plan's median)
CONFIRM_BEYOND = 1.5
#: runners-up within this factor of the best's search timing are re-measured with it before one is chosen
FINAL_MARGIN = 1.15
#: at most this many plans (the best included) in that final round
FINALISTS = 3
#: the final round's interleaved rounds, one timed run of each plan in each (a duel's longest is as long); and
#: the rounds that only time the best and the unfused plan, for the speedup
FINAL_ROUNDS = 24
SPEEDUP_ROUNDS = 8
#: a duel (and the final round) calls a plan faster only when its time ratio's interval lies below 1 - this
DUEL_MARGIN = 0.01
#: were a region below this share of its model free, the model would not be faster by the margin a duel asks
SMALL_SHARE = DUEL_MARGIN
#: a duel whose interval lies within 1 ± this ends as a tie before its rounds run out (planner.search.duel)
EQUIVALENCE = 0.03


def _paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """Per-round ratios of two plans' timings in the same rounds."""
    return [x / y for x, y in zip(a, b, strict=True)]


def _margin_win(differ: tuple[float, float], best_us: float) -> bool:
    """Do the fastest times of the kernels a plan differs from the best in (its own, the best's:
    ``_Run._differing_us``) predict it faster than the best beyond :data:`DUEL_MARGIN`?"""
    own, other = differ
    return other - own > DUEL_MARGIN * best_us


def _difference(plan: Plan, best: Plan) -> tuple[Counter[str], Counter[str]]:
    """The kernels (signatures, counted) ``plan`` has and ``best`` lacks, and those ``best`` has and it lacks."""
    mine = Counter(kernel_sig(k) for k in plan.kernels)
    theirs = Counter(kernel_sig(k) for k in best.kernels)
    return mine - theirs, theirs - mine


def _holds(kernels: Counter[str], part: Counter[str]) -> bool:
    return all(kernels[sig] >= n for sig, n in part.items())


def _near_twins(differ: tuple[float, float], best_us: float) -> str | None:
    """Why no duel could call a plan faster or slower than the best, or None: the kernels one plan has and the other
    lacks take, at their fastest, at most :data:`DUEL_MARGIN` of the best's time on each side, so neither plan can
    beat the other beyond the margin a duel asks for. Its rounds would time mostly the kernels both share (a layer's
    GEMMs), 24 rounds of whole plans to call a tie (0.6 s each in a BERT layer's search); a tie keeps the cost
    model's choice, as the duel's would."""
    own, other = differ
    if max(own, other) > DUEL_MARGIN * best_us:
        return None
    return (f"the kernels they differ in take {own:,.0f} and {other:,.0f} µs of its {best_us:,.0f}: "
            f"within the {DUEL_MARGIN:.0%} margin either way")


def _no_win_predicted(entry: Entry, differ: tuple[float, float], best: Entry) -> str | None:
    """Why no duel could crown ``entry``, or None: the cost model does not prefer it (a tie keeps the best) and the
    fastest runs of the kernels they differ in, its own just timed, predict it no more than :data:`DUEL_MARGIN`
    faster: a lower median than that is a quieter moment."""
    if entry.plan.sort_key() < best.plan.sort_key() or _margin_win(differ, best.time_us):
        return None
    own, other = differ
    return (f"its kernels predict x{(best.time_us + own - other) / best.time_us:.3f} of its time ({own:,.0f} "
            f"against {other:,.0f} µs): no win beyond the {DUEL_MARGIN:.0%} margin")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else "(no message)"


def _inputs_text(inputs: Mapping[str, np.ndarray], seed: int) -> str:
    if isinstance(inputs, NonnegativeRecipe):
        return f"the absolute values of seeded inputs (seed {seed})"
    return f"seeded inputs (seed {seed})"
