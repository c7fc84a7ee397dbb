"""Regions: cuts at forced stores, and the segment limit's cuts on long graphs."""

from _graphs import long_chain

from planner.core.graph import GraphBuilder
from planner.core.regions import boundaries, split_regions


def test_a_long_chain_is_cut_into_segments_within_the_limit():
    g = long_chain(3000)
    assert split_regions(g) and len(split_regions(g)) == 1  # no forced store inside: one region without a limit
    regions = split_regions(g, 1024)
    sizes = [len(r.ops) for r in regions]
    assert sum(sizes) == 3000 and max(sizes) <= 1024 and min(sizes[:-1]) >= 512
    assert all(len(r.outputs) == 1 for r in regions)  # a chain's cut stores the one value live across it
    assert [r.ops[0] for r in regions[1:]] == [f"n{int(r.ops[0][1:])}" for r in regions[1:]]
    assert regions[1].inputs == (regions[0].outputs[0],)


def test_a_graph_within_the_limit_is_not_cut():
    assert boundaries(long_chain(100), 100) == boundaries(long_chain(100))


def test_the_cut_goes_where_the_fewest_extra_bytes_are_live():
    # n8 is read again by n16: a cut after n9..n15 would store it too (two values instead of one)
    b = GraphBuilder("residual")
    y = b.input("x", (64,), "fp32")
    for i in range(20):
        y = b.op(f"n{i}", "Add", [y, "n8"]) if i == 16 else b.op(f"n{i}", "Relu" if i % 2 else "Tanh", [y])
    cuts = boundaries(b.build([y]), 14)
    assert cuts[0] == 8  # the latest point of the window [6, 13] where one value is live


def test_a_fan_out_of_outputs_is_cut_anywhere_for_free():
    b = GraphBuilder("fan")
    x = b.input("x", (8,), "fp32")
    outs = [b.op(f"o{i}", "Relu", [x]) for i in range(3000)]
    regions = split_regions(b.build(outs), 1024)
    assert [len(r.ops) for r in regions] == [1, 1024, 1024, 951]  # the first output alone is a forced cut
    assert all(r.inputs == ("x",) for r in regions) and sum(len(r.outputs) for r in regions) == 3000


def test_a_tiny_limit_still_terminates():
    assert len(split_regions(long_chain(10), 1)) == 10
