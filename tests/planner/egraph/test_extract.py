"""The extractor: exhaustive, k-best, sampled and DP plans, all valid, ordered and within the limits."""

import numpy as np
import pytest

from planner.core.cost import load_device
from planner.core.examples import ew_chain, mlp_epilogue, mlp_stack
from planner.core.graph import GraphBuilder
from planner.core.ops import OPS
from planner.core.reference import execute_graph, execute_plan, random_inputs
from planner.egraph.candidates import build_candidates
from planner.egraph.program import Limits


def _fanout_graph():
    """x -> relu -> (affine, silu) -> add: relu is read by two consumers."""
    b = GraphBuilder("fanout")
    b.input("x", (64,), "fp32")
    b.op("r", "Relu", ["x"])
    b.op("a", "Affine", ["r"], {"a": 2.0, "b": 1.0})
    b.op("s", "Silu", ["r"])
    b.op("o", "Add", ["a", "s"])
    return b.build(["o"])


def test_shared_store_written_once_and_register_value_recomputed():
    g = _fanout_graph()
    cands = build_candidates(g, load_device("seed-k4"))
    x = random_inputs(g, 3)
    ref = execute_graph(g, x)[0]
    for p in cands.plans:
        np.testing.assert_allclose(execute_plan(p, x)[0], ref, rtol=1e-5, atol=1e-6)
        outs = [k.out for k in p.kernels]
        assert len(outs) == len(set(outs)), "a stored tensor is written once"
    # the plan where both consumers recompute relu in their own kernels costs relu twice
    recompute = [
        p for p in cands.plans if sum("Relu" in k.ops for k in p.kernels) == 2 and all(k.out != "r" for k in p.kernels)
    ]
    assert recompute
    relu_flops = OPS["Relu"].flops((64,), [(64,)], {})
    p = recompute[0]
    assert p.flops == pytest.approx(2 * relu_flops + sum(OPS[o].flops((64,), [(64,)], {"a": 2, "b": 1}) for o in ("Affine", "Silu", "Add")))


def test_limits_hit_still_gives_a_valid_plan(caplog):
    g = ew_chain(6, 256)
    cands = build_candidates(g, load_device("seed-k4"), limits=Limits(max_iterations=1))
    assert cands.limit_hit and "iteration limit" in cands.limit_hit
    assert any("iteration limit" in n for n in cands.notes)
    x = random_inputs(g, 0)
    np.testing.assert_allclose(execute_plan(cands.best, x)[0], execute_graph(g, x)[0], rtol=1e-5)
    node_limited = build_candidates(g, load_device("seed-k4"), limits=Limits(max_nodes=5))
    assert node_limited.limit_hit and "node limit" in node_limited.limit_hit


def test_region_bound_limits_kernel_size():
    cands = build_candidates(ew_chain(8, 64), load_device("seed-k4"), limits=Limits(max_region_ops=3))
    assert max(max(p.partition) for p in cands.plans) == 3


def test_a_torch_sized_chain_fits_one_kernel_by_default():
    """``a*x + b`` stages imported from torch are two ops each: an 8-stage chain is 20 ops, which the
    default kernel-size bound must still allow as one kernel (it was 16, so the best plan had two)."""
    cands = build_candidates(ew_chain(14, 64), load_device("seed-k4"))
    assert [21] in [list(p.partition) for p in cands.plans]
    assert len(cands.best.kernels) == 1


def test_sampling_is_seeded_distinct_and_valid():
    g = mlp_stack(6, 16, 4, "fp32")
    cands = build_candidates(g, load_device("h200"), cap=50, k=10)
    assert not cands.complete and len(cands.plans) >= 10
    ex = cands.extractor
    a = [ex.key(c) for c in ex.sample(12, seed=7)]
    b = [ex.key(c) for c in ex.sample(12, seed=7)]
    c = [ex.key(c) for c in ex.sample(12, seed=8)]
    assert a == b and a != c and len(set(a)) == len(a) == 12
    x = random_inputs(g, 1)
    ref = execute_graph(g, x)[0]
    for choice in ex.sample(5, seed=1):
        np.testing.assert_allclose(execute_plan(ex.plan_of(choice), x)[0], ref, rtol=1e-4, atol=1e-4)
    # k-best plans are distinct and sorted
    keys = [p.key for p in cands.plans]
    assert len(keys) == len(set(keys))
    assert [p.sort_key() for p in cands.plans[:-1]] == sorted(p.sort_key() for p in cands.plans[:-1])


def test_dp_best_matches_exhaustive_on_small_space():
    g = mlp_stack(2, 16, 4, "fp16")
    full = build_candidates(g, load_device("h200"), cap=100_000)
    assert full.complete
    ex = full.extractor
    assert ex.cost(ex.dp_best()) == pytest.approx(full.best.est_us)


def test_ties_break_on_launches_then_registers():
    cands = build_candidates(mlp_epilogue(16, 4096, 4096), load_device("seed-k4"))
    tied = [p for p in cands.plans if p.launches == 2]
    regs = [p.reg_peak for p in tied if round(p.est_us, 6) == round(tied[0].est_us, 6)]
    assert regs == sorted(regs)


def test_a_chain_enumerates_every_partition_exactly_once():
    """An elementwise chain of n ops has 2^(n-1) plans: one per choice of where to store."""
    g = ew_chain(4, 256)
    n = len(g.ops)
    cands = build_candidates(g, load_device("seed-k4"), cap=100_000)
    assert cands.complete and g.is_chain()
    partitions = [p.partition for p in cands.plans]
    assert len(partitions) == len(set(partitions)) == 2 ** (n - 1)
    assert all(sum(part) == n for part in partitions)
    assert (n,) in partitions and tuple([1] * n) in partitions  # the fused and the unfused plan


def test_the_dp_plan_computes_the_graph():
    g = mlp_stack(3, 16, 4, "fp32")
    cands = build_candidates(g, load_device("h200"), cap=20, k=5)
    ex = cands.extractor
    x = random_inputs(g, 2)
    np.testing.assert_allclose(execute_plan(ex.plan_of(ex.dp_best()), x)[0], execute_graph(g, x)[0],
                               rtol=1e-4, atol=1e-4)
    assert cands.best.est_us <= ex.cost(ex.dp_best()) + 1e-9  # the local search never ends worse than the DP seed


def _compositions(n: int, largest: int) -> int:
    """Ways to cut a chain of n ops into kernels of at most ``largest`` ops."""
    ways = [1] + [0] * n
    for i in range(1, n + 1):
        ways[i] = sum(ways[i - j] for j in range(1, min(i, largest) + 1))
    return ways[n]


def test_plan_counts_are_exact_up_to_10_34_and_rounded_past_it():
    """A chain's space is its compositions: exact while below 10^34, then to 34 significant digits
    (counts of millions of digits are never made into integers)."""
    small_graph, big_graph = ew_chain(50, 64, "fp32"), ew_chain(80, 64, "fp32")
    small = build_candidates(small_graph, load_device("h200"), limits=Limits(max_region_ops=64))
    assert small.space == _compositions(len(small_graph.ops), 64) and isinstance(small.space, int)
    big = build_candidates(big_graph, load_device("h200"), limits=Limits(max_region_ops=64))
    exact = _compositions(len(big_graph.ops), 64)
    assert exact > 10**34 and not isinstance(big.space, int)
    assert abs(big.space - exact) <= exact // 10**32
    assert len(big.plans) > 1 and big.plans[0].est_us <= big.unfused.est_us


def test_counts_of_any_size_print_and_serialise():
    from decimal import Decimal

    from planner.core.report import count_json, count_text, log10_count

    assert count_text(12_345) == "12,345" and count_json(12_345) == 12_345
    huge = Decimal("2.5E+999999999")  # past Python's 4,300-digit int printing and the default Decimal context
    assert count_text(huge) == count_json(huge) == "~2.5e999999999"
    assert abs(log10_count(huge) - 999999999.39794) < 1e-4
    assert count_text(10**5000).startswith("~1.0e5000") and abs(log10_count(10**5000) - 5000) < 1e-9
