"""The CPU backend on several threads: how work is split, that results do not depend on it, and the pools."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest
import threadpoolctl

from backends.cpu import backend as cpu_backend
from backends.cpu import parallel
from backends.cpu.parallel import WorkerPool, check_threads, split, threads_from_env
from planner.backend import BackendError, BackendUnavailable
from planner.core import examples
from planner.core.cost import load_device
from planner.core.errors import UsageError
from planner.core.graph import TensorType
from planner.core.machine import target_isa
from planner.core.reference import execute_graph, random_inputs
from planner.core.regions import whole_graph_region
from planner.egraph.candidates import build_candidates
from planner.pipeline import PlanOptions
from planner.registry import get_backend

SPEC = load_device("seed-k4")


def cpu(threads: int, tile_bytes: int | None = None, gemm_library: str | None = None):  # noqa: ANN201
    from backends.cpu.backend import CpuBackend

    try:
        return CpuBackend(SPEC, threads=threads, tile_bytes=tile_bytes, gemm_library=gemm_library)
    except BackendUnavailable as exc:
        pytest.skip(f"no C compiler: {exc}")


@pytest.mark.parametrize("total,parts,align", [(10, 3, 1), (100_003, 4, 16), (5, 8, 1), (64, 2, 16), (1, 1, 16)])
def test_split_covers_the_range_in_order(total: int, parts: int, align: int) -> None:
    bounds = split(total, parts, align)
    assert bounds[0][0] == 0 and bounds[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    assert all(start % align == 0 for start, _ in bounds)
    assert all(end > start for start, end in bounds) and len(bounds) <= parts


def test_thread_count_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FUSION_PLANNER_THREADS", raising=False)
    assert threads_from_env() == parallel.available_cores()
    monkeypatch.setenv("FUSION_PLANNER_THREADS", "3")
    assert threads_from_env() == 3 and check_threads(None) == 3
    monkeypatch.setenv("FUSION_PLANNER_THREADS", "0")
    assert threads_from_env() == parallel.available_cores()
    for bad in ("two", "-1"):
        monkeypatch.setenv("FUSION_PLANNER_THREADS", bad)
        with pytest.raises(UsageError, match="FUSION_PLANNER_THREADS"):
            threads_from_env()
    for bad_count in (0, -2, 1.5, True):
        with pytest.raises(BackendError, match="positive integer"):
            check_threads(bad_count)  # type: ignore[arg-type]


def test_a_failing_task_is_raised_after_every_task_ended() -> None:
    pool = WorkerPool(3)
    done: list[int] = []
    lock = threading.Lock()

    def ok(i: int) -> None:
        with lock:
            done.append(i)

    def fail() -> None:
        raise ValueError("worker 1 failed")

    with pytest.raises(ValueError, match="worker 1 failed"):
        pool.run([lambda: ok(0), fail, lambda: ok(2)])
    assert sorted(done) == [0, 2]
    pool.run([lambda: ok(3)])  # one task runs on the caller: not a parallel run
    assert pool.parallel_runs == 1
    pool.close()


def _same_on_threads(plan, graph, threads: int, exact: bool = True, workers: bool = True, **kw) -> list[dict]:  # noqa: ANN001
    """Run ``plan`` on 1 and on ``threads`` threads: loops give identical bits (each element is computed by
    the same code whichever thread runs it); BLAS may round a block of other height differently."""
    inputs = random_inputs(graph, seed=3)
    one = cpu(1, **kw).compile(plan).run(inputs)
    backend = cpu(threads, **kw)
    compiled = backend.compile(plan)
    many = compiled.run(inputs)
    for a, b in zip(one, many, strict=True):
        assert np.array_equal(a, b) if exact else np.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert backend.pool.parallel_runs >= 1 or not workers
    return compiled.kernel_facts


def test_flat_loops_split_into_aligned_ranges_with_identical_results() -> None:
    graph = examples.ew_chain(4, 3 * parallel.MIN_ELEMENTS_PER_THREAD + 5)
    cands = build_candidates(graph, SPEC)
    for plan in (min(cands.plans, key=lambda p: len(p.kernels)), cands.unfused):
        facts = _same_on_threads(plan, graph, 3)
        assert all(f["threads"] == 3 for f in facts)


def test_broadcast_loops_split_by_rows_and_gemms_by_row_blocks(monkeypatch) -> None:
    from backends.cpu import gemm as gemm_module

    monkeypatch.setenv(gemm_module.WEIGHTS_ENV, "given")  # the libraries' routes (packed weights: oneDNN's)
    graph = examples.mlp_epilogue(256, 256, 64, "fp32")
    cands = build_candidates(graph, SPEC)
    unfused = _same_on_threads(cands.unfused, graph, 2, exact=False)  # BiasAdd reads its bias by column
    assert [f["threads"] for f in unfused] == [2] * len(unfused)
    for library in ("numpy", "torch"):
        if library == "torch":
            pytest.importorskip("torch")
        # torch's GEMM is split by torch itself; these tiles' epilogues are too small to split
        fused = _same_on_threads(cands.best, graph, 2, exact=False, workers=library == "numpy", tile_bytes=1 << 16,
                                 gemm_library=library)
        (gemm,) = fused
        assert gemm["impl"] == f"{library}-gemm+c-epilogue" and gemm["threads"] == 2 and gemm["tiles"] >= 2


def test_a_torch_gemm_runs_on_the_plans_threads_and_its_epilogue_on_the_workers(monkeypatch) -> None:
    """torch.mm gets the plan's thread count (restored afterwards), each tile's epilogue is split by rows
    across the workers (the tile pointer offset to each part), and the result agrees with the reference."""
    torch = pytest.importorskip("torch")
    graph = examples.mlp_epilogue(512, 512, 64, "fp32")
    plan = build_candidates(graph, SPEC).best
    backend = cpu(2, tile_bytes=256 * (512 + 64) * 4, gemm_library="torch")
    compiled = backend.compile(plan)
    assert compiled.kernel_facts[0]["tiles"] == 2
    seen: list[int] = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda *a, **k: (seen.append(torch.get_num_threads()), real_mm(*a, **k))[1])
    torch.set_num_threads(1)
    inputs = random_inputs(graph, seed=4)
    got = compiled.run(inputs)[0]
    assert set(seen) == {2} and len(seen) == compiled.kernel_facts[0]["tiles"] and torch.get_num_threads() == 1
    assert backend.pool.parallel_runs >= len(seen)
    np.testing.assert_allclose(got, execute_graph(graph, inputs)[0], rtol=1e-4, atol=1e-4)


def test_the_gemm_library_is_chosen_checked_and_in_the_cache_key(monkeypatch) -> None:
    from backends.cpu import gemm

    monkeypatch.setenv(gemm.GEMM_ENV, "mkl")
    with pytest.raises(UsageError, match="FUSION_PLANNER_CPU_GEMM='mkl'"):
        cpu(1)
    monkeypatch.setenv(gemm.GEMM_ENV, "numpy")
    assert cpu(1).gemm_library == "numpy"
    monkeypatch.delenv(gemm.GEMM_ENV)
    with monkeypatch.context() as m:
        m.delitem(sys.modules, "torch", raising=False)
        assert gemm.library_from_env() == "numpy"  # auto, torch not imported: numpy, without importing it
        assert "torch" not in sys.modules
    graph = examples.ew_chain(2, 1000)
    region = whole_graph_region(graph)
    options = PlanOptions("cpu", SPEC, ())
    assert options.cache_key(region, cpu(1, gemm_library="numpy")) != options.cache_key(region, cpu(1, gemm_library="torch"))


def test_small_kernels_stay_on_the_calling_thread() -> None:
    graph = examples.ew_chain(2, 1000)
    backend = cpu(4)
    compiled = backend.compile(build_candidates(graph, SPEC).unfused)
    compiled.run(random_inputs(graph))
    assert backend.pool.parallel_runs == 0
    assert all(f["threads"] == 1 for f in compiled.kernel_facts)


def test_thread_count_is_part_of_the_plan_cache_key() -> None:
    graph = examples.ew_chain(2, 1000)
    options = PlanOptions("cpu", SPEC, ())
    region = whole_graph_region(graph)
    keys = {options.cache_key(region, cpu(t)) for t in (1, 2)}
    assert len(keys) == 2
    assert get_backend("cpu", SPEC, threads=2).identity.startswith("cpu threads=2 gemm=")


def test_the_kernels_code_is_part_of_the_plan_cache_key(monkeypatch: pytest.MonkeyPatch) -> None:
    before = cpu(1).identity
    assert f"kernels={cpu_backend.kernels_fingerprint()}" in before
    monkeypatch.setattr(cpu_backend, "kernels_fingerprint", lambda: "another-version")
    assert cpu(1).identity != before  # a plan timed with other kernels never answers
    monkeypatch.undo()
    other = "native" if target_isa() == "avx2" else "avx2"
    monkeypatch.setenv("FUSION_PLANNER_CPU_ISA", other)
    assert cpu(1).identity != before  # nor one timed with the other ISA's code (AVX-512 on an AVX2-narrowed run)
    with pytest.raises(UsageError, match="thread count"):
        get_backend("model", SPEC, threads=2)


def test_torch_threads_set_while_the_block_runs_and_restored() -> None:
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    with parallel.torch_threads(1 if before != 1 else 2):
        assert torch.get_num_threads() != before
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("argv", [["run", "plan.json", "--threads", "0"], ["plan", "--example", "ew-chain", "--threads", "x"]])
def test_cli_refuses_a_bad_thread_count(argv: list[str]) -> None:
    r = subprocess.run([sys.executable, "-m", "planner", *argv], capture_output=True, text=True)
    assert r.returncode == 2 and "--threads" in r.stderr


def test_cli_refuses_threads_for_a_backend_without_them() -> None:
    r = subprocess.run([sys.executable, "-m", "planner", "plan", "--example", "ew-chain", "--backend", "model",
                        "--threads", "2", "--no-cache"], capture_output=True, text=True)
    assert r.returncode == 2 and "thread count applies to the cpu backend" in r.stderr


def test_inputs_in_the_stored_layout_are_read_in_place_and_outputs_are_fresh() -> None:
    graph = examples.ew_chain(2, 4096)
    backend = cpu(2)
    compiled = backend.compile(build_candidates(graph, SPEC).unfused)
    x = random_inputs(graph, seed=0)["x"]
    before = x.copy()
    first = compiled.run({"x": x})[0]
    second = compiled.run({"x": x})[0]
    assert compiled.loads == 0 and compiled.binds == 2  # no copy of x
    assert np.array_equal(x, before)  # read, never written
    assert first is not second and not np.shares_memory(first, second) and np.array_equal(first, second)
    strided = np.repeat(x, 2)[::2]  # not contiguous: copied into the plan's own buffer
    assert np.array_equal(compiled.run({"x": strided})[0], first) and compiled.loads == 1
    strided[:] = -strided  # the same writable array, changed: copied again, never taken as it was
    assert np.array_equal(compiled.run({"x": strided})[0], compiled.run({"x": -x})[0]) and compiled.loads == 2
    frozen = np.repeat(x, 2)[::2]
    frozen.setflags(write=False)  # read-only (a bound parameter): copied once, then kept
    for _ in range(3):
        compiled.run({"x": frozen})
    assert compiled.loads == 3
    compiled.execute()  # the bare kernels write the plan's own output buffer, not the last returned array
    assert np.array_equal(second, first)
    with pytest.raises(BackendError, match="has shape"):
        compiled.run({"x": x[:10]})


def test_an_output_array_is_reused_only_once_nothing_refers_to_it() -> None:
    graph = examples.ew_chain(2, 4096)
    compiled = cpu(1).compile(build_candidates(graph, SPEC).best)
    x = random_inputs(graph, seed=0)["x"]
    kept = compiled.run({"x": x})[0]
    view = compiled.run({"x": x})[0][::2]  # only a view survives: its array is still in use
    assert compiled.reused == 0
    compiled.run({"x": x})  # dropped at once
    out = compiled.run({"x": x})[0]
    assert compiled.reused == 1
    assert not np.shares_memory(out, kept) and not np.shares_memory(out, view)
    assert all(a.ctypes.data % 64 == 0 for a in (kept, out))  # on a cache line, as the plan's own buffers
    torch = pytest.importorskip("torch")
    held = torch.from_numpy(out)  # a tensor over the array keeps it alive too
    del out
    again = compiled.run({"x": x})[0]
    assert not np.shares_memory(again, held.numpy())


def test_the_bare_kernels_write_where_the_last_call_handed_out_a_dropped_output() -> None:
    graph = examples.ew_chain(2, 4096)
    compiled = cpu(1).compile(build_candidates(graph, SPEC).best)
    x = random_inputs(graph, seed=0)["x"]
    want = compiled.run({"x": x})[0].copy()
    address = compiled.run({"x": x})[0].ctypes.data  # handed out, then dropped
    compiled.execute()  # the memory the calls write, not a buffer of its own: they see the same caches
    out = compiled.run({"x": x})[0]
    assert out.ctypes.data == address and np.array_equal(out, want)
    out[:] = -1.0  # held by the caller: the bare kernels leave it alone
    compiled.execute()
    assert np.all(out == -1.0)


def test_an_output_named_twice_gets_two_arrays_with_the_same_values() -> None:
    from planner.core.graph import GraphBuilder

    b = GraphBuilder("twice")
    b.input("x", (64,), "fp32")
    b.op("r", "Relu", ["x"])
    graph = b.build(["r", "r", "x"])
    compiled = cpu(1).compile(build_candidates(graph, SPEC).unfused)
    x = random_inputs(graph, seed=0)["x"]
    r1, r2, x_out = compiled.run({"x": x})
    assert np.array_equal(r1, np.maximum(x, 0)) and np.array_equal(r1, r2) and not np.shares_memory(r1, r2)
    assert np.array_equal(x_out, x) and not np.shares_memory(x_out, x)  # an input as output: a copy


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("threads", [1, 3])
def test_streaming_stores_give_the_same_bits_at_any_offset_and_length(dtype: str, threads: int) -> None:
    graph = examples.ew_chain(3, 3 * parallel.MIN_ELEMENTS_PER_THREAD + 1037, dtype)  # not a multiple of a block
    plan = min(build_candidates(graph, SPEC).plans, key=lambda p: len(p.kernels))
    inputs = random_inputs(graph, seed=5)
    plain = cpu(threads).compile(plan)
    backend = cpu(threads)
    backend.stream_bytes = 0  # every output streams
    streamed = backend.compile(plan)
    assert [f["streaming_stores"] for f in streamed.kernel_facts] == [dtype == "fp32"]  # fp32 outputs only
    assert not plain.kernel_facts[0]["streaming_stores"]
    assert np.array_equal(plain.run(inputs)[0], streamed.run(inputs)[0])


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("workload", ["layer_norm", "rms_norm", "softmax"])
def test_streaming_row_kernels_give_the_same_bits(workload: str, threads: int) -> None:
    """A row kernel past the streaming threshold stages each row and stores it with non-temporal stores
    (or copies it, where the row does not start on a line): the same bits as plain stores, into fresh
    outputs (any alignment) and into the plan's own buffers."""
    rows = 3 * parallel.MIN_ELEMENTS_PER_THREAD // 256 + 5
    graph = {"layer_norm": lambda: examples.layer_norm(rows, 256),
             "rms_norm": lambda: examples.rms_norm(rows, 256, "fp32"),
             "softmax": lambda: examples.softmax(rows, 256)}[workload]()
    plan = min(build_candidates(graph, SPEC).plans, key=lambda p: len(p.kernels))
    assert len(plan.kernels) == 1 and plan.kernels[0].kind == "elementwise"
    inputs = random_inputs(graph, seed=7)
    plain = cpu(threads).compile(plan)
    backend = cpu(threads)
    backend.stream_bytes = 0  # every output streams
    streamed = backend.compile(plan)
    assert streamed.kernel_facts[0]["streaming_stores"] and not plain.kernel_facts[0]["streaming_stores"]
    want = plain.run(inputs)[0]
    held = streamed.run(inputs)[0]
    assert np.array_equal(want, held)
    streamed.execute()  # into the plan's own (aligned) buffer: the caller holds the array the call handed out
    assert np.array_equal(want, streamed.buffers[plan.outputs[0]])


def _kernel_sources(graph) -> list[str]:  # noqa: ANN001
    from backends.cpu.codegen import generate

    cands = build_candidates(graph, SPEC)
    types = {n: (tuple(t.shape), t.dtype) for p in cands.plans for n, t in p.tensors.items()}
    return list(dict.fromkeys(generate(k.body, types).source for p in cands.plans for k in p.kernels))


def test_a_started_batch_compiles_while_the_caller_works_and_its_finish_waits(tmp_path) -> None:  # noqa: ANN001
    from backends.cpu.compiler import Compiler

    sources = _kernel_sources(examples.ew_chain(2, 64))
    compiler = Compiler(directory=tmp_path)
    finish = compiler.start_many(sources)
    assert not list(tmp_path.glob("b*.so"))  # nothing done until finished
    assert finish() == len(sources) and compiler.compiled == len(sources)
    assert len(list(tmp_path.glob("b*.so"))) == 1 and not [p for p in tmp_path.iterdir() if p.is_dir()]
    assert compiler.start_many(sources)() == 0  # cached: nothing started
    x = np.linspace(-2, 2, 64, dtype=np.float32)
    out = np.empty_like(x)
    compiler.function(sources[0], 2)(x.ctypes.data, out.ctypes.data, 0, 1, 64)
    assert np.all(np.isfinite(out))


def test_batched_builds_compile_each_kernel_once_and_load_like_single_builds(tmp_path) -> None:  # noqa: ANN001
    from backends.cpu.compiler import Compiler

    sources = _kernel_sources(examples.ew_chain(3, 64))
    assert len(sources) >= 4
    batched = Compiler(directory=tmp_path / "batched")
    assert batched.build_many(sources, jobs=2) == len(sources)
    assert len(list((tmp_path / "batched").glob("b*.so"))) == 2 and not list((tmp_path / "batched").glob("k*.so"))
    assert batched.build_many(sources, jobs=2) == 0  # all cached now
    alone = Compiler(directory=tmp_path / "alone")
    x = np.linspace(-2, 2, 64, dtype=np.float32)
    for src in sources:
        outs = []
        for c in (batched, alone):
            out = np.empty_like(x)
            c.function(src, 2)(x.ctypes.data, out.ctypes.data, 0, 1, 64)
            outs.append(out)
        assert np.array_equal(*outs)
    assert batched.compiled == len(sources)  # loading compiled nothing more


def test_window_kernels_of_several_shapes_share_a_batch(tmp_path, caplog) -> None:  # noqa: ANN001
    """Depthwise convolutions and average poolings of several windows compile as one translation unit: their
    helper functions are renamed per kernel like the kernels (a MobileNet's blocks once fell back to one compiler
    run per kernel on their duplicate definitions)."""
    from backends.cpu.compiler import Compiler
    from backends.cpu.standalone import depthwise_source, pool_source
    from planner.core.plans import Expr, Load

    sources = []
    for k, c in ((3, 16), (5, 24), (7, 32)):
        window = {"height": 9, "width": 9, "kh": k, "kw": k, "sh": 1, "sw": 1, "ph": k // 2, "pw": k // 2,
                  "dh": 1, "dw": 1}
        out = TensorType((81, c), "fp32")
        sources.append(depthwise_source(Expr("DepthwiseConv", (Load("x"), Load("w")), tuple(window.items()), "o", out)))
        pooled = {**window, "include_pad": 0, "divisor": 0}
        sources.append(pool_source(Expr("AvgPool", (Load("x"),), tuple(pooled.items()), "o", out)))
    compiler = Compiler(directory=tmp_path)
    assert compiler.build_many(sources, jobs=1) == len(sources)
    assert "one by one" not in caplog.text and len(list(tmp_path.glob("b*.so"))) == 1


def test_a_failed_or_altered_batch_costs_nothing_but_time(tmp_path, caplog) -> None:  # noqa: ANN001
    from backends.cpu.compiler import Compiler
    from backends.cpu.prelude import PRELUDE

    good = _kernel_sources(examples.ew_chain(1, 64))
    bad = PRELUDE + "void fp_kernel(const float* t0, float* out, int64_t r0, int64_t r1, int64_t cols) { nonsense; }\n"
    c = Compiler(directory=tmp_path)
    c.build_many([*good, bad], jobs=1)  # one translation unit: the bad kernel fails it
    assert "compiled one by one" in caplog.text and not list(tmp_path.glob("b*.so"))
    c.function(good[0], 2)  # built alone on first use
    fresh = Compiler(directory=tmp_path / "second")
    fresh.build_many(good, jobs=1)
    (batch,) = (tmp_path / "second").glob("b*.so")
    batch.write_bytes(batch.read_bytes() + b"tampered")
    again = Compiler(directory=tmp_path / "second")
    again.function(good[0], 2)  # the seal no longer matches: the kernel is built on its own
    assert again.compiled == 1 and "altered batch" in caplog.text


def test_auto_takes_the_gemm_library_measured_faster_here_once_per_machine(monkeypatch, tmp_path) -> None:
    """With torch loaded, auto times both libraries once and keeps the record; torch keeps it within the margin."""
    pytest.importorskip("torch")
    from backends.cpu import gemm

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(gemm.GEMM_ENV, raising=False)
    timings = iter([{"numpy": 0.8, "torch": 1.0}, {"numpy": 0.98, "torch": 1.0}])
    measured = []
    monkeypatch.setattr(gemm, "_time_libraries", lambda: measured.append(1) or next(timings))
    gemm.measured_library.cache_clear()
    try:
        assert gemm.library_from_env() == "numpy" and len(measured) == 1
        gemm.measured_library.cache_clear()  # a new process: the record answers
        assert gemm.library_from_env() == "numpy" and len(measured) == 1
        record = tmp_path / "fusion-planner" / "cpu" / gemm.PROBE_FILE
        record.write_text(record.read_text().replace('"numpy"', '"mkl"', 1).replace('"choice": "numpy"', '"choice": "mkl"'))
        gemm.measured_library.cache_clear()  # a tampered record is measured again: 2% is within the margin
        assert gemm.library_from_env() == "torch" and len(measured) == 2
    finally:
        gemm.measured_library.cache_clear()


def _two_products():
    """A plan of two GEMM kernels whose weights differ in shape: 64x256x1024 (``gate_up.w``), 64x512x256
    (``down.w``)."""
    graph = examples.token_mlp(64, 1000, 256, 512, "fp32")
    plan = next(p for p in build_candidates(graph, load_device("h200")).plans
                if sum(k.kind.name in ("GEMM_EPILOGUE", "CUBLASLT") for k in p.kernels) == 2)
    return graph, plan


def _faster_where(wins: dict[tuple[int, int, int], str], measured: list):
    """A stand-in for ``gemm.time_layouts``: the layout ``wins`` names for a shape is twice as fast as the rest."""
    def timings(mm, packs, shapes, pool=None, threads=1):
        (shape,) = shapes
        measured.append((shape, packs) if threads == 1 else (shape, packs, threads, pool is not None))
        layouts = ("packed", "padded", "given") if packs else ("padded", "given")
        return {layout: [0.5 if wins.get(shape) == layout else 1.0] for layout in layouts}
    return timings


def test_auto_lays_each_weight_out_as_its_own_products_shape_measured_fastest(monkeypatch, tmp_path) -> None:
    """auto times the layouts on each product's shape, once: each weight gets its own shape's choice; the record
    answers a new process; a tampered record is measured again; a forced layout holds for every product; a bad
    value names the variable; the layout is in the plan-cache key."""
    from backends.cpu import gemm

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(gemm.WEIGHTS_ENV, raising=False)
    monkeypatch.setattr(gemm, "packing_error", lambda dtype: "RuntimeError: no oneDNN")  # packed is not timed
    measured: list = []
    monkeypatch.setattr(gemm, "time_layouts", _faster_where({(64, 256, 1024): "padded"}, measured))
    graph, plan = _two_products()
    gemm.forget_layouts()
    try:
        compiled = cpu(1).compile(plan)
        assert compiled.padded == {"gate_up.w"} and sorted(measured) == [((64, 256, 1024), False),
                                                                         ((64, 512, 256), False)]
        inputs = random_inputs(graph)
        np.testing.assert_allclose(compiled.run(inputs)[0], execute_graph(graph, inputs)[0], rtol=1e-4, atol=1e-4)
        gemm.forget_layouts()  # a new process: the records answer
        assert cpu(1).compile(plan).padded == {"gate_up.w"} and len(measured) == 2
        for record in (tmp_path / "fusion-planner" / "cpu").glob(f"{gemm.LAYOUT_KIND}-*.json"):
            record.write_text(record.read_text().replace('"choice": "padded"', '"choice": "diagonal"'))
        monkeypatch.setattr(gemm, "time_layouts", _faster_where({}, measured))
        gemm.forget_layouts()  # a tampered record is measured again
        assert cpu(1).compile(plan).padded == frozenset() and len(measured) == 3
    finally:
        gemm.forget_layouts()
    monkeypatch.setenv(gemm.WEIGHTS_ENV, "padded")
    assert cpu(1).compile(plan).padded == {"gate_up.w", "down.w"} and len(measured) == 3
    monkeypatch.setenv(gemm.WEIGHTS_ENV, "diagonal")
    with pytest.raises(UsageError, match="FUSION_PLANNER_CPU_WEIGHTS='diagonal'"):
        cpu(1)
    monkeypatch.setenv(gemm.WEIGHTS_ENV, "packed")
    with pytest.raises(BackendError, match="FUSION_PLANNER_CPU_WEIGHTS=packed, but fp32 weights cannot be packed here"):
        cpu(1)
    region = whole_graph_region(examples.ew_chain(2, 1000))
    keys = set()
    for layout in ("padded", "given", "auto"):
        monkeypatch.setenv(gemm.WEIGHTS_ENV, layout)
        assert cpu(1).weights == (gemm.PER_SHAPE if layout == "auto" else layout)
        keys.add(PlanOptions("cpu", SPEC, ()).cache_key(region, cpu(1)))
    assert len(keys) == 3


def test_the_measured_choice_holds_in_a_process_that_loaded_another_blas(monkeypatch, tmp_path) -> None:
    """The record's key names numpy's own BLAS, not every BLAS the process has loaded: a process that imported
    jax (and with it scipy's OpenBLAS) reads the choice another process measured, instead of measuring it again."""
    from backends.cpu import gemm

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measured: list = []
    monkeypatch.setattr(gemm, "time_layouts", _faster_where({(64, 256, 1024): "padded"}, measured))
    scipy_blas = {"user_api": "blas", "internal_api": "openblas", "version": "0.3.30",
                  "filepath": "/site-packages/scipy.libs/libscipy_openblas.so"}
    gemm.forget_layouts()
    try:
        assert gemm.shape_layout("numpy", False, (64, 256, 1024)) == "padded" and len(measured) == 1
        loaded = [*threadpoolctl.threadpool_info(), scipy_blas]
        monkeypatch.setattr(threadpoolctl, "threadpool_info", lambda: loaded)
        monkeypatch.setattr(gemm, "threadpool_info", lambda: loaded, raising=False)
        gemm.forget_layouts()  # a new process, scipy's BLAS loaded too
        assert gemm.shape_layout("numpy", False, (64, 256, 1024)) == "padded" and len(measured) == 1
        numpy_blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        assert gemm._layout_key("numpy")["blas"] == [f"{numpy_blas['name']} {numpy_blas['version']}"]
    finally:
        gemm.forget_layouts()


def test_a_product_is_timed_on_the_rows_of_one_tile(monkeypatch, tmp_path) -> None:
    """The library multiplies a tile at a time: a product taller than a tile is timed on a tile's rows."""
    from backends.cpu import gemm
    from backends.cpu.memory import gemm_tile_rows

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(gemm.WEIGHTS_ENV, raising=False)
    monkeypatch.setattr(gemm, "packing_error", lambda dtype: "RuntimeError: no oneDNN")
    measured: list = []
    monkeypatch.setattr(gemm, "time_layouts", _faster_where({}, measured))
    _, plan = _two_products()
    gemm.forget_layouts()
    try:
        cpu(1, tile_bytes=64 * 1024).compile(plan)
    finally:
        gemm.forget_layouts()
    tile = gemm_tile_rows(64, 1024, 256, 64 * 1024)
    assert tile < 64 and ((tile, 256, 1024), False) in measured


def test_auto_packs_fp32_weights_where_oneDNN_beats_the_better_stored_layout(monkeypatch, tmp_path) -> None:
    """Where torch packs fp32, auto times the packed product too and takes it for a shape only where it beats the
    better of padded and given by the rule; never for a product too small to pay for oneDNN's call; the weights
    it takes it for are packed, and the plan agrees with the reference."""
    pytest.importorskip("torch")
    from backends.cpu import gemm

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(gemm.WEIGHTS_ENV, raising=False)
    assert gemm.choose_layout({"packed": [0.6], "padded": [0.7], "given": [1.0]}) == "packed"
    assert gemm.choose_layout({"packed": [0.7], "padded": [0.7], "given": [1.0]}) == "padded"  # a tie: not packed
    assert gemm.choose_layout({"packed": [0.8], "padded": [1.0], "given": [0.8]}) == "given"  # the better stored one
    if gemm.packing_error("fp32") is not None:
        pytest.skip(f"fp32 does not pack here: {gemm.packing_error('fp32')}")
    measured: list = []
    monkeypatch.setattr(gemm, "time_layouts", _faster_where({(64, 256, 1024): "packed", (64, 512, 256): "packed"},
                                                            measured))
    graph, plan = _two_products()
    gemm.forget_layouts()
    try:
        compiled = cpu(1).compile(plan)
        assert compiled.memory.packable == {"gate_up.w", "down.w"} and compiled.padded == frozenset()
        assert all(packs for _, packs in measured)
        held = {name: a.copy() for name, a in random_inputs(graph).items()}
        for name in ("gate_up.w", "down.w"):
            held[name].setflags(write=False)  # a bound parameter: packed once
        np.testing.assert_allclose(compiled.run(held)[0], execute_graph(graph, held)[0], rtol=1e-4, atol=1e-4)
        assert compiled.packs == 2
        gemm.forget_layouts()
        small = cpu(1)
        small.pack_min_macs = 10 * 2**20  # 64x512x256 (8.4M) is now too small to pack
        assert small.compile(plan).memory.packable == {"gate_up.w"} and ((64, 512, 256), False) in measured
    finally:
        gemm.forget_layouts()
    region = whole_graph_region(examples.ew_chain(2, 1000))
    keys = set()
    for layout in (*gemm.WEIGHT_LAYOUTS, "auto"):
        monkeypatch.setenv(gemm.WEIGHTS_ENV, layout)
        keys.add(PlanOptions("cpu", SPEC, ()).cache_key(region, cpu(1)))
    assert len(keys) == 4


def test_on_several_threads_each_layout_is_timed_as_the_plan_runs_it_and_recorded_apart(monkeypatch, tmp_path) -> None:
    """A backend of two threads times each product's layouts on its own pool (numpy's row blocks split over it),
    and its record is its own: a one-thread backend's choice does not answer it, nor its choice the other's."""
    from backends.cpu import gemm

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(gemm.WEIGHTS_ENV, raising=False)
    monkeypatch.setattr(gemm, "packing_error", lambda dtype: "RuntimeError: no oneDNN")
    measured: list = []
    monkeypatch.setattr(gemm, "time_layouts", _faster_where({(64, 256, 1024): "padded"}, measured))
    _, plan = _two_products()
    gemm.forget_layouts()
    try:
        assert cpu(1, gemm_library="numpy").compile(plan).padded == {"gate_up.w"} and len(measured) == 2
        gemm.forget_layouts()
        monkeypatch.setattr(gemm, "time_layouts", _faster_where({(64, 512, 256): "padded"}, measured))
        assert cpu(2, gemm_library="numpy").compile(plan).padded == {"down.w"}
        assert sorted(measured[2:]) == [((64, 256, 1024), False, 2, True), ((64, 512, 256), False, 2, True)]
        gemm.forget_layouts()
        assert cpu(1, gemm_library="numpy").compile(plan).padded == {"gate_up.w"}
        assert cpu(2, gemm_library="numpy").compile(plan).padded == {"down.w"} and len(measured) == 4  # both answered by their records
    finally:
        gemm.forget_layouts()


def test_a_product_split_over_a_pool_computes_every_row_and_the_probe_times_it() -> None:
    from backends.cpu import gemm

    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((70, 40), dtype=np.float32), rng.standard_normal((40, 24), dtype=np.float32)
    out = np.zeros((70, 24), np.float32)
    pool = parallel.WorkerPool(2)
    try:
        gemm.split_product(gemm.numpy_mm, pool)(a, b, out)
        np.testing.assert_allclose(out, a @ b, rtol=1e-5, atol=1e-5)
        assert pool.parallel_runs == 1 and gemm.split_product(gemm.numpy_mm, None) is gemm.numpy_mm
        seconds = gemm.time_layouts(gemm.numpy_mm, shapes=((64, 128, 256),), pool=pool, threads=2)
        assert set(seconds) == {"padded", "given"} and all(min(v) > 0 for v in seconds.values())
    finally:
        pool.close()


def test_the_layout_probe_times_each_layout_of_each_shape() -> None:
    """The probe itself (no stand-in): one time per layout and shape, each a positive number of seconds; the
    packed layout only where asked."""
    from backends.cpu import gemm

    seconds = gemm.time_layouts(gemm.numpy_mm)
    assert set(seconds) == {"padded", "given"}
    assert all(len(v) == len(gemm.LAYOUT_SHAPES) and min(v) > 0 for v in seconds.values())
    pytest.importorskip("torch")
    if gemm.packing_error("fp32") is None:
        seconds = gemm.time_layouts(gemm.numpy_mm, packs=True)
        assert set(seconds) == set(gemm.WEIGHT_LAYOUTS)
        assert all(len(v) == len(gemm.LAYOUT_SHAPES) and min(v) > 0 for v in seconds.values())


def test_an_early_hand_out_wraps_the_arrays_the_kernels_then_write_and_reuses_them_once_dropped() -> None:
    graph = examples.ew_chain(2, 4096)
    compiled = cpu(1).compile(build_candidates(graph, SPEC).best)
    x = random_inputs(graph, seed=0)["x"]
    want = compiled.run({"x": x})[0].copy()
    seen: list[list[np.ndarray]] = []

    def hand_out(arrays: list[np.ndarray]) -> list[np.ndarray]:
        seen.append([a.copy() for a in arrays])  # what the arrays hold when handed out early: not yet written
        return arrays

    (kept,) = compiled.run_handed({"x": x}, hand_out, early=True)
    assert np.array_equal(kept, want)
    reused = compiled.reused
    address = compiled.run_handed({"x": x}, hand_out, early=True)[0].ctypes.data  # dropped at once
    out = compiled.run_handed({"x": x}, hand_out, early=True)[0]
    assert compiled.reused == reused + 1 and out.ctypes.data == address and np.array_equal(out, want)
    assert not np.shares_memory(out, kept) and np.array_equal(kept, want)  # the kept one is left alone
    compiled.execute()  # the bare kernels: into the plan's own buffer while ``out`` is held
    out[:] = -1.0
    compiled.execute()
    assert np.all(out == -1.0) and np.array_equal(compiled.run({"x": x})[0], want)
    late = compiled.run_handed({"x": x}, lambda arrays: [a.sum() for a in arrays])  # a hand-out that reads values
    assert np.allclose(late[0], want.sum(), rtol=1e-5)
