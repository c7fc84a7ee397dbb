"""The CPU forms of the standalone ops: head layouts, batched products and the fused attention kernel equal the
op table's numpy semantics, on awkward shapes, split across threads; the attention rule fuses the example."""

from __future__ import annotations

import numpy as np
import pytest

from backends.codegen import CodegenError
from backends.cpu.backend import CpuBackend
from backends.cpu.compiler import ISA_FLAGS, Compiler
from backends.cpu.memory import from_storage
from backends.cpu.standalone import KEY_BLOCK, attention_source
from planner.backend import BackendError
from planner.core import examples
from planner.core.cost import load_device
from planner.core.dtypes import numpy_dtype
from planner.core.graph import GraphBuilder, TensorType
from planner.core.kinds import KernelKind
from planner.core.machine import target_isa
from planner.core.ops import OPS
from planner.core.planfile import kind_problem
from planner.core.plans import Expr, Load, Plan
from planner.core.reference import execute_plan, random_inputs
from planner.core.shapes import window_out
from planner.egraph.candidates import build_candidates

#: the code of the ISA the suite does not run (AVX2 where it runs native code, else native): another
#: contender, whose measured choices are recorded apart
OTHER_CODE = ISA_FLAGS["native" if target_isa() == "avx2" else "avx2"]
SPEC = load_device("h200")


def _attention_plan(g: int, s: int, t: int, d: int, e: int, scale: float, causal: int) -> Plan:
    b = GraphBuilder("attention-kernel")
    for name, shape in (("q", (g, s, d)), ("k", (g, t, d)), ("v", (g, t, e))):
        b.input(name, shape, "fp32")
    b.op("out", "Attention", ["q", "k", "v"], {"scale": scale, "causal": causal})
    graph = b.build(["out"])
    return build_candidates(graph, SPEC).unfused


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("g", "s", "t", "d", "e", "causal"), [
    (3, 5, 5, 4, 4, 1),  # fewer keys than a vector
    (2, 70, 70, 16, 24, 1),  # a query block and a key block cut short
    (2, 9, KEY_BLOCK * 2 + 3, 8, 8, 0),  # three key blocks, the last one ragged
    (1, 130, 67, 32, 16, 1),  # more queries than keys, causal (top-left, as torch's is_causal)
    (2, 37, 100, 40, 80, 0),  # output columns in registers (64 or 32 at a time), then a remainder of 16
    (1, 20, 130, 64, 128, 1),  # several column chunks, no remainder
])
def test_attention_kernel_equals_the_op_tables_semantics(g, s, t, d, e, causal, threads) -> None:
    plan = _attention_plan(g, s, t, d, e, 0.7, causal)
    assert [k.describe() for k in plan.kernels] == ["standalone[Attention]"]
    rng = np.random.default_rng(5)
    inputs = {n: rng.standard_normal(plan.tensors[n].shape).astype(np.float32) for n in "qkv"}
    got = CpuBackend(SPEC, threads=threads).compile(plan).run(inputs)[0]
    want = OPS["Attention"].evaluate([inputs["q"].astype(np.float64), inputs["k"].astype(np.float64),
                                      inputs["v"].astype(np.float64)], {"scale": 0.7, "causal": causal})
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_a_nan_score_makes_its_row_nan_as_in_the_unfused_form() -> None:
    plan = _attention_plan(1, 4, 4, 4, 4, 1.0, 0)
    q, k, v = (np.random.default_rng(i).standard_normal(plan.tensors[n].shape).astype(np.float32)
               for i, n in enumerate("qkv"))
    q[0, 2, 1] = np.nan
    got = CpuBackend(SPEC, threads=1).compile(plan).run({"q": q, "k": k, "v": v})[0]
    assert np.isnan(got[0, 2]).all() and np.isfinite(np.delete(got[0], 2, axis=0)).all()


def _biased_plan(g: int, s: int, t: int, d: int, e: int) -> Plan:
    b = GraphBuilder("biased-attention-kernel")
    for name, shape in (("q", (g, s, d)), ("k", (g, t, d)), ("v", (g, t, e)), ("bias", (g, s, t))):
        b.input(name, shape, "fp32")
    b.op("out", "BiasedAttention", ["q", "k", "v", "bias"], {"scale": 0.7})
    return build_candidates(b.build(["out"]), SPEC).unfused


def _causal_padded_bias(g: int, s: int, t: int, padding: int) -> np.ndarray:
    """A causal mask with left padding, as a bias (transformers' 4-D mask of a padded batch): whole key blocks
    hidden from whole query blocks."""
    bias = np.triu(np.full((s, t), -np.inf, np.float32), 1)[None].repeat(g, 0)
    bias[1::2, :, :padding] = -np.inf
    bias[1::2, :padding, 0] = 0.0  # the padded queries see one key, so that none is NaN
    return bias


@pytest.mark.parametrize("threads", [1, 2])
def test_key_blocks_a_bias_hides_are_skipped_with_the_unfused_forms_answer(threads) -> None:
    g, s, t = 4, 100, 150
    plan = _biased_plan(g, s, t, 16, 24)
    rng = np.random.default_rng(3)
    inputs = {n: rng.standard_normal(plan.tensors[n].shape).astype(np.float32) for n in ("q", "k", "v")}
    inputs["bias"] = _causal_padded_bias(g, s, t, 70)
    got = CpuBackend(SPEC, threads=threads).compile(plan).run(inputs)[0]
    want = OPS["BiasedAttention"].evaluate([inputs[n].astype(np.float64) for n in ("q", "k", "v", "bias")],
                                           {"scale": 0.7})
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("poison", ["nan", "overflow"])
def test_a_key_block_the_bias_hides_is_computed_where_a_score_may_not_be_finite(poison) -> None:
    """A NaN key, or scores past fp32's range, that the bias hides give NaN rows in the unfused form (NaN, or inf,
    plus -inf): the kernel skips hidden blocks only where every score is finite, so its rows are NaN alike."""
    g, s, t = 2, 40, 100
    plan = _biased_plan(g, s, t, 16, 16)
    rng = np.random.default_rng(4)
    inputs = {n: rng.standard_normal(plan.tensors[n].shape).astype(np.float32) for n in ("q", "k", "v")}
    inputs["bias"] = _causal_padded_bias(g, s, t, 50)
    if poison == "nan":
        inputs["k"][0, t - 1, 3] = np.nan  # the last key: hidden from every query by the causal bias
    else:  # the last key's scores past fp32's range (+inf), the others in range
        inputs["q"][1] = np.abs(inputs["q"][1])
        inputs["k"][1, t - 1] = 3e38
    got = CpuBackend(SPEC, threads=1).compile(plan).run(inputs)[0]
    unfused = execute_plan(plan, {n: inputs[n] for n in ("q", "k", "v", "bias")})[0]  # the op table's, in fp32
    nan_rows = np.isnan(got).all(-1)
    assert nan_rows[0 if poison == "nan" else 1].all() and not nan_rows[1 if poison == "nan" else 0].any()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(unfused))


def test_a_non_positive_scale_has_no_kernel_and_says_why() -> None:
    with pytest.raises(CodegenError, match="scale must be positive"):
        attention_source(4, 4, 4, 4, -1.0, True)


def test_layouts_and_batched_products_equal_their_numpy_semantics() -> None:
    graph = examples.attention(batch=2, seq=7, d_model=24, heads=3, causal=True)
    inputs = random_inputs(graph, seed=2)
    unfused = build_candidates(graph, SPEC).unfused
    kinds = [k.describe() for k in unfused.kernels]
    assert kinds.count("standalone[Heads]") == 3 and "standalone[BatchScores]" in kinds and kinds[-1] == "standalone[Merge]"
    for threads in (1, 2):
        got = CpuBackend(SPEC, threads=threads).compile(unfused).run(inputs)[0]
        np.testing.assert_allclose(got, execute_plan(unfused, inputs)[0], rtol=1e-5, atol=1e-6)


def test_the_attention_rule_fuses_the_example_into_one_kernel_between_its_layouts() -> None:
    graph = examples.attention(batch=1, seq=16, d_model=32, heads=2, causal=True)
    cands = build_candidates(graph, SPEC)
    fused = [p for p in cands.plans if any(k.body.op == "Attention" for k in p.kernels)]
    assert fused and cands.best in fused  # the cost model prefers it: the scores are never stored
    assert [k.describe() for k in fused[0].kernels] == ["standalone[Heads]"] * 3 + ["standalone[Attention]", "standalone[Merge]"]
    assert sum(k.cost.bytes for k in fused[0].kernels) < sum(k.cost.bytes for k in cands.unfused.kernels)
    inputs = random_inputs(graph, seed=1)
    for plan in (fused[0], cands.unfused):
        np.testing.assert_allclose(CpuBackend(SPEC, threads=1).compile(plan).run(inputs)[0],
                                   execute_plan(cands.unfused, inputs)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize(("mode", "attention_impl", "product_impl"), [
    ("native", "torch-sdpa-{}", "torch-{}-batched-gemm"),  # torch's own 16-bit kernels (forced: any CPU)
    ("widen", "c-attention-{}-widened", "numpy-reference"),  # fp32 copies for the generated kernel
])
def test_16_bit_attention_and_its_unfused_form_match_the_reference(dtype, mode, attention_impl, product_impl,
                                                                   monkeypatch) -> None:
    """16-bit standalone kernels: the head layouts copy the stored bits; the fused kernel is torch's attention
    where torch multiplies the dtype natively, else the generated kernel on fp32 copies; the batched products
    (with the causal mask written as the dtype's -inf) likewise.  Every path matches the reference."""
    pytest.importorskip("torch")
    monkeypatch.setenv("FUSION_PLANNER_CPU_GEMM_16BIT", mode)
    graph = examples.attention(batch=2, seq=9, d_model=16, heads=2, dtype=dtype, causal=True)
    cands = build_candidates(graph, SPEC)
    fused = next(p for p in cands.plans if any(k.body.op == "Attention" for k in p.kernels))
    inputs = random_inputs(graph, seed=4)
    want = execute_plan(cands.unfused, inputs)[0].astype(np.float32)
    for plan, impl in ((fused, attention_impl), (cands.unfused, product_impl)):
        compiled = CpuBackend(SPEC, threads=1, gemm_library="torch").compile(plan)
        facts = {k.body.op: f["impl"] for k, f in zip(plan.kernels, compiled.kernel_facts, strict=True)}
        torch_attention = plan is fused and mode == "native"  # reads strided heads; its Merge is the output: a copy
        assert (facts["Heads"], facts["Merge"]) == (("strided-view", "view-or-copy") if torch_attention
                                                    else ("numpy-layout-copy", "numpy-layout-copy"))
        assert facts.get("Attention", facts.get("BatchScores")) == impl.format(dtype)
        got = compiled.run(inputs)[0]
        np.testing.assert_allclose(got.astype(np.float32), want, rtol=3e-2, atol=3e-2)


def test_a_standalone_kernel_in_a_plan_file_must_be_one_op_over_loads() -> None:
    t = TensorType((2, 3, 4), "fp32")
    att = Expr("Attention", (Load("q"), Load("k"), Load("v")), (("causal", 1), ("scale", 0.5)), "o", t)
    assert kind_problem(KernelKind.STANDALONE, att, None) is None
    nested = Expr("Exp", (att,), (), "e", t)
    assert "standalone kernel" in kind_problem(KernelKind.STANDALONE, nested, None)
    assert kind_problem(KernelKind.ELEMENTWISE, att, None) is not None


def _masked_inputs(graph, seed: int, dtype: str) -> dict[str, np.ndarray]:
    """A padding mask as BERT's: batch 0 hides its first 70 keys (-inf: a whole key block and more), batch 1
    hides its last 5 with the dtype's lowest value (finite), the rest 0."""
    inputs = random_inputs(graph, seed=seed)
    mask = np.zeros(inputs["mask"].shape, np.float32)
    mask[0, :70] = -np.inf
    mask[1, -5:] = float(np.finfo(np.float16).min if dtype == "fp16" else -3.0e38)
    inputs["mask"] = mask
    return inputs


@pytest.mark.parametrize("threads", [1, 2])
def test_every_masked_attention_plan_matches_the_reference(threads) -> None:
    """A padding mask repeated over the heads and added to the scaled scores: the fused MaskedAttention kernel
    (key blocks the mask hides entirely included) and every unfused form, where the row kernels read the mask
    one row per group."""
    graph = examples.attention(batch=2, seq=80, d_model=32, heads=2, dtype="fp32", masked=True)
    cands = build_candidates(graph, SPEC, cap=64)
    assert any(k.body.op == "MaskedAttention" for p in cands.plans for k in p.kernels)
    inputs = _masked_inputs(graph, 3, "fp32")
    want = execute_plan(cands.unfused, inputs)[0]
    assert np.isfinite(want).all()
    for plan in cands.plans[:12]:
        got = CpuBackend(SPEC, threads=threads).compile(plan).run(inputs)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=plan.notation())


@pytest.mark.parametrize(("dtype", "mode"), [("bf16", "native"), ("bf16", "widen"), ("fp16", "widen")])
def test_16_bit_masked_attention_matches_the_reference(dtype, mode, monkeypatch) -> None:
    pytest.importorskip("torch")
    monkeypatch.setenv("FUSION_PLANNER_CPU_GEMM_16BIT", mode)
    graph = examples.attention(batch=2, seq=80, d_model=16, heads=2, dtype=dtype, masked=True)
    cands = build_candidates(graph, SPEC)
    fused = next(p for p in cands.plans if any(k.body.op == "MaskedAttention" for k in p.kernels))
    inputs = _masked_inputs(graph, 4, dtype)
    want = execute_plan(cands.unfused, inputs)[0].astype(np.float32)
    compiled = CpuBackend(SPEC, threads=1, gemm_library="torch").compile(fused)
    facts = {k.body.op: f["impl"] for k, f in zip(fused.kernels, compiled.kernel_facts, strict=True)}
    assert facts["MaskedAttention"] == ("torch-sdpa-bf16" if mode == "native" else f"c-attention-{dtype}-widened")
    np.testing.assert_allclose(compiled.run(inputs)[0].astype(np.float32), want, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("masked", [False, True])
def test_torchs_attention_reads_strided_heads_and_hands_its_result_to_the_merge(masked, threads, monkeypatch) -> None:
    """Around torch's 16-bit attention the layout kernels copy nothing: each Heads result is a strided view of the
    packed projection, and the Merge of torch's result (written in token order, given views) is a view of it
    that a generated loop reads by address.  The projection's buffer lives until the attention has read it
    (nothing else is written into it before), batches of two, over repeated calls; equal to the reference."""
    pytest.importorskip("torch")
    monkeypatch.setenv("FUSION_PLANNER_CPU_GEMM_16BIT", "native")
    b = GraphBuilder("attention-then-relu")
    b.input("x", (2 * 9, 48), "bf16")
    b.input("w", (48, 48), "bf16")
    mask = b.input("mask", (2, 9), "bf16") if masked else None
    qkv = b.op("qkv", "Relu", [b.op("proj", "MatMul", ["x", "w"])])
    att = examples.attention_ops(b, "attn", qkv, batch=2, seq=9, heads=2, width=16, causal=not masked, mask=mask)
    graph = b.build([b.op("out", "Relu", [b.op("merged", "Affine", [att], {"a": 2.0, "b": 1.0})])])
    cands = build_candidates(graph, SPEC, cap=64)
    op = "MaskedAttention" if masked else "Attention"
    plans = [p for p in cands.plans if any(k.body.op == op for k in p.kernels)
             and not any(k.body.op == "Merge" for k in p.kernels if k.out in p.outputs)]
    assert plans
    inputs = random_inputs(graph, seed=6)
    if masked:
        inputs["mask"][1, -3:] = -np.inf
    want = execute_plan(cands.unfused, inputs)[0].astype(np.float32)
    for plan in plans[:4]:
        compiled = CpuBackend(SPEC, threads=threads, gemm_library="torch").compile(plan)
        facts = {k.body.op: f for k, f in zip(plan.kernels, compiled.kernel_facts, strict=True)}
        assert facts["Heads"]["impl"] == "strided-view" and facts[op]["result"] == "handed"
        merge = next(k.out for k in plan.kernels if k.body.op == "Merge")
        for _ in range(2):
            got = compiled.run(inputs)[0].astype(np.float32)
            np.testing.assert_allclose(got, want, rtol=3e-2, atol=3e-2, err_msg=plan.notation())
        assert not np.shares_memory(compiled.memory.arrays[merge], compiled.memory.own[merge])  # a view of torch's


def _in_place_attention_graph(case: str, merged_out: bool):
    """Attention of 2 sequences of 70 tokens, 4 query heads of 8, from token rows, its heads merged: ``causal``
    from one packed projection; ``gqa`` 2 key/value heads (their GroupRepeat over the query heads) from a
    packed key/value projection; ``masked`` a padding mask (batch, T) repeated over the heads; ``biased`` a
    per-batch row of keys per query (batch*S, T) repeated over the heads.  ``merged_out``: the Merge is the
    output, else ReLU reads it and adds it to its exponential."""
    batch, seq, heads, width = 2, 70, 4, 32
    b = GraphBuilder(f"in-place-attention-{case}")
    x = b.input("x", (batch * seq, 3 * width if case != "gqa" else 2 * width), "fp32")
    q = b.op("qh", "Heads", [x], {"heads": heads, "seq": seq, "width": width, "offset": 0})
    if case == "gqa":  # 2 key/value heads of 8 after the queries' 32 columns, each repeated for 2 query heads
        k, v = (b.op(f"{t}h", "GroupRepeat", [b.op(f"{t}h2", "Heads", [x], {"heads": 2, "seq": seq, "width": 16,
                                                                             "offset": off})],
                     {"heads": 2, "rows": seq}) for t, off in (("k", width), ("v", width + 16)))
    else:
        k, v = (b.op(f"{t}h", "Heads", [x], {"heads": heads, "seq": seq, "width": width, "offset": off})
                for t, off in (("k", width), ("v", 2 * width)))
    scale = {"scale": 0.3}
    if case == "masked":
        mask = b.op("mask", "GroupRepeat", [b.input("m", (batch, seq), "fp32")], {"heads": heads, "rows": 1})
        att = b.op("att", "MaskedAttention", [q, k, v, mask], scale)
    elif case == "biased":
        bias = b.op("bias", "GroupRepeat", [b.input("m", (batch * seq, seq), "fp32")], {"heads": heads, "rows": seq})
        att = b.op("att", "BiasedAttention", [q, k, v, bias], scale)
    else:
        att = b.op("att", "Attention", [q, k, v], {**scale, "causal": int(case == "causal")})
    merged = b.op("merged", "Merge", [att], {"heads": heads})
    if merged_out:
        return b.build([merged])
    y = b.op("y", "Relu", [merged])
    return b.build([b.op("out", "Add", [b.op("e", "Exp", [y]), merged])])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("merged_out", [False, True])
@pytest.mark.parametrize("case", ["causal", "gqa", "masked", "biased"])
def test_the_generated_attention_reads_views_and_writes_its_merges_rows(case, merged_out, threads) -> None:
    """fp32 attention copies no layout: it reads each head's columns of the projection in place (Heads), a
    repeated operand from its source (GroupRepeat: grouped-query keys, a mask or a bias per batch), and writes
    its result as the Merge's token rows, which the Merge's readers read in place (or, for an output, are
    copied out).  Equal to the reference over repeated calls in every candidate plan, each view's source alive
    until the attention has read it."""
    graph = _in_place_attention_graph(case, merged_out)
    plans = build_candidates(graph, SPEC, cap=32).plans
    inputs = random_inputs(graph, seed=7)
    if case in ("masked", "biased"):
        inputs["m"][1, -20:] = -np.inf  # the last keys of batch 1 hidden (biased: its first rows' keys)
    want = execute_plan(build_candidates(graph, SPEC).unfused, inputs)[0]
    merged_impl = "written merged, copied out" if merged_out else "written merged"
    for plan in plans[:6]:
        compiled = CpuBackend(SPEC, threads=threads).compile(plan)
        facts = {k.out: f for k, f in zip(plan.kernels, compiled.kernel_facts, strict=True)}
        assert {facts[n]["impl"] for n in ("qh", "kh", "vh", "kh2", "vh2") if n in facts} <= {"strided-view",
                                                                                             "read in place"}
        assert facts["att"]["in_place"] == ",".join(sorted(("q", "k", "v", "out", *(["mask"] if case in (
            "masked", "biased") else []))))
        assert facts["merged"]["impl"] == merged_impl
        for _ in range(2):
            np.testing.assert_allclose(compiled.run(inputs)[0], want, rtol=2e-5, atol=2e-5, err_msg=plan.notation())


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_token_ids_and_a_packed_projections_columns_equal_the_reference(dtype, threads) -> None:
    """Embedding (the table's rows at ids carried as fp32, copied by a generated loop) and Columns (a packed
    gate/up projection taken apart), in every candidate of the token MLP; an id outside the table (or not
    whole, or NaN) is an error, as in torch, and the next call with good ids is right again."""
    graph = examples.token_mlp(tokens=24, vocab=50, d_model=32, hidden=48, dtype=dtype)
    inputs = random_inputs(graph, seed=3)
    assert set(np.unique(inputs["ids"])) <= set(range(50)) and len(np.unique(inputs["ids"])) > 5
    for plan in build_candidates(graph, SPEC).plans[:4]:
        assert {"standalone[Embedding]", "standalone[Columns]"} <= {k.describe() for k in plan.kernels}
        compiled = CpuBackend(SPEC, threads=threads).compile(plan)
        gather = next(f for k, f in zip(plan.kernels, compiled.kernel_facts, strict=True) if k.body.op == "Embedding")
        assert gather["impl"] == "c-gather"
        want = execute_plan(plan, inputs)[0].astype(np.float32)
        np.testing.assert_allclose(compiled.run(inputs)[0].astype(np.float32), want, rtol=2e-2, atol=2e-2)
    for bad in (50.0, -1.0, 2.5, np.nan, 1e10):
        with pytest.raises(IndexError, match="is not a row of a table of 50 rows"):
            compiled.run({**inputs, "ids": np.where(np.arange(24) == 19, bad, inputs["ids"]).astype(np.float32)})
        np.testing.assert_allclose(compiled.run(inputs)[0].astype(np.float32), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(("shape", "kernel", "stride", "padding", "dilation"), [
    ((2, 5, 7, 6), (3, 3), (1, 1), (1, 1), (1, 1)),  # ResNet's 3x3, padding 1
    ((1, 3, 11, 9), (7, 7), (2, 2), (3, 3), (1, 1)),  # the stem's 7x7 stride 2 on odd sizes
    ((2, 4, 6, 8), (3, 2), (2, 1), (0, 1), (1, 2)),  # unequal kernel, stride, padding, dilation
])
def test_im2col_times_the_weight_is_torchs_convolution_and_the_pools_its_pooling(shape, kernel, stride, padding,
                                                                              dilation) -> None:
    torch = pytest.importorskip("torch")
    n, c, h, w = shape
    x = torch.randn(shape)
    weight = torch.randn(4, c, *kernel)
    attrs = {"height": h, "width": w, "kh": kernel[0], "kw": kernel[1], "sh": stride[0], "sw": stride[1],
             "ph": padding[0], "pw": padding[1], "dh": dilation[0], "dw": dilation[1]}
    rows = OPS["ChannelsLast"].evaluate([x.numpy().reshape(-1, w)], {"channels": c, "pixels": h * w})
    patches = OPS["Im2col"].evaluate([rows], attrs)
    got = patches @ weight.permute(2, 3, 1, 0).reshape(-1, 4).numpy()
    want = torch.nn.functional.conv2d(x, weight, None, stride, padding, dilation).permute(0, 2, 3, 1)
    np.testing.assert_allclose(got, want.reshape(-1, 4).numpy(), rtol=1e-5, atol=1e-5)
    if padding[0] * 2 <= kernel[0] and padding[1] * 2 <= kernel[1]:  # torch's own limit on max pooling padding
        pooled = torch.nn.functional.max_pool2d(x, kernel, stride, padding, dilation).permute(0, 2, 3, 1)
        np.testing.assert_array_equal(OPS["MaxPool"].evaluate([rows], attrs), pooled.reshape(-1, c).numpy())
    np.testing.assert_allclose(OPS["SpatialMean"].evaluate([rows], {"pixels": h * w}), x.mean((2, 3)).numpy(),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(OPS["ChannelsFirst"].evaluate([rows], {"pixels": h * w, "width": w}),
                                  x.numpy().reshape(-1, w))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("g", "s", "t", "d", "e"), [
    (3, 5, 5, 4, 4),  # fewer keys than a vector
    (2, 70, KEY_BLOCK * 2 + 3, 16, 24),  # a query block cut short, three key blocks, the last one ragged
    (2, 8, KEY_BLOCK * 2, 16, 16),  # whole query and key blocks: the bias rows read in place
    (2, 11, 70, 16, 64),  # output columns in registers
])
def test_biased_attention_kernel_equals_the_op_tables_semantics(g, s, t, d, e, threads) -> None:
    """A bias row per query (T5's relative position bias), -inf over a whole key block for one query, over
    every key of another (NaN, as in the op table), and keys far below the row's maximum (past -87, where the
    kernel's exponential is 0)."""
    b = GraphBuilder("biased-attention-kernel")
    for name, shape in (("q", (g, s, d)), ("k", (g, t, d)), ("v", (g, t, e)), ("bias", (g, s, t))):
        b.input(name, shape, "fp32")
    b.op("out", "BiasedAttention", ["q", "k", "v", "bias"], {"scale": 0.7})
    plan = build_candidates(b.build(["out"]), SPEC).unfused
    rng = np.random.default_rng(5)
    inputs = {n: rng.standard_normal(plan.tensors[n].shape).astype(np.float32) for n in ("q", "k", "v", "bias")}
    inputs["bias"][0, 1, :KEY_BLOCK] = -np.inf
    inputs["bias"][1, 2] = -np.inf
    inputs["bias"][1, 3, ::3] = -95.0
    got = CpuBackend(SPEC, threads=threads).compile(plan).run(inputs)[0]
    with np.errstate(invalid="ignore"):
        want = OPS["BiasedAttention"].evaluate([inputs[n].astype(np.float64) for n in ("q", "k", "v", "bias")],
                                               {"scale": 0.7})
    hidden = np.isneginf(inputs["bias"]).all(-1)  # the queries with no key to attend to: NaN, the rest finite
    assert hidden[1, 2] and (np.isnan(got).all(-1) == hidden).all() and np.isfinite(got[~hidden]).all()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(("shape", "window"), [
    ((2, 5, 7, 6), (3, 3, 2, 2, 1, 1, 1, 1)),  # ResNet's 3x3 stride-2 pooling, odd sizes, 5 channels
    ((1, 16, 9, 11), (3, 2, 1, 2, 1, 0, 2, 1)),  # unequal window, stride, padding and dilation
    ((3, 32, 8, 8), (2, 2, 2, 2, 0, 0, 1, 1)),
])
def test_the_compiled_max_pooling_is_torchs_nan_and_inf_included(shape, window, dtype, threads) -> None:
    torch = pytest.importorskip("torch")
    n, c, h, w = shape
    kh, kw, sh, sw, ph, pw, dh, dw = window
    attrs = {"height": h, "width": w, "kh": kh, "kw": kw, "sh": sh, "sw": sw, "ph": ph, "pw": pw, "dh": dh, "dw": dw}
    b = GraphBuilder("maxpool-kernel")
    b.input("x", (n * h * w, c), dtype)
    b.op("out", "MaxPool", ["x"], attrs)
    plan = build_candidates(b.build(["out"]), SPEC).unfused
    x = torch.randn(shape)
    x[0, 0, 1, 1], x[-1, -1, 0, 0], x[0, 1] = float("nan"), float("inf"), -float("inf")
    x = x.to(getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[dtype]))
    rows = x.permute(0, 2, 3, 1).reshape(-1, c).contiguous()
    compiled = CpuBackend(SPEC, threads=threads).compile(plan)
    assert compiled.kernel_facts[0]["impl"] == "c-maxpool"
    got = compiled.run({"x": rows.float().numpy() if dtype == "fp32" else rows.view(torch.int16).numpy().view(
        numpy_dtype(dtype))})[0]
    want = torch.nn.functional.max_pool2d(x.float(), (kh, kw), (sh, sw), (ph, pw), (dh, dw)).permute(0, 2, 3, 1)
    np.testing.assert_array_equal(np.asarray(got, np.float32), want.reshape(-1, c).numpy())


def _random_window(rng: np.random.Generator) -> dict[str, int] | None:
    h, w, kh, kw = (int(v) for v in (rng.integers(1, 15), rng.integers(1, 21), rng.integers(1, 8), rng.integers(1, 8)))
    attrs = {"height": h, "width": w, "kh": kh, "kw": kw, "sh": int(rng.integers(1, 4)), "sw": int(rng.integers(1, 4)),
             "ph": int(rng.integers(0, kh // 2 + 1)), "pw": int(rng.integers(0, kw // 2 + 1)),
             "dh": int(rng.integers(1, 3)), "dw": int(rng.integers(1, 3))}
    return attrs if min(window_out(attrs)) >= 1 else None


def test_the_generated_window_kernels_equal_the_op_table_on_random_windows() -> None:
    """DepthwiseConv and AvgPool's generated kernels against the op table's semantics on drawn windows (sizes,
    kernels, strides, padding, dilation, channel counts around the vector width): gcc 12 -O3 once vectorised a
    pooling loop with a test per tap into wrong sums, which the fixed examples above did not all reach."""
    rng = np.random.default_rng(11)
    backend, checked = CpuBackend(SPEC, threads=1), 0
    while checked < 24:
        attrs = _random_window(rng)
        if attrs is None:
            continue
        c, images = int(rng.choice([1, 3, 15, 16, 17, 40])), int(rng.integers(1, 3))
        x = rng.standard_normal((images * attrs["height"] * attrs["width"], c)).astype(np.float32)
        pooled = {**attrs, "dh": 1, "dw": 1, "include_pad": int(rng.integers(0, 2)), "divisor": int(rng.choice([0, 5]))}
        for op, a in (("DepthwiseConv", attrs), ("AvgPool", pooled)):
            oh, ow = window_out(a)
            if min(oh, ow) < 1:
                continue
            taps = rng.standard_normal((a["kh"] * a["kw"], c)).astype(np.float32)
            b = GraphBuilder(f"window-{op}")
            b.input("x", x.shape, "fp32")
            inputs = {"x": x} if op == "AvgPool" else {"x": x, "w": taps}
            if op == "DepthwiseConv":
                b.input("w", taps.shape, "fp32")
            b.op("out", op, list(inputs), a)
            plan = build_candidates(b.build(["out"]), SPEC).unfused
            got = backend.compile(plan).run(inputs)[0]
            want = OPS[op].evaluate(list(inputs.values()), a)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{op} {a} of {c} channels")
            checked += 1


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(("shape", "window", "include_pad", "divisor"), [
    ((2, 5, 7, 6), (2, 2, 2, 2, 0, 0), True, None),  # DenseNet's transition, ResNet-D's shortcut: 2x2 stride 2
    ((1, 16, 9, 11), (3, 3, 2, 2, 1, 1), True, None),  # padding counted in the divisor
    ((1, 16, 9, 11), (3, 3, 2, 2, 1, 1), False, None),  # padding left out of it
    ((3, 8, 6, 5), (3, 2, 1, 2, 1, 0), True, 4),  # unequal window and stride, a divisor given
])
def test_the_compiled_average_pooling_is_torchs(shape, window, include_pad, divisor, dtype, threads) -> None:
    torch = pytest.importorskip("torch")
    n, c, h, w = shape
    kh, kw, sh, sw, ph, pw = window
    attrs = {"height": h, "width": w, "kh": kh, "kw": kw, "sh": sh, "sw": sw, "ph": ph, "pw": pw, "dh": 1, "dw": 1,
             "include_pad": int(include_pad), "divisor": divisor or 0}
    b = GraphBuilder("avgpool-kernel")
    b.input("x", (n * h * w, c), dtype)
    b.op("out", "AvgPool", ["x"], attrs)
    plan = build_candidates(b.build(["out"]), SPEC).unfused
    x = torch.randn(shape).to(getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[dtype]))
    rows = x.permute(0, 2, 3, 1).reshape(-1, c).contiguous()
    compiled = CpuBackend(SPEC, threads=threads).compile(plan)
    assert compiled.kernel_facts[0]["impl"] == "c-avgpool"
    got = compiled.run({"x": rows.float().numpy() if dtype == "fp32" else rows.view(torch.int16).numpy().view(
        numpy_dtype(dtype))})[0]
    want = torch.nn.functional.avg_pool2d(x.float(), (kh, kw), (sh, sw), (ph, pw), False, include_pad, divisor)
    want = want.permute(0, 2, 3, 1).reshape(-1, c).numpy()
    tol = 1e-6 if dtype == "fp32" else 1e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol)
    np.testing.assert_allclose(OPS["AvgPool"].evaluate([rows.float().numpy()], attrs), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("dtype", "sixteen"), [("fp32", "auto"), ("bf16", "auto"), ("bf16", "widen")])
@pytest.mark.parametrize(("shape", "window"), [
    ((2, 5, 7, 6), (3, 3, 1, 1, 1, 1, 1, 1)),  # fewer channels than a vector, odd sizes
    ((1, 40, 9, 11), (3, 3, 2, 2, 1, 1, 1, 1)),  # MobileNet's stride 2; a ragged block of 8 channels
    ((2, 32, 12, 19), (7, 7, 1, 1, 3, 3, 1, 1)),  # ConvNeXt's 7x7: blocks of pixels inside, edges one by one
    ((1, 17, 10, 23), (5, 3, 1, 2, 2, 0, 2, 1)),  # unequal window, stride, padding and dilation
])
def test_the_compiled_depthwise_convolution_is_torchs(shape, window, dtype, threads, sixteen, monkeypatch) -> None:
    """The depthwise convolution of channels-last rows equals torch's conv2d with groups = channels: generated
    (fp32, or 16-bit where torch does not multiply it natively: ``widen``), else torch's own."""
    torch = pytest.importorskip("torch")
    from backends.cpu.gemm import GEMM_16BIT_ENV, native_16bit

    monkeypatch.setenv(GEMM_16BIT_ENV, sixteen)
    n, c, h, w = shape
    kh, kw, sh, sw, ph, pw, dh, dw = window
    attrs = {"height": h, "width": w, "kh": kh, "kw": kw, "sh": sh, "sw": sw, "ph": ph, "pw": pw, "dh": dh, "dw": dw}
    b = GraphBuilder("depthwise-kernel")
    b.input("x", (n * h * w, c), dtype)
    b.input("w", (kh * kw, c), dtype)
    b.op("out", "DepthwiseConv", ["x", "w"], attrs)
    plan = build_candidates(b.build(["out"]), SPEC).unfused
    kind = getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[dtype])
    x, weight = torch.randn(shape).to(kind), torch.randn(c, 1, kh, kw).to(kind)
    rows, taps = x.permute(0, 2, 3, 1).reshape(-1, c).contiguous(), weight.reshape(c, -1).t().contiguous()
    compiled = CpuBackend(SPEC, threads=threads).compile(plan)
    native = dtype != "fp32" and native_16bit(dtype)
    assert compiled.kernel_facts[0]["impl"] == (f"torch-{dtype}-depthwise" if native else "c-depthwise")
    stored = {"x": rows, "w": taps} if dtype == "fp32" else {"x": rows.view(torch.int16), "w": taps.view(torch.int16)}
    got = compiled.run({k: v.numpy() if dtype == "fp32" else v.numpy().view(numpy_dtype(dtype))
                        for k, v in stored.items()})[0]
    want = torch.nn.functional.conv2d(x.float(), weight.float(), None, (sh, sw), (ph, pw), (dh, dw), groups=c)
    tol = 1e-5 if dtype == "fp32" else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), want.permute(0, 2, 3, 1).reshape(-1, c).numpy(),
                               rtol=tol, atol=tol)
    np.testing.assert_allclose(OPS["DepthwiseConv"].evaluate([rows.float().numpy(), taps.float().numpy()], attrs),
                               want.permute(0, 2, 3, 1).reshape(-1, c).numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(("images", "channels", "height", "width"), [
    (2, 5, 7, 6),  # fewer channels and pixels than a block on every side
    (4, 3, 9, 7),  # an RGB image's 3 channels: pixel by pixel, images split across threads
    (1, 64, 9, 13),  # 117 pixels: ragged blocks, whole lines of channels
    (3, 37, 8, 8),  # a ragged line of channels, several images split across threads
])
def test_the_generated_channel_transposes_are_the_op_tables(images, channels, height, width, dtype, threads) -> None:
    """ChannelsLast then ChannelsFirst as generated transposes: each exactly the op table's copy, and back where
    they started; the stored bits of a 16-bit dtype moved as they are."""
    pixels = height * width
    b = GraphBuilder("channel-transposes")
    b.input("x", (images * channels * height, width), dtype)
    rows = b.op("rows", "ChannelsLast", ["x"], {"channels": channels, "pixels": pixels})
    back = b.op("back", "ChannelsFirst", [rows], {"pixels": pixels, "width": width})
    plan = build_candidates(b.build([rows, back]), SPEC).unfused
    compiled = CpuBackend(SPEC, threads=threads).compile(plan)
    assert [f["impl"] for f in compiled.kernel_facts] == ["c-transpose", "c-transpose"]
    x = random_inputs(b.build([rows, back]), seed=9)["x"]
    got_rows, got_back = compiled.run_stored({"x": x})
    want_rows = OPS["ChannelsLast"].evaluate([x], {"channels": channels, "pixels": pixels})
    assert got_rows.shape == (images * pixels, channels)
    np.testing.assert_array_equal(from_storage(got_rows, dtype), want_rows)
    np.testing.assert_array_equal(from_storage(got_back, dtype), x)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(("images", "pixels", "channels"), [
    (1, 49, 2048),  # ResNet-50's last stage, one image
    (8, 256, 32),  # the small CNN's head: several images split across threads
    (3, 5, 7),  # ragged channels
])
def test_the_generated_spatial_mean_is_the_op_tables(images, pixels, channels, dtype, threads) -> None:
    """SpatialMean (global average pooling) as a generated kernel summing in double: the op table's mean, within
    one rounding of the result; large values next to small ones lose nothing a float sum would."""
    b = GraphBuilder("spatial-mean")
    b.input("x", (images * pixels, channels), dtype)
    b.op("out", "SpatialMean", ["x"], {"pixels": pixels})
    graph = b.build(["out"])
    plan = build_candidates(graph, SPEC).unfused
    compiled = CpuBackend(SPEC, threads=threads).compile(plan)
    assert compiled.kernel_facts[0]["impl"] == "c-spatialmean"
    x = random_inputs(graph, seed=4)["x"]
    if dtype == "fp32":
        x[::pixels] = 3e7  # one large pixel per image: a float running sum would drop the small ones
    got = from_storage(compiled.run_stored({"x": x})[0], dtype)
    want = OPS["SpatialMean"].evaluate([from_storage(x, dtype) if dtype != "fp32" else x], {"pixels": pixels})
    assert got.shape == (images, channels)
    np.testing.assert_allclose(got, np.asarray(want, np.float32), rtol=1e-6 if dtype == "fp32" else 8e-3, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", ["causal", "gqa", "masked", "biased"])
def test_torchs_fp32_attention_reads_strided_heads_and_equals_the_reference(case, threads, monkeypatch) -> None:
    """fp32 attention as torch's fused kernel (``FUSION_PLANNER_CPU_ATTENTION=torch``): its Heads are strided
    views, its result is handed to the Merge as torch wrote it, a repeated operand is copied (torch reads no
    GroupRepeat view); equal to the reference over repeated calls."""
    pytest.importorskip("torch")
    monkeypatch.setenv("FUSION_PLANNER_CPU_ATTENTION", "torch")
    graph = _in_place_attention_graph(case, merged_out=False)
    plans = build_candidates(graph, SPEC, cap=32).plans
    inputs = random_inputs(graph, seed=7)
    if case in ("masked", "biased"):
        inputs["m"][1, -20:] = -1e30  # the last keys of batch 1 hidden (torch gives a row of only -inf 0, not NaN)
    want = execute_plan(build_candidates(graph, SPEC).unfused, inputs)[0]
    for plan in plans[:3]:
        compiled = CpuBackend(SPEC, threads=threads).compile(plan)
        facts = {k.out: f for k, f in zip(plan.kernels, compiled.kernel_facts, strict=True)}
        assert facts["att"]["impl"] == "torch-sdpa-fp32" and facts["att"]["result"] == "handed"
        assert facts["qh"]["impl"] == "strided-view" and facts["merged"]["impl"] == "view-or-copy"
        for _ in range(2):
            np.testing.assert_allclose(compiled.run(inputs)[0], want, rtol=2e-5, atol=2e-5, err_msg=plan.notation())


@pytest.mark.parametrize(("generated_ms", "torch_ms", "chosen"), [(10.0, 6.7, "torch"), (5.5, 7.0, "generated"),
                                                                   (1.0, 0.97, "generated")])
def test_fp32_attentions_kernel_is_the_faster_one_measured_once_per_shape(generated_ms, torch_ms, chosen,
                                                                         monkeypatch, tmp_path) -> None:
    """``auto``: the generated kernel unless torch's measured faster by the margin (a 3% win is noise), timed once
    per shape and backend, and recorded in the kernel cache for the next process; a bad value is refused."""
    pytest.importorskip("torch")
    from backends.cpu import standalone
    from backends.cpu.steps import StandaloneSteps
    from planner.core.errors import UsageError

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("FUSION_PLANNER_CPU_ATTENTION", "auto")
    timed: list[tuple[str, ...]] = []

    def fake_time(self, body, shapes, source):
        timed.append(tuple(shapes))
        return {"generated": generated_ms / 1e3, "torch": torch_ms / 1e3}

    monkeypatch.setattr(StandaloneSteps, "_time_attention", fake_time)
    plan = _attention_plan(2, 9, 9, 8, 8, 0.5, 1)
    impl = "torch-sdpa-fp32" if chosen == "torch" else "c-attention"
    for _ in range(2):
        backend = CpuBackend(SPEC, threads=1)
        for _ in range(2):
            assert backend.compile(plan).kernel_facts[0]["impl"] == impl
    assert len(timed) == 1 and list(tmp_path.rglob("attention-*.json"))  # the second backend read the record
    other = CpuBackend(SPEC, threads=1, compiler=Compiler(target=OTHER_CODE))
    assert other.compile(plan).kernel_facts[0]["impl"] == impl and len(timed) == 2  # other code: measured again
    with pytest.raises(BackendError, match="scale must be positive"):  # no generated kernel: nothing measured
        CpuBackend(SPEC, threads=1).compile(_attention_plan(2, 9, 9, 8, 8, -0.5, 1))
    assert len(timed) == 2
    monkeypatch.setenv("FUSION_PLANNER_CPU_ATTENTION", "fastest")
    with pytest.raises(UsageError, match="FUSION_PLANNER_CPU_ATTENTION"):
        standalone.measured_attention(plan.kernels[0].body, {n: plan.tensors[n].shape for n in "qkv"}, 1, dict,
                                      code=())


@pytest.mark.parametrize("op", ["Attention", "BiasedAttention"])
def test_the_attention_timing_runs_both_kernels_on_the_backends_threads(op) -> None:
    pytest.importorskip("torch")
    b = GraphBuilder("timed")
    for name, shape in (("q", (4, 20, 16)), ("k", (4, 30, 16)), ("v", (4, 30, 8)), ("m", (4, 20, 30))):
        b.input(name, shape, "fp32")
    b.op("out", op, ["q", "k", "v", *(["m"] if op == "BiasedAttention" else [])], {"scale": 0.25})
    body = build_candidates(b.build(["out"]), SPEC).unfused.kernels[0].body
    shapes = {a.tensor: a_shape for a, a_shape in zip(body.args, [(4, 20, 16), (4, 30, 16), (4, 30, 8), (4, 20, 30)],
                                                      strict=False)}
    seconds = CpuBackend(SPEC, threads=2)._time_attention(body, shapes, attention_source(20, 30, 16, 8, 0.25, False,
                                                                                       biased=op == "BiasedAttention"))
    assert set(seconds) == {"generated", "torch"} and all(0 < s < 1 for s in seconds.values())


@pytest.mark.parametrize("mode", ["generated", "auto"])
def test_prepare_builds_every_kernel_a_compile_loads(mode, tmp_path, monkeypatch) -> None:
    """A search prepares its candidates in batched compiler runs: the attention that reads its heads in place
    and writes the Merge's rows, the embedding's gather, and (``auto``) the contiguous attention its measured choice
    times are all built there, so compiling the plans builds nothing more (a kernel built alone cost a cold search
    1-2 s each)."""

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("FUSION_PLANNER_CPU_ATTENTION", mode)
    if mode == "auto":
        pytest.importorskip("torch")
    plans = [*build_candidates(_in_place_attention_graph("gqa", merged_out=False), SPEC, cap=8).plans[:3],
             *build_candidates(examples.token_mlp(tokens=24, vocab=50, d_model=32, hidden=48), SPEC).plans[:2]]
    compiler = Compiler()
    backend = CpuBackend(SPEC, compiler=compiler, threads=1)
    backend.prepare(plans)
    built = compiler.compiled
    facts = [f for p in plans for f in backend.compile(p).kernel_facts]
    assert compiler.compiled == built
    impls = {f["impl"] for f in facts}
    assert "c-gather" in impls and (any("in_place" in f for f in facts) or "torch-sdpa-fp32" in impls)
    assert mode == "auto" or "torch-sdpa-fp32" not in impls


def _per_head_rows(dtype: str) -> GraphBuilder:
    """Token rows viewed as rows of 8 (a head's), each shifted by its max, viewed back: Qwen3's per-head norm's
    layout."""
    b = GraphBuilder(f"per-head-{dtype}")
    b.input("x", (6, 32), dtype)
    heads = b.op("heads", "Regroup", [b.op("t", "Tanh", ["x"])], {"width": 8})
    shifted = b.op("shifted", "SubRow", [heads, b.op("top", "RowMax", [heads])])
    b.op("out", "Regroup", [shifted], {"width": 32})
    return b


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_rows_regrouped_to_another_length_and_back_equal_the_reference(dtype) -> None:
    graph = _per_head_rows(dtype).build(["out"])
    inputs = random_inputs(graph, seed=4)
    x = inputs["x"].astype(np.float32)
    for plan in build_candidates(graph, SPEC).plans[:4]:
        assert "standalone[Regroup]" in {k.describe() for k in plan.kernels}
        got = CpuBackend(SPEC).compile(plan).run(inputs)[0].astype(np.float32)
        np.testing.assert_allclose(got, execute_plan(plan, inputs)[0].astype(np.float32), rtol=1e-6, atol=1e-6)
        heads = np.tanh(x).reshape(24, 8)
        want = (heads - heads.max(axis=1, keepdims=True)).reshape(6, 32)
        np.testing.assert_allclose(got, want, rtol=2e-2 if dtype == "bf16" else 1e-5, atol=2e-2 if dtype == "bf16" else 1e-5)
