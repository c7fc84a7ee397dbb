"""Ledger tables for people: readable kernel names, at most 40 rows of 120 characters unless asked for all."""

from __future__ import annotations

from planner.core import examples
from planner.core.cost import load_device
from planner.core.regions import split_regions
from planner.core.report import (
    TABLE_ROWS,
    TABLE_WIDTH,
    kernel_name,
    kernels_text,
    ledger_table,
    op_words,
    region_title,
    table_rows,
)
from planner.egraph.candidates import build_candidates


def _cands(graph, **kw):
    return build_candidates(graph, load_device("h200"), **kw)


def test_op_words_name_motifs_and_labels():
    layernorm = ["RowMean", "SubRow", "Square", "RowMean", "Affine", "Rsqrt", "MulRow", "BiasMul", "BiasAdd"]
    assert op_words(layernorm) == ["layernorm", "scale", "bias"]
    assert op_words(["Square", "RowMean", "Affine", "Rsqrt", "MulRow", "BiasMul"]) == ["rmsnorm", "scale"]
    assert op_words(["RowMax", "SubRow", "Exp", "RowSum", "DivRow"]) == ["softmax"]
    # a layernorm split across kernels (its mean elsewhere) is no rmsnorm: it subtracts a row statistic
    assert op_words(["SubRow", "Square", "RowMean", "Affine", "Rsqrt", "MulRow"]) == [
        "sub", "square", "rowmean", "affine", "rsqrt", "mul"]
    assert op_words(["MatMul", "BiasAdd", "GeluErf"]) == ["gemm", "bias", "gelu"]
    assert op_words(["Opaque:torch.nn.functional.mish"]) == ["mish"]


def test_kernel_names_read_as_a_person_writes_them():
    cands = _cands(examples.mlp_epilogue(64, 64, 64, "fp16", "tanh"))
    names = {kernel_name(k) for p in cands.plans for k in p.kernels}
    assert "gemm+bias+gelu+add" in names and "gemm" in names
    assert any(n.startswith("lt:gemm") for n in names)  # a cuBLASLt call says so


def test_runs_of_equal_kernels_and_the_width_limit():
    cands = _cands(examples.ew_chain(8, 4096, "fp32"))
    unfused = max(cands.plans, key=lambda p: len(p.kernels))
    full = kernels_text(unfused)
    assert full.count("|") == len(unfused.kernels) - 1 - full.count(" x")
    short = kernels_text(unfused, 40)
    assert len(short) <= 40 and short.endswith("more")
    assert int(short.rsplit("...", 1)[1].split()[0]) == len(unfused.kernels) - sum(
        int(part.rsplit(" x", 1)[1]) if " x" in part else 1 for part in short.split(" | ")[:-1])


def test_a_large_space_shows_40_rows_of_120_characters_with_best_unfused_and_front():
    cands = _cands(examples.ew_chain(8, 4096, "fp32"), cap=4096)
    assert len(cands.plans) > TABLE_ROWS
    text = ledger_table(cands.plans, cands.best.key)
    lines = text.splitlines()
    assert len(lines) == 1 + TABLE_ROWS + 1 and "more rows: --all" in lines[-1]
    assert max(len(line) for line in lines) <= TABLE_WIDTH
    shown = table_rows(cands.plans, cands.best.key)
    keys = {p.key for p in shown}
    assert cands.best.key in keys
    assert max(cands.plans, key=lambda p: len(p.kernels)).key in keys  # the unfused plan
    points = {(p.bytes, p.launches, p.reg_peak) for p in shown}
    for p in cands.plans:  # every plan on the Pareto front of the three ledgers is listed (the front is small)
        dominated = any(q.bytes <= p.bytes and q.launches <= p.launches and q.reg_peak <= p.reg_peak
                        and (q.bytes, q.launches, q.reg_peak) != (p.bytes, p.launches, p.reg_peak) for q in cands.plans)
        if not dominated:
            assert (p.bytes, p.launches, p.reg_peak) in points
    everything = ledger_table(cands.plans, cands.best.key, full=True).splitlines()
    assert len(everything) == 1 + len(cands.plans)


def test_region_titles_name_the_first_op_its_shape_and_the_hash():
    graph = examples.transformer(2, 64, 16, "fp16", "gelu")
    titles = [region_title(r) for r in split_regions(graph, 10_000)]
    assert titles[0].startswith("layernorm 16x64 #")
    assert any(t.startswith("gemm 16x64 #") for t in titles)
    assert len(set(titles)) == len({r.key for r in split_regions(graph, 10_000)})
