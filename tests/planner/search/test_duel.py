"""The paired, interleaved comparison the search trusts on a noisy machine (planner.search.duel)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from scipy import stats

from planner.search.duel import Outcome, duel, looks, noise, ratio_interval


@pytest.mark.parametrize(("n", "critical"), [(8, 3), (10, 8), (20, 52), (24, 81)])
def test_the_interval_leaves_out_the_walsh_averages_of_the_signed_rank_table(n, critical):
    """Critical values of the two-sided 5% Wilcoxon signed-rank test (the published table); the interval is the
    (critical+1)-th smallest and largest Walsh average."""
    rng = random.Random(n)
    ratios = [rng.lognormvariate(0.0, 0.2) for _ in range(n)]
    logs = [math.log(r) for r in ratios]
    walsh = sorted((logs[i] + logs[j]) / 2 for i in range(n) for j in range(i, n))
    estimate, low, high = ratio_interval(ratios, 0.95)
    assert low == pytest.approx(math.exp(walsh[critical])) and high == pytest.approx(math.exp(walsh[-1 - critical]))
    assert estimate == pytest.approx(math.exp(float(np.median(walsh))))


def test_the_interval_agrees_with_scipys_signed_rank_test():
    """1 lies outside the interval exactly when scipy's exact two-sided test rejects a ratio of 1 at 5%."""
    rng = random.Random(7)
    for _ in range(200):
        ratios = [rng.lognormvariate(rng.choice([0.0, 0.05, -0.1]), 0.1) for _ in range(12)]
        _, low, high = ratio_interval(ratios, 0.95)
        p = stats.wilcoxon([math.log(r) for r in ratios], method="exact").pvalue
        assert (not low <= 1.0 <= high) == (p <= 0.05)


def test_too_few_samples_for_the_confidence_give_an_unbounded_interval():
    assert ratio_interval([1.1, 1.2, 1.3, 1.4, 1.5], 0.95)[1:] == (-math.inf, math.inf)
    with pytest.raises(ValueError, match="no samples"):
        ratio_interval([], 0.95)
    with pytest.raises(ValueError, match="positive and finite"):
        ratio_interval([1.0, 0.0], 0.95)


def test_the_interval_covers_the_true_ratio_as_often_as_promised():
    rng = random.Random(3)
    misses = 0
    for _ in range(1000):
        ratios = [rng.lognormvariate(0.0, 0.1) / rng.lognormvariate(0.0, 0.1) for _ in range(16)]
        _, low, high = ratio_interval(ratios, 0.9)
        misses += not low <= 1.0 <= high
    assert misses / 1000 <= 0.1 + 0.02


def _timer(rng: random.Random, truth: float, sigma: float):
    return lambda: truth * rng.lognormvariate(0.0, sigma)


@pytest.mark.parametrize(("challenger", "outcome"), [(0.9, Outcome.FASTER), (1.1, Outcome.SLOWER)])
def test_a_real_difference_of_ten_percent_is_found_under_five_percent_noise(challenger, outcome):
    rng = random.Random(0)
    found = [duel(_timer(rng, challenger, 0.05), _timer(rng, 1.0, 0.05)).outcome for _ in range(200)]
    wrong = Outcome.SLOWER if outcome == Outcome.FASTER else Outcome.FASTER
    assert found.count(outcome) >= 190 and not found.count(wrong)


@pytest.mark.parametrize("sigma", [0.02, 0.2])
def test_equal_plans_are_called_a_tie_at_least_at_the_confidence_despite_early_looks(sigma):
    rng = random.Random(1)
    outcomes = [duel(_timer(rng, 1.0, sigma), _timer(rng, 1.0, sigma), confidence=0.9, margin=0.0).outcome
                for _ in range(1000)]
    assert outcomes.count(Outcome.TIE) / 1000 >= 0.9


def test_rounds_alternate_which_plan_runs_first_and_stop_at_a_look():
    order: list[str] = []

    def run(name: str, us: float):
        def once() -> float:
            order.append(name)
            return us
        return once

    d = duel(run("a", 1.0), run("b", 2.0), min_rounds=8, max_rounds=24)
    assert d.outcome == Outcome.FASTER and d.rounds == 8 and d.ratio == 0.5
    assert order[:4] == ["a", "b", "b", "a"]
    assert looks(8, 24) == [8, 16, 24] and looks(8, 20) == [8, 16, 20]


def test_noise_is_the_interquartile_range_over_the_median():
    assert noise([10.0, 10.0, 10.0]) == 0.0
    assert noise([8.0, 9.0, 10.0, 11.0, 12.0]) == pytest.approx((11.5 - 8.5) / 10.0)


def test_plans_shown_within_the_equivalence_end_as_a_tie_at_the_first_look():
    """Near-twins under little noise: the interval lies inside 1 ± 3% at 8 rounds, so the duel ends there as a
    tie; without the equivalence bound the same rounds run to the budget; a real 10% gap is still found."""
    rng = random.Random(2)
    twins = [duel(_timer(rng, 1.005, 0.005), _timer(rng, 1.0, 0.005), equivalence=0.03) for _ in range(50)]
    assert all(d.outcome == Outcome.TIE and d.rounds == 8 and d.low > 0.97 and d.high < 1.03 for d in twins)
    rng = random.Random(2)
    long = duel(_timer(rng, 1.005, 0.005), _timer(rng, 1.0, 0.005))
    assert long.outcome == Outcome.TIE and long.rounds == 24
    rng = random.Random(3)
    found = [duel(_timer(rng, 1.1, 0.05), _timer(rng, 1.0, 0.05), equivalence=0.03).outcome for _ in range(100)]
    assert found.count(Outcome.SLOWER) >= 95
    rng = random.Random(4)  # noisy twins: the interval is too wide to show equivalence early
    noisy = [duel(_timer(rng, 1.0, 0.2), _timer(rng, 1.0, 0.2), equivalence=0.03) for _ in range(20)]
    assert all(d.low < 0.97 or d.high > 1.03 for d in noisy if d.outcome == Outcome.TIE)


def test_a_duel_no_more_rounds_could_decide_ends_as_a_tie_and_real_wins_are_still_found():
    """Futility: plans 1.5% apart on 5% noise, whose interval the rounds left could not narrow past 1 ± 1%, end
    as a tie at an early look (they ran all 24 rounds before); a 5% gap on 2% noise is still found every time, and
    one on 5% noise about as often as with every round run (0.63 in this simulation)."""
    rng = random.Random(5)
    close = [duel(_timer(rng, 0.985, 0.05), _timer(rng, 1.0, 0.05)) for _ in range(200)]
    assert sum(d.outcome == Outcome.TIE for d in close) >= 190
    assert sum(d.rounds for d in close) / len(close) < 14
    assert all(d.high >= 1.01 and d.low <= 0.99 for d in close if d.rounds == 8 and d.outcome == Outcome.TIE)
    rng = random.Random(6)
    assert all(duel(_timer(rng, 0.95, 0.02), _timer(rng, 1.0, 0.02)).outcome == Outcome.FASTER for _ in range(100))
    rng = random.Random(7)
    found = [duel(_timer(rng, 0.95, 0.05), _timer(rng, 1.0, 0.05)).outcome for _ in range(300)]
    assert found.count(Outcome.FASTER) >= 0.45 * 300 and not found.count(Outcome.SLOWER)
