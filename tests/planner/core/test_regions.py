"""Regions: cuts at forced stores, and the segment limit's cuts on long graphs."""

import pytest
from _graphs import long_chain

from planner.core.cost import load_device, unfused_estimate_us
from planner.core.examples import transformer
from planner.core.graph import GraphBuilder
from planner.core.regions import boundaries, region_shares, split_regions


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


def _masked_layers(elementwise_side: bool = False) -> GraphBuilder:
    """A stem GEMM, then two equal layers that each read a side value prepared once from input ``m`` (as a
    padding mask is, inside the first layer's attention) through a GEMM; with ``elementwise_side``, the first
    layer also adds a second side value no GEMM reads."""
    b = GraphBuilder("masked")
    b.input("x", (16, 32), "fp32")
    b.input("m", (16, 32), "fp32")
    for w in ("w0", "w1", "v1", "w2", "v2"):
        b.input(w, (32, 32), "fp32")
    h = b.op("h0", "MatMul", ["x", "w0"])
    side = b.op("side", "Relu", ["m"])  # prepared where the first layer needs it
    extra = b.op("extra", "Neg", ["m"]) if elementwise_side else None
    for i in (1, 2):
        p = b.op(f"p{i}", "MatMul", [h, f"w{i}"])
        q = b.op(f"q{i}", "MatMul", [side, f"v{i}"])
        s = b.op(f"s{i}", "Add", [p, q])
        if extra is not None and i == 1:
            s = b.op("with_extra", "Add", [s, extra])
        h = b.op(f"o{i}", "Relu", [s])
    return b


def test_a_value_prepared_once_for_every_layer_does_not_stop_the_layers_repeating():
    g = _masked_layers().build(["o2"])
    regions = split_regions(g)
    assert [r.ops for r in regions] == [("h0",), ("side",), ("p1", "q1", "s1", "o1"), ("p2", "q2", "s2", "o2")]
    assert regions[2].key == regions[3].key  # the side value is an input of each layer
    assert regions[2].inputs == ("h0", "w1", "side", "v1")


def test_a_side_value_a_fused_kernel_could_read_in_registers_stays_with_its_reader():
    g = _masked_layers(elementwise_side=True).build(["o2"])
    regions = split_regions(g)
    # ``extra`` is read only by the first layer's Add, never stored: it stays in that layer (no fusion lost)
    assert [r.ops for r in regions] == [("h0",), ("side",), ("extra", "p1", "q1", "s1", "with_extra", "o1"),
                                        ("p2", "q2", "s2", "o2")]


def test_a_side_op_reading_a_value_that_stays_stays_too():
    """``p`` stays with the layer (its reader ``s`` may fuse it); ``side``, though stored anyway, reads ``p``: it
    stays as well, for a region never reads a value of a later one."""
    b = GraphBuilder("chained")
    for name, shape in (("x", (16, 32)), ("m", (16, 32)), ("w", (32, 32))):
        b.input(name, shape, "fp32")
    h = b.op("h", "MatMul", ["x", "w"])  # a GEMM reads it too (d): stored anyway, a cut after it
    p = b.op("p", "Neg", ["m"])
    side = b.op("side", "Relu", [p])  # a GEMM reads it: stored anyway
    s = b.op("s", "Mul", [h, p])  # p's last reader, before any GEMM that depends on p: p need not be stored
    out = b.op("o", "Add", [b.op("a", "MatMul", [s, "w"]), b.op("c", "MatMul", [side, "w"])])
    out = b.op("o2", "Add", [out, b.op("d", "MatMul", [h, "w"])])
    regions = split_regions(b.build([out]))
    assert [r.ops for r in regions] == [("h",), ("p", "side", "s", "a", "c", "o", "d", "o2")]
    produced = {"x", "m", "w"}
    for r in regions:
        assert set(r.inputs) <= produced
        produced |= set(r.ops)


def test_a_value_computed_from_the_piece_stops_a_cut():
    b = GraphBuilder("residual")
    b.input("x", (16, 32), "fp32")
    b.input("w", (32, 32), "fp32")
    h = b.op("h", "MatMul", ["x", "w"])
    a = b.op("a", "MatMul", [h, "w"])  # stored anyway (a GEMM reads it), as h is (held across the GEMMs)
    r = b.op("r", "Add", [b.op("c", "MatMul", [a, "w"]), h])
    # after h alone; not after a, where h is live too: the piece's own entry, not a side value
    assert boundaries(b.build([r])) == [0]


def _layers_then(tail: tuple[str, ...], layers: int = 3) -> GraphBuilder:
    """``layers`` equal residual layers (a GEMM, the residual add, a ReLU), then the elementwise ``tail`` ops
    (a final norm's place): each layer's output is read by the next GEMM and again by its residual add (stored
    anyway: a cut), the last one only by the tail."""
    b = GraphBuilder("layers")
    h = b.input("x", (16, 32), "fp32")
    for i in range(layers):
        b.input(f"w{i}", (32, 32), "fp32")
        p = b.op(f"p{i}", "MatMul", [h, f"w{i}"])
        h = b.op(f"o{i}", "Relu", [b.op(f"s{i}", "Add", [p, h])])
    for j, op in enumerate(tail):
        h = b.op(f"t{j}", op, [h])
    return b


def test_the_last_layer_holding_the_tail_is_cut_where_it_repeats_the_others():
    g = _layers_then(("Neg", "Tanh")).build(["t1"])
    regions = split_regions(g)
    assert [r.ops for r in regions] == [("p0", "s0", "o0"), ("p1", "s1", "o1"), ("p2", "s2", "o2"), ("t0", "t1")]
    assert len({r.key for r in regions[:3]}) == 1 and regions[3].inputs == ("o2",) and regions[2].outputs == ("o2",)
    whole = split_regions(g, repeats=False)  # the forced stores alone: the tail stays with the last layer
    assert [r.ops for r in whole][-1] == ("p2", "s2", "o2", "t0", "t1")


def test_a_repeat_is_cut_only_where_it_holds_a_gemm_and_the_rest_none():
    # one pre-LN layer: its MLP half starts with a LayerNorm, as the first region is; that saves no GEMM's search
    g = transformer(1, 64, 16, "fp32")
    assert [len(r.ops) for r in split_regions(g)] == [len(r.ops) for r in split_regions(g, repeats=False)]
    assert len({r.key for r in split_regions(g)}) == len(split_regions(g))  # no repeat: the graph is searched whole


def test_each_distinct_region_has_its_share_of_the_estimate_its_instances_counted():
    g = _layers_then(("Neg", "Tanh")).build(["t1"])
    spec = load_device("seed-k4")
    regions = split_regions(g)
    shares = region_shares(regions, spec)
    layer, tail = regions[0].key, regions[3].key
    assert set(shares) == {layer, tail} and sum(shares.values()) == pytest.approx(1.0)
    each = {key: unfused_estimate_us(r.graph, spec) for r in regions for key in [r.key]}
    assert shares[layer] / shares[tail] == pytest.approx(3 * each[layer] / each[tail])
