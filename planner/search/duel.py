"""Deciding between two plans on a noisy machine: paired, interleaved timings of the challenger and the incumbent,
until a confidence interval of their time ratio lies below or above 1, or a budget of rounds runs out (a tie).

Each round times both plans once, in alternating order, so that a machine that gets busier slows both alike;
the log of each round's time ratio is one sample. Two runs of one plan differ by noise of one shape, so a
round's log ratio is symmetric about the true one; the interval is the Hodges-Lehmann one of the Wilcoxon
signed-rank test (the Walsh averages an exact signed-rank table leaves inside). No Gaussian assumption, robust
to the odd spike (another process took the core), no resampling: the same samples give the same answer.

The rounds are looked at a few times only (every ``min_rounds``), each look at the confidence divided among the
looks (Bonferroni), so that stopping at the first look that separates the plans does not inflate the chance of
calling a tie a win.  A look whose interval lies inside ``1 ± equivalence`` ends the duel as a tie at once (the
plans are shown to be that close, as in a two one-sided test): more rounds could only tell apart plans no one
would choose between, and on a quiet machine most candidates of a region are such near-twins.  A look whose
interval, narrowed to the width the remaining rounds could at best give it (``1/sqrt(rounds)``), would still reach
beyond ``1 ± margin`` on both sides ends the duel as a tie too: no other outcome is within reach of the rounds left
(futility), and a duel of plans 1-2% apart on 5% noise ran all 24 rounds for nothing (0.7 s of a padded BERT's 14 s
cold plan, each).  Simulated (tests/planner/search/test_duel.py): 11 rounds instead of 23 for such plans; a true
5% win on 5% noise found in half the duels (0.63 with every round run), on 2% noise in all.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum


class Outcome(StrEnum):
    FASTER = "faster"  # the challenger beats the incumbent beyond the noise
    SLOWER = "slower"  # the incumbent beats the challenger beyond the noise
    TIE = "tie"  # the interval lies within ``1 ± equivalence``, or the rounds ran out with it around 1


@dataclass(frozen=True)
class Duel:
    outcome: Outcome
    ratio: float  # the typical challenger / incumbent time ratio over the rounds (Hodges-Lehmann)
    low: float  # the confidence interval of that median
    high: float
    rounds: int

    def describe(self) -> str:
        return f"ratio {self.ratio:.3f} [{self.low:.3f}, {self.high:.3f}] in {self.rounds} rounds"


@functools.cache
def _signed_rank_cdf(n: int) -> tuple[float, ...]:
    """P(T <= t) for t = 0..n(n+1)/2, T the signed-rank statistic of n samples symmetric about 0."""
    counts = [1] + [0] * (n * (n + 1) // 2)
    for rank in range(1, n + 1):  # each rank joins the positive sum or not
        for t in range(len(counts) - 1, rank - 1, -1):
            counts[t] += counts[t - rank]
    cdf: list[float] = []
    total = 0
    for c in counts:
        total += c
        cdf.append(total / 2**n)
    return tuple(cdf)


def ratio_interval(ratios: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(estimate, low, high) of the typical ratio of paired timings: the Hodges-Lehmann estimate and interval
    of the log ratios, back in ratios; (-inf, inf) as the interval when there are too few samples for that
    confidence."""
    if not ratios:
        raise ValueError("no samples")
    if any(not (r > 0 and math.isfinite(r)) for r in ratios):
        raise ValueError(f"ratios must be positive and finite, got {sorted(ratios)[:3]}...")
    logs = [math.log(r) for r in ratios]
    n = len(logs)
    walsh = sorted((logs[i] + logs[j]) / 2 for i in range(n) for j in range(i, n))
    estimate = math.exp(statistics.median(walsh))
    cdf = _signed_rank_cdf(n)
    alpha = 1.0 - confidence
    c = -1  # Walsh averages left out on each side: the largest c with P(T <= c) <= alpha / 2
    while c + 1 < len(cdf) and cdf[c + 1] <= alpha / 2:
        c += 1
    if c < 0:
        return estimate, -math.inf, math.inf
    return estimate, math.exp(walsh[c]), math.exp(walsh[len(walsh) - 1 - c])


def looks(min_rounds: int, max_rounds: int) -> list[int]:
    """The round counts after which a duel looks at its samples: every ``min_rounds``, and at ``max_rounds``."""
    marks = list(range(min_rounds, max_rounds + 1, min_rounds))
    return marks if marks[-1] == max_rounds else [*marks, max_rounds]


def duel(challenger: Callable[[], float], incumbent: Callable[[], float], *, min_rounds: int = 8,
         max_rounds: int = 24, confidence: float = 0.95, margin: float = 0.01, equivalence: float = 0.0) -> Duel:
    """Time both in interleaved rounds until the ratio's interval lies below ``1 - margin`` (faster), above
    ``1 + margin`` (slower), inside ``1 ± equivalence`` (a tie; 0: never), or ``max_rounds`` have run or could no
    longer separate them (a tie)."""
    marks = looks(min_rounds, max_rounds)
    per_look = 1.0 - (1.0 - confidence) / len(marks)
    ratios: list[float] = []
    med = low = high = 1.0
    for r in range(max_rounds):
        if r % 2:
            b = incumbent()
            a = challenger()
        else:
            a = challenger()
            b = incumbent()
        ratios.append(a / b)
        if len(ratios) not in marks:
            continue
        med, low, high = ratio_interval(ratios, per_look)
        if high < 1.0 - margin:
            return Duel(Outcome.FASTER, med, low, high, len(ratios))
        if low > 1.0 + margin:
            return Duel(Outcome.SLOWER, med, low, high, len(ratios))
        if 1.0 - equivalence < low and high < 1.0 + equivalence:
            break
        if len(ratios) < max_rounds and _out_of_reach(med, low, high, len(ratios) / max_rounds, margin):
            break
    return Duel(Outcome.TIE, med, low, high, len(ratios))


def _out_of_reach(med: float, low: float, high: float, done: float, margin: float) -> bool:
    """Would the interval, narrowed as ``sqrt(done)`` (the share of the rounds run) about its estimate, still reach
    past ``1 - margin`` below and ``1 + margin`` above (so that neither plan could be called faster)?"""
    if not (math.isfinite(low) and math.isfinite(high)):
        return False
    shrink = math.sqrt(done)
    return med * (high / med) ** shrink >= 1.0 + margin and med * (low / med) ** shrink <= 1.0 - margin


def noise(samples: Sequence[float]) -> float:
    """A timing's relative spread: the interquartile range over the median (0 with fewer than 4 samples)."""
    if len(samples) < 4:
        return 0.0
    q = statistics.quantiles(samples, n=4)
    return (q[2] - q[0]) / statistics.median(samples)


__all__ = ["Duel", "Outcome", "duel", "looks", "ratio_interval", "noise"]
