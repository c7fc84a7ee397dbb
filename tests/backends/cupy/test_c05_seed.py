"""Seed 001's own C-05 program (backends.cupy.c05_seed): its copy rule, where its result lands, and its kernels
compiled as the device compiles them."""

from __future__ import annotations

import numpy as np
import pytest

from backends.cupy.c05_seed import Op, copies, emulate, naive_schedule, schedule, seed_kernels, verify


@pytest.mark.parametrize("k", range(2, 9))
def test_the_naive_run_copies_in_once_and_out_once_more_when_k_is_even(k):
    """The seed's rule (DIGEST.md, corrected): the ping-pong leaves the result in the scratch buffer after an even
    number of stages, so the run ends with a copy to the output then, and only then."""
    assert copies("naive", k) == (2 if k % 2 == 0 else 1)
    ops = naive_schedule(k)
    assert ops[0].kind == "copy" and (ops[0].src, ops[0].dst) == ("x", "scratch")
    assert [op.stage for op in ops if op.kind == "stage"] == list(range(k))
    assert (ops[-1].kind == "copy") == (k % 2 == 0)


@pytest.mark.parametrize("mode", ["naive", "fused", "fat"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 6, 8])
def test_every_mode_leaves_the_chain_in_the_output_within_the_seeds_tolerance(mode, k):
    x = np.random.default_rng(k).standard_normal(4096).astype(np.float32)
    bufs = emulate(mode, k, x)
    assert verify(bufs["out"], x, k) <= 1.0
    assert not np.isnan(bufs["out"]).any()
    if mode == "naive":  # each stage reads what the previous one wrote: no stage reads a buffer never written
        written = {"x"}
        for op in schedule(mode, k):
            assert op.src in written
            written.add(op.dst)


def test_a_wrong_copy_rule_hands_out_a_stale_output():
    """Had the trailing copy followed odd k (the digest's former error), an even chain would leave the output
    holding the next-to-last stage and an odd one would copy the input stage over its result."""
    x = np.random.default_rng(0).standard_normal(1024).astype(np.float32)
    for k in (3, 4):
        ops = naive_schedule(k)
        wrong = ops[:-1] if k % 2 == 0 else [*ops, Op("copy", "scratch", "out")]
        with pytest.raises(RuntimeError, match="seed's tolerance"):
            verify(emulate("naive", k, x, wrong)["out"], x, k)


def test_bad_modes_and_chain_lengths_are_refused():
    with pytest.raises(ValueError, match="unknown C-05 mode"):
        schedule("slow", 4)
    with pytest.raises(ValueError, match="at least 1"):
        naive_schedule(0)


@pytest.mark.nvrtc
def test_the_seed_kernels_compile_as_the_device_compiles_them():
    from backends.cupy import nvrtc

    kernels = seed_kernels()
    res = dict(zip((k.name for k in kernels), nvrtc.compile_kernels(kernels), strict=True))
    assert set(res) == {"c05_stage", "c05_fused", "c05_fat"}
    # the fat probe holds its 48 temporaries live: far more registers than the thin kernels
    assert res["c05_fat"].regs > 2 * max(res["c05_stage"].regs, res["c05_fused"].regs)
    assert res["c05_stage"].spill_bytes == 0 and res["c05_fused"].spill_bytes == 0


def _row(source, tag, k, ms, **extra):
    return {"source": source, "tag": tag, "k": k, "median_ms": ms, "blocks_per_sm": 8, "regs_max": 32, **extra}


def test_a_failed_row_is_reported_in_its_place_and_the_table_stays(capsys):
    from backends.cupy.c05 import c05_table, print_gpu

    result = {"mode": "sweep", "n": 1 << 24, "d2d_copy_gbps": 4000.0, "machine": {"device": "H200", "sm_count": 132},
              "seed": [_row("seed", "naive", 2, 0.30), _row("seed", "fused", 2, 0.05),
                       {"source": "seed", "tag": "naive", "k": 4, "error": "RuntimeError: boom"},
                       _row("seed", "fused", 4, 0.05)],
              "gpu": [_row("planner", "naive", 2, 0.20, with_copy_ms=0.25), _row("planner", "fused", 2, 0.05)]}
    header, cells, failures = c05_table(result, result["seed"])
    assert header[0] == "k" and [c[0] for c in cells] == ["2", "4"]
    assert cells[0][1] == cells[0][2] == "0.300"  # the seed's naive run includes its copies
    assert cells[0][4] == "6.000x" and cells[1][1] == "-" and failures == ["naive k=4: RuntimeError: boom"]
    _, planner_cells, _ = c05_table(result, result["gpu"])
    assert planner_cells[0][2] == "0.250"  # the planner's naive plan with the seed's copies, timed apart
    print_gpu(result)
    out = capsys.readouterr().out
    assert "the seed's program" in out and "FAILED naive k=4" in out and "the planner's kernels" in out


def test_the_modes_table_relates_fat_to_fused():
    from backends.cupy.c05 import c05_table

    result = {"mode": "modes", "n": 1 << 24, "d2d_copy_gbps": 4000.0}
    rows = [_row("seed", "naive", 4, 0.4), _row("seed", "fused", 4, 0.1), _row("seed", "fat", 4, 0.8, blocks_per_sm=1)]
    _, cells, _ = c05_table(result, rows)
    by_tag = {c[0]: c for c in cells}
    assert by_tag["fused"][4] == "fused/naive 4.00x" and by_tag["fat"][4] == "fat/fused 8.00x slower"
    assert by_tag["fat"][2] == "1"
