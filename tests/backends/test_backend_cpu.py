"""The CPU-side backends: generated C kernels (cpu), the cost model (model), numpy (reference)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re
import shutil
import subprocess

import numpy as np
import pytest

from backends.cpu import gemm
from backends.cpu.codegen import CodegenError, generate, noop_source
from backends.cpu.compiler import Compiler, CompilerUnavailable
from backends.cpu.prelude import PRELUDE
from planner.backend import BackendError, BackendUnavailable
from planner.core import examples
from planner.core.cost import device_from_json, load_device
from planner.core.dtypes import numpy_dtype
from planner.core.errors import UsageError
from planner.core.graph import Graph, GraphBuilder, TensorType
from planner.core.kinds import KernelKind
from planner.core.ops import OPS
from planner.core.plans import Expr, Load, Plan
from planner.core.reference import execute_graph, execute_plan, random_inputs
from planner.core.tolerance import check_outputs
from planner.egraph.candidates import build_candidates
from planner.registry import get_backend

SPEC = load_device("seed-k4")
#: (rtol, atol) per stored dtype, as the search compares (kept here until planner.core.tolerance lands)
TOL = {"fp32": (1e-4, 1e-5), "fp16": (1e-2, 2e-3), "bf16": (5e-2, 2e-2)}


def cpu_backend(tile_bytes: int | None = None, fma: bool | None = None, threads: int = 1):
    from backends.cpu.backend import CpuBackend

    try:
        return CpuBackend(SPEC, compiler=Compiler(fma=fma), tile_bytes=tile_bytes, threads=threads)
    except BackendUnavailable as exc:
        pytest.skip(f"no C compiler: {exc}")


def close(actual: np.ndarray, expected: np.ndarray, dtype: str) -> bool:
    rtol, atol = TOL[dtype]
    scale = max(1.0, float(np.max(np.abs(expected))))
    return bool(np.all(np.abs(actual - expected) <= atol * scale + rtol * np.abs(expected)))


# ---------------------------------------------------------------- graphs


def random_graph(seed: int, n_ops: int = 5, dtype: str = "fp32") -> Graph:
    """A random elementwise DAG over two inputs (and a bias row), with one or two outputs."""
    rng = random.Random(seed)
    b = GraphBuilder(f"random-{seed}")
    vals = [b.input("x", (6, 10), dtype), b.input("y", (6, 10), dtype)]
    b.input("bias", (10,), dtype)
    for i in range(n_ops):
        op = rng.choice(["Add", "Mul", "Relu", "Silu", "GeluErf", "Affine", "BiasAdd", "GeluTanh"])
        a = rng.choice(vals[-3:])
        if op in ("Add", "Mul"):
            vals.append(b.op(f"n{i}", op, [a, rng.choice(vals)]))
        elif op == "BiasAdd":
            vals.append(b.op(f"n{i}", op, [a, "bias"]))
        elif op == "Affine":
            vals.append(b.op(f"n{i}", op, [a], {"a": rng.uniform(0.5, 1.5), "b": rng.uniform(-0.1, 0.1)}))
        else:
            vals.append(b.op(f"n{i}", op, [a]))
    outs = [vals[-1]] if seed % 2 else [vals[-1], vals[-2]]
    return b.build(dict.fromkeys(o for o in outs if o not in ("x", "y")))


def opaque_graph() -> Graph:
    b = GraphBuilder("opaque")
    b.input("x", (4, 16), "fp16")
    b.op("a", "Affine", ["x"], {"a": 2.0, "b": 0.5})
    b.op("sm", "Opaque", ["a"], {"impl": "softmax"})
    b.op("out", "Relu", ["sm"])
    return b.build(["out"])


GRAPHS = {
    "mlp-fp32": lambda: examples.mlp_epilogue(40, 24, 16, "fp32"),
    "mlp-fp16": lambda: examples.mlp_epilogue(40, 24, 16, "fp16"),
    "mlp-bf16": lambda: examples.mlp_epilogue(40, 24, 16, "bf16"),
    "mlp-erf-fp16": lambda: examples.mlp_epilogue(9, 8, 8, "fp16", gelu="erf"),
    "ew-chain": lambda: examples.ew_chain(4, 1000),
    "ew-chain-bf16": lambda: examples.ew_chain(3, 777, "bf16"),
    "heavy": lambda: examples.heavy(500),
    "random-1": lambda: random_graph(1),
    "random-2": lambda: random_graph(2, 6, "fp16"),
    "opaque": opaque_graph,
}


@pytest.mark.parametrize("name", list(GRAPHS))
def test_every_candidate_matches_reference_and_counts_model_bytes(name: str) -> None:
    graph = GRAPHS[name]()
    cands = build_candidates(graph, SPEC)
    inputs = random_inputs(graph, seed=3)
    # 3 rows per GEMM tile: several tiles and a ragged last one
    backend = cpu_backend(tile_bytes=3 * 4 * (24 + 16))
    for plan in cands.plans + [cands.unfused]:
        compiled = backend.compile(plan)
        got = compiled.run(inputs)
        want = execute_plan(plan, inputs, mode="device")
        for o, g, w in zip(plan.outputs, got, want, strict=True):
            assert close(g, w, plan.tensors[o].dtype), f"{plan.notation()} {plan.composition()}: {o} differs"
        moved = [f["bytes_moved"] for f in compiled.kernel_facts]
        assert moved == [k.cost.bytes for k in plan.kernels], plan.notation()


def test_gemm_runs_in_row_tiles_within_budget() -> None:
    from backends.cpu.memory import cache_bytes

    default = cpu_backend()
    assert default.tile_bytes == cache_bytes()[0] // 4
    backend = cpu_backend(tile_bytes=4096)
    graph = examples.mlp_epilogue(64, 32, 16, "fp32")
    plan = build_candidates(graph, SPEC).best
    facts = backend.compile(plan).kernel_facts[0]
    assert facts["impl"] == f"{backend.gemm_library}-gemm+c-epilogue"
    assert facts["tile_rows"] * 4 * (32 + 16) <= 4096
    assert facts["tiles"] == -(-64 // facts["tile_rows"]) > 1


def test_unfused_plan_materialises_every_intermediate() -> None:
    graph = examples.ew_chain(3, 300)
    cands = build_candidates(graph, SPEC)
    inputs = random_inputs(graph, seed=1)
    compiled = cpu_backend(fma=False).compile(cands.unfused)  # without contraction: bit-identical to numpy
    compiled.run(inputs)  # binds the inputs; then each kernel's value is read right after it runs
    ops = [n.id for n in graph.ops]
    assert [k.out for k in cands.unfused.kernels] == ops
    buffers = {}
    for step in compiled.steps:  # type: ignore[attr-defined]
        step.call()
        buffers[step.kernel.out] = np.array(step.writes)
    for node in ops:
        sub = GraphBuilder("prefix")
        for n in graph.nodes:
            if n.op == "In":
                sub.input(n.id, n.type.shape, n.type.dtype)
            else:
                sub.op(n.id, n.op, list(n.inputs), n.attr_dict)
            if n.id == node:
                break
        (want,) = execute_graph(sub.build([node]), inputs)
        assert np.array_equal(buffers[node], want.astype(np.float32)), node


def test_intermediates_share_buffers_when_their_lifetimes_do_not_overlap() -> None:
    """A chain's intermediates alternate between two buffers (a kernel never writes what it reads); a value read
    later (a residual) keeps its own until then; outputs never share."""
    b = GraphBuilder("lifetimes")
    b.input("x", (64, 33), "fp32")
    y = "x"
    for i in range(6):
        y = b.op(f"a{i}", "Affine", [y], {"a": 1.5, "b": 0.25})
    res = b.op("res", "Add", [y, "a1"])  # a1 stays live until here
    g = b.build([res, "a3"])  # a3: an output too
    plan = build_candidates(g, SPEC).unfused
    compiled = cpu_backend(fma=False).compile(plan)
    addr = {n: compiled.buffers[n].ctypes.data for n in ("a0", "a1", "a2", "a3", "a4", "a5")}  # type: ignore[attr-defined]
    assert addr["a0"] == addr["a2"] and addr["a1"] not in {addr[n] for n in ("a0", "a2", "a4", "a5")}
    assert addr["a4"] == addr["a0"] != addr["a5"] and list(addr.values()).count(addr["a3"]) == 1
    x = random_inputs(g, seed=2)
    for got, want in zip(compiled.run(x), execute_graph(g, x), strict=True):
        assert np.array_equal(got, want)


def test_fp16_and_bf16_conversions_match_numpy(compiler: Compiler) -> None:
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.99, 65520, 65536, 6e-8, 2.98e-8, 2.9802322e-08,
                        1e-40, 3e38, -1.5, 0.1], dtype=np.float32)
    # halfway cases of both formats (ties to even)
    ties = np.concatenate([(np.arange(1000, dtype=np.uint32) << 13) | 0x1000, (np.arange(1000, dtype=np.uint32) << 16) | 0x8000])
    x = np.concatenate([bits.view(np.float32), special, (ties + 0x38800000).view(np.float32)])
    for dtype in ("fp16", "bf16"):
        out = np.zeros(x.shape, np.uint16)
        _run_convert(compiler, x, "fp32", out, dtype)
        with np.errstate(over="ignore", invalid="ignore"):
            want = x.astype(numpy_dtype(dtype))
        nan = np.isnan(want.astype(np.float32))
        assert np.array_equal(np.isnan(out.view(numpy_dtype(dtype)).astype(np.float32)), nan)
        assert np.array_equal(out[~nan], want.view(np.uint16)[~nan]), dtype
        # every 16-bit pattern widens exactly
        allbits = np.arange(2**16, dtype=np.uint16)
        wide = np.zeros(allbits.shape, np.float32)
        _run_convert(compiler, allbits, dtype, wide, "fp32")
        ref = allbits.view(numpy_dtype(dtype)).astype(np.float32)
        assert np.array_equal(wide, ref, equal_nan=True), dtype


def _run_convert(compiler: Compiler, src: np.ndarray, src_dtype: str, dst: np.ndarray, dst_dtype: str) -> None:
    n = src.size
    body = Expr("Stage", (Load("x"),), (("flops", 1), ("regs", 8), ("temps", 0)), "y", TensorType((n,), dst_dtype))
    ck = generate(body, {"x": ((n,), src_dtype)})
    fn = compiler.function(ck.source, 2)
    fn(src.ctypes.data, dst.ctypes.data, 0, ck.rows, ck.cols)


HOSTILE = 'x;system("rm -rf ~")'


def _rename(e: Expr | Load, f) -> Expr | Load:
    if isinstance(e, Load):
        return Load(f(e.tensor))
    return dataclasses.replace(e, args=tuple(_rename(a, f) for a in e.args), node=f(e.node))


def test_codegen_never_prints_graph_names(compiler: Compiler) -> None:
    graph = examples.mlp_epilogue(8, 8, 8, "fp16")
    cands = build_candidates(graph, SPEC)

    def f(name: str) -> str:
        return f"{HOSTILE}/*{name}*/" if name else name

    backend = cpu_backend()
    inputs = random_inputs(graph, seed=0)
    for plan in (cands.best, cands.unfused):
        kernels = tuple(
            dataclasses.replace(k, body=_rename(k.body, f), out=f(k.out), reads=tuple(map(f, k.reads))) for k in plan.kernels
        )
        evil = Plan(plan.graph, kernels, tuple(map(f, plan.outputs)), {f(n): t for n, t in plan.tensors.items()}, plan.key)
        types = {n: (t.shape, t.dtype) for n, t in evil.tensors.items()}
        for k in evil.kernels:
            src = generate(k.body, types).source if k.kind == "elementwise" else None
            if src is not None:
                kernel_text = src[len(PRELUDE):]
                assert src.startswith(PRELUDE) and "system" not in src and "/*" not in kernel_text
        got = backend.compile(evil).run({f(n): v for n, v in inputs.items()})
        want = execute_plan(plan, inputs)
        assert close(got[0], want[0], "fp16")


def test_kernels_are_cached_by_source_hash(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    try:
        first = Compiler()
    except CompilerUnavailable as exc:
        pytest.skip(f"no C compiler: {exc}")
    from backends.cpu.backend import CpuBackend

    graph = examples.ew_chain(2, 64)
    plan = build_candidates(graph, SPEC).unfused
    CpuBackend(SPEC, compiler=first, threads=1).compile(plan)  # one thread: no native pool is built either
    cached = sorted(p.name for p in (tmp_path / "fusion-planner" / "cpu").glob("*.so"))
    assert first.compiled == len(cached) == len({(k.body.op, k.body.attrs) for k in plan.kernels}) == 3
    second = Compiler()
    out = CpuBackend(SPEC, compiler=second, threads=1).compile(plan).run(random_inputs(graph))
    assert second.compiled == 0
    assert np.isfinite(out[0]).all()


def test_missing_compiler_is_backend_unavailable(monkeypatch) -> None:
    from backends.cpu.backend import CpuBackend

    monkeypatch.setenv("CC", "no-such-compiler-fp")
    with pytest.raises(BackendUnavailable, match="no-such-compiler-fp"):
        CpuBackend(SPEC)


def test_timing_contract() -> None:
    graph = examples.ew_chain(2, 2000)
    compiled = cpu_backend().compile(build_candidates(graph, SPEC).best)
    inputs = random_inputs(graph)
    t = compiled.time(inputs, warmup=1, repeats=5)
    assert len(t.samples_us) == 5 and not t.stopped_early and t.median_us > 0
    calls: list[float] = []
    t = compiled.time(inputs, warmup=0, repeats=9, stop_if=lambda med: calls.append(med) or len(calls) >= 3)
    assert t.stopped_early and len(t.samples_us) == 3 and calls[-1] == t.median_us


def test_bad_input_names_culprit() -> None:
    graph = examples.ew_chain(2, 10)
    compiled = cpu_backend().compile(build_candidates(graph, SPEC).best)
    with pytest.raises(BackendError, match="'x'"):
        compiled.run({"x": np.zeros(11, np.float32)})
    with pytest.raises(BackendError, match="missing input 'x'"):
        compiled.run({})


# ---------------------------------------------------------------- model and reference


def test_model_backend_times_with_the_estimate_and_runs_the_reference() -> None:
    graph = examples.mlp_epilogue(16, 8, 8, "fp16")
    cands = build_candidates(graph, SPEC)
    backend = get_backend("model", SPEC)
    assert backend.measures is False
    inputs = random_inputs(graph)
    for plan in cands.plans[:3]:
        compiled = backend.compile(plan)
        assert compiled.time(inputs).median_us == pytest.approx(plan.est_us)
        assert np.array_equal(compiled.run(inputs)[0], execute_plan(plan, inputs)[0])
        assert [f["bytes_moved"] for f in compiled.kernel_facts] == [k.cost.bytes for k in plan.kernels]


def test_reference_backend_verifies_but_cannot_time() -> None:
    graph = examples.ew_chain(3, 50)
    plan = build_candidates(graph, SPEC).best
    backend = get_backend("reference", SPEC)
    assert backend.measures is False
    compiled = backend.compile(plan)
    inputs = random_inputs(graph)
    assert np.array_equal(compiled.run(inputs)[0], execute_plan(plan, inputs)[0])
    with pytest.raises(BackendError, match="does not time"):
        compiled.time(inputs)


def test_kernel_facts_are_json_ready() -> None:
    graph = examples.mlp_epilogue(8, 8, 8, "bf16")
    compiled = cpu_backend().compile(build_candidates(graph, SPEC).best)
    facts = json.loads(json.dumps(compiled.kernel_facts))
    assert facts[0]["bytes_moved"] == compiled.plan.kernels[0].cost.bytes


# ---------------------------------------------------------------- calibration


def test_calibration_writes_a_spec_that_device_accepts(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # calibrate also refreshes the machine's record there
    try:
        Compiler()
    except CompilerUnavailable as exc:
        pytest.skip(f"no C compiler: {exc}")
    from backends.cpu.calibrate import calibrate_cpu
    from planner.cli import main

    cal = calibrate_cpu(triad_n=1 << 16, gemm_sizes=(32, 64, 128))
    assert cal.triad_gbps > 0 and cal.launch_us > 0 and cal.vector_gflops > 0
    assert set(cal.gemm_gflops) == {32, 64, 128}
    spec = device_from_json(json.loads(json.dumps(cal.spec("t").to_json())))
    assert spec.matmul_tflops["fp16"] == spec.matmul_tflops["fp32"] == pytest.approx(max(cal.gemm_gflops.values()) / 1e3, rel=1e-4)
    out = tmp_path / "cpu.json"
    assert main(["calibrate", "--backend", "cpu", "-o", str(out)]) == 0
    loaded = load_device(str(out))
    assert loaded.name == "cpu-calibrated" and loaded.bandwidth_gbps > 0 and "triad" in loaded.source
    assert build_candidates(examples.ew_chain(2, 100), loaded).best.est_us > 0


def test_calibrate_refuses_other_backends(capsys) -> None:
    from planner.cli import main

    assert main(["calibrate", "--backend", "cupy"]) == 2
    assert "cannot be calibrated" in capsys.readouterr().err


@pytest.mark.parametrize("where, message", [(".", "it is a folder"), ("no/such/dir/x.json", "no such folder")])
def test_calibrate_refuses_an_unwritable_output_before_measuring(where, message, tmp_path, capsys, monkeypatch) -> None:
    from planner.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["calibrate", "--backend", "cpu", "-o", where]) == 2
    assert message in capsys.readouterr().err


def test_blas_threads_are_pinned_while_plans_run(monkeypatch) -> None:
    from threadpoolctl import threadpool_info

    from backends.cpu.backend import CpuBackend
    from backends.cpu.memory import limit_blas_threads

    def numpy_blas_threads() -> list[int]:
        return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas" and "numpy" in i["filepath"]]

    backend = cpu_backend()
    with limit_blas_threads(1, backend.controller):
        assert numpy_blas_threads() == [1]
    monkeypatch.setenv("FUSION_PLANNER_BLAS_THREADS", "two")
    with pytest.raises(UsageError, match="FUSION_PLANNER_BLAS_THREADS"):
        CpuBackend(SPEC)
    monkeypatch.setenv("FUSION_PLANNER_BLAS_THREADS", "0")
    assert cpu_backend().blas_threads is None
    monkeypatch.delenv("FUSION_PLANNER_BLAS_THREADS")
    assert cpu_backend().blas_threads == 1


def test_inconsistent_shapes_are_refused_before_any_c_runs() -> None:
    graph = examples.mlp_epilogue(8, 8, 8, "fp32")
    plan = build_candidates(graph, SPEC).unfused
    backend = cpu_backend()
    small = dict(plan.tensors, bias=TensorType((4, 8), "fp32"))
    with pytest.raises(BackendError, match="'bias'"):
        backend.compile(dataclasses.replace(plan, tensors=small))
    skinny = dict(plan.tensors, w=TensorType((8, 4), "fp32"))
    with pytest.raises(BackendError, match="GEMM operands"):
        backend.compile(dataclasses.replace(plan, tensors=skinny))


# ---------------------------------------------------------------- vectorisation and NaN


def _fused_kernels():
    """The elementwise and GEMM-epilogue kernels of the examples' fused plans, in every dtype."""
    graphs = [examples.ew_chain(8, 4096, dtype) for dtype in ("fp32", "fp16", "bf16")]
    graphs += [examples.mlp_epilogue(64, 256, 128, "fp32", gelu) for gelu in ("tanh", "erf")]
    graphs += [examples.heavy(4096, "fp16"), examples.transformer(1, 64, 8, "fp32", "swiglu")]
    graphs += [examples.rope(2, 16, 128, 2, dtype) for dtype in ("fp32", "bf16")]  # RotateHalf's two half loops
    graphs += [examples.rms_norm(16, 768, dtype, residual=False) for dtype in ("bf16", "fp16")]  # Casts in a row kernel
    for g in graphs:
        cands = build_candidates(g, load_device("h200"), cap=64, k=8)
        tensors = {n.id: (n.type.shape, n.type.dtype) for n in g.nodes}
        for p in cands.plans:
            for k in p.kernels:
                if k.kind == "elementwise" and len(k.ops) > 1:
                    yield g.name, k, generate(k.body, tensors)
                    yield g.name, k, generate(k.body, tensors, stream=True)  # the streaming-store variant


def test_every_fused_kernel_of_the_examples_is_vectorised(compiler):
    """gcc must report the loop over a row vectorised; a select feeding arithmetic once kept it scalar."""
    about = subprocess.run([compiler.cc, "--version"], capture_output=True, text=True).stdout
    if "Free Software Foundation" not in about or "clang" in about.lower():
        pytest.skip(f"the vectorisation report is gcc's; this compiler is {compiler.version}")
    seen = {}  # each distinct source once (building the examples' candidates again per kernel took most of 30 s)
    for name, k, ck in _fused_kernels():
        seen.setdefault(ck.digest, (f"{name}: {k.describe()}", ck))
    assert len(seen) >= 20 and any("fp_stream" in ck.source for _, ck in seen.values())
    failures, blocked = [], 0
    for what, ck in seen.values():
        lines = ck.source.splitlines()
        loop_lines = [i for i, line in enumerate(lines, 1) if "for (int64_t c = " in line]
        report = compiler.vectorisation_report(ck.source)
        if not all(re.search(rf":{line}:\d+: optimized: loop vectorized", report) for line in loop_lines):
            failures.append(what)
        # a block of a row's columns: its loop vectorised, or unrolled and its statements vectorised as a block
        # each block loop's lines, down to its closing brace at the loop's own indentation
        blocks = [range(i, lines.index(line[:len(line) - len(line.lstrip())] + "}", i) + 1)
                  for i, line in enumerate(lines, 1) if "for (int64_t fp_j = " in line]
        blocked += bool(blocks)
        vectorised = {int(n) for n in re.findall(r":(\d+):\d+: optimized: (?:loop|basic block)", report)}
        if not all(vectorised.intersection(b) for b in blocks):
            failures.append(f"{what} (blocks)")
    assert failures == [] and blocked >= 10


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_rows_of_any_width_run_in_overlapping_blocks_and_match_the_reference(dtype, compiler):
    """A bias, hardswish and a residual over rows of widths below, at and between blocks of 16 (the last block
    overlaps the one before it), as one kernel, on 1 and 2 threads."""
    for cols in (7, 16, 17, 24, 37, 72, 100):
        b = GraphBuilder(f"rows-{cols}")
        b.input("x", (13, cols), dtype)
        b.input("r", (13, cols), dtype)
        b.input("bias", (cols,), dtype)
        b.op("h", "Hardswish", [b.op("biased", "BiasAdd", ["x", "bias"])])
        g = b.build([b.op("y", "Add", ["h", "r"])])
        plan = min(build_candidates(g, SPEC).plans, key=lambda p: len(p.kernels))
        assert len(plan.kernels) == 1
        ck = generate(plan.kernels[0].body, {n.id: (n.type.shape, n.type.dtype) for n in g.nodes})
        assert "fp_j" in ck.source
        x = random_inputs(g, seed=cols)
        want = execute_plan(plan, x, mode="device")[0]
        for threads in (1, 2):
            got = cpu_backend(threads=threads).compile(plan).run(x)[0]
            assert close(got, want, dtype), (cols, threads)


def _assembly(compiler, source: str, tmp_path) -> str:
    src = tmp_path / "kernel.c"
    src.write_text(source)
    flags = [f for f in compiler.flags if f not in ("-shared", "-fPIC")]
    subprocess.run([compiler.cc, *flags, "-S", "-o", str(tmp_path / "kernel.s"), str(src)], check=True)
    return (tmp_path / "kernel.s").read_text()


def test_streaming_stores_fill_whole_lines(compiler, tmp_path):
    """Each non-temporal store of a streaming kernel writes a full 64-byte line on AVX-512 targets: with
    256-bit stores gcc interleaved the halves of different lines, and the write-combining buffers flushed
    half lines (half of memcpy's bandwidth at 440 MB)."""
    macros = subprocess.run([compiler.cc, *compiler.flags, "-dM", "-E", "-x", "c", "/dev/null"],
                            capture_output=True, text=True).stdout
    if "__AVX__" not in macros:
        pytest.skip("streaming stores are generated for AVX targets only")
    streamed = [ck for _, _, ck in _fused_kernels() if "fp_stream" in ck.source]
    asm = _assembly(compiler, streamed[0].source, tmp_path)
    stores = re.findall(r"vmovntps\s+%([xyz]mm)", asm)
    assert stores, "the streaming kernel has no non-temporal stores"
    assert set(stores) == ({"zmm"} if "__AVX512F__" in macros else {"ymm"})


def test_relu_keeps_nan_like_torch_and_the_reference(compiler):
    b = GraphBuilder("relu-nan")
    b.input("x", (2, 8), "fp32")
    b.op("r", "Relu", ["x"])
    b.op("a", "Affine", ["r"], {"a": 2.0, "b": 1.0})
    g = b.build(["a"])
    x = {"x": np.array([[np.nan, -1, 0, 1, np.inf, -np.inf, -0.0, 3]] * 2, dtype=np.float32)}
    fused = [p for p in build_candidates(g, load_device("h200")).plans if len(p.kernels) == 1][0]
    got = cpu_backend().compile(fused).run(x)[0]
    want = execute_graph(g, x)[0]
    np.testing.assert_array_equal(got, want)
    assert np.isnan(got[0, 0]) and got[0, 1] == 1.0 and got[0, 4] == np.inf and got[0, 5] == 1.0


@pytest.mark.parametrize("op", ["GeluErf", "GeluTanh", "Tanh"])
def test_gelu_and_tanh_use_inline_rational_functions_within_a_few_ulp(compiler, op):
    """The C forms of erf and tanh (fp_erf, fp_tanh: rational functions, no libm call) against fp64 over the whole
    range, the clamps, tiny values, infinities and NaN."""
    from scipy.special import erf

    x = np.concatenate([np.linspace(-12, 12, 48001), [1e-30, 3e-4, -2e-5, np.inf, -np.inf, np.nan]]).astype(np.float32)
    b = GraphBuilder(op)
    b.input("x", (1, x.size), "fp32")
    g = b.build([b.op("y", op, ["x"])])
    plan = build_candidates(g, load_device("h200")).unfused
    body = generate(plan.kernels[0].body, {n.id: (n.type.shape, n.type.dtype) for n in g.nodes}).source
    body = body.split("void fp_kernel")[1]
    assert ("fp_erf(" in body or "fp_tanh(" in body) and "erff(" not in body and "tanhf(" not in body
    got = cpu_backend().compile(plan).run({"x": x[None]})[0][0]
    finite = np.isfinite(x)
    x64 = x[finite].astype(np.float64)
    want = {"GeluErf": 0.5 * x64 * (1 + erf(x64 / np.sqrt(2))), "Tanh": np.tanh(x64),
            "GeluTanh": 0.5 * x64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64**3)))}[op]
    # a few fp32 ulp of the result, or of x where GELU's tail is x times a tiny erf or tanh difference
    assert (np.abs(got[finite] - want) <= 1e-6 * np.maximum(np.abs(want), np.abs(x64))).all()
    assert np.isnan(got[-1]) and (got[-3] == np.inf if op != "Tanh" else got[-3] == 1.0)
    ref = execute_graph(g, {"x": x[None]})[0][0]
    assert np.array_equal(np.isnan(got), np.isnan(ref)) and np.array_equal(got[~finite], ref[~finite], equal_nan=True)


def test_affine_identity_terms_are_not_computed(compiler):
    """``x*a`` (b = 0) and ``x + b`` (a = 1) compute no ``+ 0`` or ``1*``: a zero product keeps its sign,
    as torch's scalar multiply does, in the reference and the C kernel alike; and the C snippet leaves
    the multiply free to contract with a following add into one FMA."""
    b = GraphBuilder("affine-identity")
    b.input("x", (2, 8), "fp32")
    b.op("scale", "Affine", ["x"], {"a": 2.0, "b": 0.0})
    b.op("shift", "Affine", ["scale"], {"a": 1.0, "b": -0.0})
    g = b.build(["shift"])
    assert OPS["Affine"].code(["x"], {"a": 2.0, "b": 0.0}) == "(2.0f*x)"
    assert OPS["Affine"].code(["x"], {"a": 1.0, "b": 3.0}) == "(x + 3.0f)"
    assert OPS["Affine"].code(["x"], {"a": 1.0, "b": 0.0}) == "(x)"
    x = {"x": np.array([[-0.0, 0.0, -1.5, np.nan, np.inf, -np.inf, 1e-45, 3]] * 2, dtype=np.float32)}
    torch_like = x["x"] * np.float32(2.0)
    want = execute_graph(g, x)[0]
    assert np.signbit(want[0, 0]) and not np.signbit(want[0, 1])
    np.testing.assert_array_equal(want, torch_like)
    fused = [p for p in build_candidates(g, load_device("h200")).plans if len(p.kernels) == 1][0]
    got = cpu_backend().compile(fused).run(x)[0]
    assert np.array_equal(got.view(np.uint32), torch_like.view(np.uint32))


def test_fma_contraction_is_an_option_within_the_fp32_tolerance(tmp_path):
    try:
        strict, fused = Compiler(directory=tmp_path, fma=False), Compiler(directory=tmp_path, fma=True)
    except CompilerUnavailable as exc:
        pytest.skip(f"no C compiler: {exc}")
    assert "-ffp-contract=off" in strict.flags and "-ffp-contract=fast" in fused.flags
    assert strict.key("x") != fused.key("x")  # never one cached object for both
    g = examples.ew_chain(8, 4096, "fp32")
    plan = [p for p in build_candidates(g, load_device("h200"), cap=512).plans if len(p.kernels) == 1][0]
    x = random_inputs(g, 0)
    from backends.cpu.backend import CpuBackend

    outs = {fma: CpuBackend(SPEC, compiler=c).compile(plan).run(x)[0] for fma, c in ((False, strict), (True, fused))}
    np.testing.assert_array_equal(outs[False], execute_plan(plan, x)[0])  # strict: bit-identical to the reference
    assert check_outputs(plan, [outs[True]], execute_graph(g, x))[0] is None


# ---------------------------------------------------------------- compiler faults and the kernel cache


def test_a_hanging_compiler_is_a_clear_error_not_a_hang(tmp_path, monkeypatch):
    import backends.cpu.compiler as compiler_module

    cc = tmp_path / "hanging-cc"
    cc.write_text("#!/bin/sh\nsleep 60\n")
    cc.chmod(0o755)
    monkeypatch.setattr(compiler_module, "PROBE_TIMEOUT_S", 0.5)
    with pytest.raises(CompilerUnavailable, match="did not finish within 0.5 s"):
        Compiler(cc=str(cc))


def test_the_compiler_probe_runs_once_per_compiler_and_a_tampered_record_is_ignored(tmp_path, monkeypatch, compiler):
    """The probe's answer is kept in the kernel cache: a new process (the in-process memo cleared) runs no
    compiler before its first kernel; a record whose flags the probe could not have chosen is ignored."""
    import backends.cpu.compiler as compiler_module

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    runs: list[list[str]] = []
    real_run = compiler_module._run
    monkeypatch.setattr(compiler_module, "_run", lambda cmd, *a: (runs.append(cmd), real_run(cmd, *a))[1])
    compiler_module._probe.cache_clear()
    first = compiler_module._probe(compiler.cc)
    assert runs and (first[0], first[1]) in compiler_module.PROBE_ATTEMPTS
    runs.clear()
    compiler_module._probe.cache_clear()
    assert compiler_module._probe(compiler.cc) == first and runs == []
    (record,) = (tmp_path / "fusion-planner" / "cpu").glob("probe-*.json")
    record.write_text(json.dumps({"flags": [*first[0], "-fplugin=/tmp/evil.so"], "libs": [], "version": "x"}))
    compiler_module._probe.cache_clear()
    assert compiler_module._probe(compiler.cc) == first and runs  # probed again, the injected flag never used
    compiler_module._probe.cache_clear()


def test_a_hanging_kernel_build_is_a_clear_error(tmp_path, monkeypatch, compiler):
    import backends.cpu.compiler as compiler_module

    shutil_which = compiler_module.shutil.which(compiler.cc)
    assert shutil_which
    cc = tmp_path / "slow-cc"
    cc.write_text(f'#!/bin/sh\ncase "$*" in *kernel.c*) sleep 60;; esac\nexec {shutil_which} "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("FUSION_PLANNER_CC_TIMEOUT", "0.5")
    slow = Compiler(cc=str(cc), directory=tmp_path / "cache")
    with pytest.raises(CodegenError, match="did not finish within 0.5 s"):
        slow.build(noop_source())


@pytest.mark.parametrize("batched", [False, True])
def test_a_compiler_whose_child_hangs_is_killed_with_its_whole_process_group(batched, tmp_path, monkeypatch, compiler):
    """gcc runs cc1, as and ld: a driver whose child holds the pipes must not hang the build past its timeout
    (killing the driver alone, then reading the pipes again, waited for ever); no child outlives the kill."""
    import time

    real = shutil.which(compiler.cc)
    assert real
    marker = tmp_path / "child.pid"
    cc = tmp_path / "forking-cc"
    cc.write_text(f'#!/bin/sh\ncase "$*" in *--version*|*probe.c*) exec {real} "$@";; '
                  f'*) sleep 60 & echo $! > {marker}; wait;; esac\n')
    cc.chmod(0o755)
    monkeypatch.setenv("FUSION_PLANNER_CC_TIMEOUT", "0.5")
    forking = Compiler(cc=str(cc), directory=tmp_path / "cache")
    t0 = time.perf_counter()
    kernel = PRELUDE + "\nvoid fp_kernel(float* restrict out, int64_t r0, int64_t r1, int64_t cols) { (void)out; }\n"
    with pytest.raises(CodegenError, match="did not finish within 0.5 s"):
        forking.build_many([kernel]) if batched else forking.build(kernel)
    assert time.perf_counter() - t0 < 20
    child = int(marker.read_text())
    time.sleep(0.2)
    assert _dead(child)


def _dead(pid: int) -> bool:
    """Gone, or a zombie no one reaped yet (a container's first process may not)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("value", ["abc", "-1", "inf"])
def test_a_bad_compiler_timeout_is_a_usage_error_naming_the_variable(value, monkeypatch, compiler):
    from planner.core.errors import UsageError

    monkeypatch.setenv("FUSION_PLANNER_CC_TIMEOUT", value)
    with pytest.raises(UsageError, match="FUSION_PLANNER_CC_TIMEOUT"):
        Compiler(cc=compiler.cc)


def test_a_poisoned_kernel_cache_heals(tmp_path, caplog, compiler):
    cache = tmp_path / "cache"
    first = Compiler(directory=cache)
    source = noop_source() + "/* poisoned */\n"
    so = first.build(source)
    so.unlink()
    so.write_bytes(b"not a shared object")  # what a broken compiler left at this key
    second = Compiler(directory=cache)
    with caplog.at_level("WARNING"):
        fn = second.function(source, 2)
    assert "rebuilding it" in caplog.text and second.compiled == 1
    buf = np.zeros(4, dtype=np.float32)
    fn(buf.ctypes.data, buf.ctypes.data, 0, 1, 4)
    # a file that matches its seal but does not load is rebuilt too (another source: the process has not
    # loaded it, so the dynamic loader reads the file)
    other = noop_source() + "/* another kernel */\n"
    junk_so = Compiler(directory=cache).build(other)
    junk_so.unlink()
    junk_so.write_bytes(b"junk")
    junk_so.with_suffix(".sha256").write_text(f"4 {hashlib.sha256(b'junk').hexdigest()}\n")
    third = Compiler(directory=cache)
    with caplog.at_level("WARNING"):
        third.function(other, 2)
    assert "does not load" in caplog.text and third.compiled == 1


# ---------------------------------------------------------------- row kernels


@pytest.mark.parametrize("width", [5, 16, 37, 64])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_every_norm_and_softmax_plan_matches_the_reference(width, dtype):
    """LayerNorm (with the residual add before it) and softmax in every plan the extractor offers, the
    one-row-kernel plan among them, on 1 and 2 threads: widths below, at and off the 16 partial sums."""
    for g in (examples.layer_norm(7, width, dtype), examples.softmax(7, width, dtype)):
        plans = build_candidates(g, load_device("seed-k4"), cap=64).plans
        assert min(len(p.kernels) for p in plans) == 1
        x = random_inputs(g, seed=width)
        want = execute_graph(g, x)[0]
        one = min(plans, key=lambda p: len(p.kernels))
        for plan, threads in [(p, 1) for p in plans[:10]] + [(one, 1), (one, 2)]:
            got = cpu_backend(threads=threads).compile(plan).run(x)[0]
            assert close(got, want, dtype), (g.name, plan.notation(), threads)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_norm_computed_in_fp32_between_casts_matches_the_reference_in_every_plan(dtype):
    """LLaMA's RMSNorm of a 16-bit residual stream: statistics in fp32 between two Casts. The one-kernel plan
    reads and writes 16 bits (no fp32 copy of the rows); every plan, on 1 and 2 threads, equals the reference."""
    g = examples.rms_norm(9, 40, dtype)
    plans = build_candidates(g, load_device("seed-k4"), cap=64).plans
    one = min(plans, key=lambda p: len(p.kernels))
    (k,) = one.kernels
    assert k.ops.count("Cast") == 2 and k.cost.bytes == 2 * (3 * 9 * 40 + 40)
    x = random_inputs(g, seed=3)
    want = execute_graph(g, x)[0]
    for plan, threads in [(p, 1) for p in plans[:12]] + [(one, 2)]:
        got = cpu_backend(threads=threads).compile(plan).run(x)[0]
        assert close(got, want, dtype), (plan.notation(), threads)


def test_a_cast_kernel_widens_and_narrows_exactly(compiler):
    """A Cast alone is a conversion kernel: bf16 -> fp32 exact, fp32 -> fp16 rounded to nearest even as numpy."""
    b = GraphBuilder("casts")
    b.input("x", (3, 50), "bf16")
    wide = b.op("wide", "Cast", ["x"], {"dtype": "fp32"})
    g = b.build([wide, b.op("half", "Cast", [b.op("y", "Affine", [wide], {"a": 1.001, "b": 0.0})], {"dtype": "fp16"})])
    x = random_inputs(g, seed=1)
    unfused = build_candidates(g, load_device("seed-k4")).unfused
    got = cpu_backend().compile(unfused).run(x)
    want = execute_graph(g, x)
    assert np.array_equal(got[0], want[0]) and got[0].dtype == np.float32
    assert np.array_equal(np.asarray(got[1], np.float32), np.asarray(want[1], np.float32))


def test_row_kernel_is_one_kernel_reading_each_tensor_once():
    g = examples.layer_norm(128, 768)
    one = min(build_candidates(g, load_device("seed-k4")).plans, key=lambda p: len(p.kernels))
    (k,) = one.kernels
    assert k.kind == "elementwise" and {"RowMean", "SubRow", "Rsqrt", "BiasMul", "Add"} <= set(k.ops)
    compiled = cpu_backend().compile(one)
    assert compiled.kernel_facts[0]["bytes_moved"] == k.cost.bytes == 4 * (3 * 128 * 768 + 2 * 768)


def test_row_max_keeps_nan_and_softmax_of_a_nan_row_is_nan():
    g = examples.softmax(3, 20)
    x = {"x": np.random.default_rng(0).standard_normal((3, 20)).astype(np.float32)}
    x["x"][1, 7] = np.nan
    one = min(build_candidates(g, load_device("seed-k4")).plans, key=lambda p: len(p.kernels))
    got = cpu_backend().compile(one).run(x)[0]
    assert np.isnan(got[1]).all() and not np.isnan(got[[0, 2]]).any()
    np.testing.assert_allclose(got[[0, 2]], execute_graph(g, x)[0][[0, 2]], rtol=1e-5)


def test_row_kernel_loops_are_vectorised(compiler):
    about = subprocess.run([compiler.cc, "--version"], capture_output=True, text=True).stdout
    if "Free Software Foundation" not in about:
        pytest.skip(f"the vectorisation report is gcc's; this compiler is {compiler.version}")
    g = examples.layer_norm(64, 768)
    one = min(build_candidates(g, load_device("seed-k4")).plans, key=lambda p: len(p.kernels))
    ck = generate(one.kernels[0].body, {n.id: (n.type.shape, n.type.dtype) for n in g.nodes})
    report = compiler.vectorisation_report(ck.source)
    src = ck.source.splitlines()
    lines = [i for i, line in enumerate(src, 1) if "for (long long c = 0; c < 768" in line]
    partials = [i for i, line in enumerate(src, 1) if "for (long long c0 = 0; c0 < 768; c0 += 16) {" in line]
    assert len(lines) == 2  # x + r into its row buffer (the later loops read it again), and the output
    assert len(partials) == 1  # the centred square, read by the variance alone, computed in its partials' loop
    assert all(re.search(rf":{line}:\d+: optimized: loop vectorized", report) for line in lines + partials), report
    row = ck.source.split("row kernel")[1]
    assert row.count("fp_va_fill(") == 1 and row.count("float row") == 1  # the mean summed from the buffer


@pytest.mark.parametrize("threads", [1, 2])
def test_a_streaming_row_kernel_prefetches_the_next_row_while_it_writes_this_one(compiler, threads):
    """A row kernel whose output streams writes its row in blocks of 16 columns, each first prefetching the next
    row's columns of every operand read whole rows at a time (x and r, not the weights); the blocks vectorise
    (gcc's report), and the kernel equals the reference, the last row's prefetch past the end included."""
    from backends.cpu.backend import CpuBackend

    g = examples.layer_norm(64, 768)
    one = min(build_candidates(g, load_device("seed-k4")).plans, key=lambda p: len(p.kernels))
    ck = generate(one.kernels[0].body, {n.id: (n.type.shape, n.type.dtype) for n in g.nodes}, stream=True)
    row = ck.source.split("row kernel")[1]
    assert row.count("__builtin_prefetch(") == 2 and row.count("fp_row_store(") == 1
    about = subprocess.run([compiler.cc, "--version"], capture_output=True, text=True).stdout
    if "Free Software Foundation" in about:
        report = compiler.vectorisation_report(ck.source)
        block = next(i for i, line in enumerate(ck.source.splitlines(), 1) if "c < c0 + 16; ++c" in line)
        assert re.search(rf":({block}|{block + 1}|{block + 2}|{block + 3}|{block + 4}|{block + 5}):\d+: optimized: "
                         r"(loop|basic block)", report), report
    compiled = CpuBackend(SPEC, threads=threads, stream_bytes=0).compile(one)
    assert compiled.kernel_facts[0]["streaming_stores"]
    x = random_inputs(g, seed=4)
    assert close(compiled.run(x)[0], execute_graph(g, x)[0], "fp32")


def test_a_reduction_input_nothing_else_reads_gets_no_row_buffer():
    """RMSNorm's ``x * x`` feeds its mean alone: computed in the partials' loop, not stored and read back."""
    g = examples.rms_norm(5, 256, "fp32")
    one = min(build_candidates(g, load_device("seed-k4")).plans, key=lambda p: len(p.kernels))
    ck = generate(one.kernels[0].body, {n.id: (n.type.shape, n.type.dtype) for n in g.nodes})
    assert ck.row_width == 256 and "float row" not in ck.source.split("row kernel")[1]
    x = random_inputs(g, seed=3)
    assert close(cpu_backend().compile(one).run(x)[0], execute_graph(g, x)[0], "fp32")


def test_rows_longer_than_the_buffer_limit_reduce_in_the_loop():
    """A 16-bit row longer than the row buffer computes each reduction's input in the partials' loop."""
    from backends.cpu.codegen import ROW_BUFFER_LIMIT

    g = examples.layer_norm(3, ROW_BUFFER_LIMIT + 24, "fp16", residual=False)  # the mean reads x itself
    one = min(build_candidates(g, load_device("seed-k4")).plans, key=lambda p: len(p.kernels))
    x = random_inputs(g, seed=1)
    got = cpu_backend().compile(one).run(x)[0]
    assert close(got, execute_graph(g, x)[0], "fp16")
    source = generate(one.kernels[0].body, {n.id: (n.type.shape, n.type.dtype) for n in g.nodes}).source
    assert "fp_va_load(" not in source.split("row kernel")[1]  # no row buffer: scalar partials


def test_a_gemms_right_operand_is_read_in_place_in_either_order():
    """A fp32 tensor only GEMM libraries read (a weight) is bound as given, C or Fortran order: an nn.Linear
    weight (N, K) arrives as its (K, N) transpose and is multiplied in that layout, with no copy.  A tensor
    another kernel also reads keeps the C-ordered copy those kernels index."""
    from backends.cpu.memory import gemm_b_only

    g = examples.mlp_epilogue(48, 40, 32, "fp32")
    cands = build_candidates(g, load_device("h200"))
    plan = next(p for p in cands.plans if len(p.kernels) == 2)
    assert gemm_b_only(plan) == {"w"}
    inputs = random_inputs(g)
    (want,) = execute_graph(g, inputs, "device")
    compiled = cpu_backend().compile(plan)
    w_t = np.ascontiguousarray(inputs["w"].T)  # how nn.Linear stores it
    fortran = dict(inputs, w=w_t.T)
    assert fortran["w"].flags.f_contiguous and not fortran["w"].flags.c_contiguous
    loads = compiled.loads
    (got,) = compiled.run(fortran)
    assert compiled.memory.arrays["w"] is fortran["w"] and compiled.loads == loads  # bound, not copied
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    # the same tensor also read by an elementwise kernel: copied into the C-ordered buffer, still right
    b = GraphBuilder("w-twice")
    b.input("x", (8, 8), "fp32")
    b.input("w", (8, 8), "fp32")
    mm = b.op("mm", "MatMul", ["x", "w"])
    out = b.op("out", "Add", [mm, "w"])
    g2 = b.build([out])
    plan2 = next(p for p in build_candidates(g2, load_device("h200")).plans if len(p.kernels) == 1)
    assert gemm_b_only(plan2) == frozenset()
    x, w = np.eye(8, dtype=np.float32) * 2, np.arange(64, dtype=np.float32).reshape(8, 8)
    (got2,) = cpu_backend().compile(plan2).run({"x": x, "w": np.asfortranarray(w)})
    np.testing.assert_allclose(got2, x @ w + w)


# ---------------------------------------------------------------- 16-bit products in torch's own units


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("gelu", ["tanh", "erf"])
def test_16_bit_gemms_in_torchs_native_product_match_the_widened_ones(dtype, gelu, monkeypatch):
    """A 16-bit GEMM+epilogue multiplied by torch in the dtype itself (the CPU's AMX/AVX-512 BF16 units where it
    has them; forced here, so it runs on any CPU) reads its operands and product tile as stored; the widened
    fp32 product is the other path.  Both match the reference within the dtype's tolerance, and a weight only
    the GEMM reads is bound in nn.Linear's (N, K) layout without a copy on the native path."""
    pytest.importorskip("torch")
    from backends.cpu.backend import CpuBackend

    g = examples.mlp_epilogue(40, 24, 16, dtype, gelu=gelu)
    plan = next(p for p in build_candidates(g, SPEC).plans if len(p.kernels) == 1)
    inputs = random_inputs(g, seed=3)
    (want,) = execute_plan(plan, inputs)
    w_t = np.ascontiguousarray(inputs["w"].astype(numpy_dtype(dtype)).T)
    for mode, impl in (("native", f"torch-{dtype}-gemm+c-epilogue"), ("widen", "torch-gemm+c-epilogue")):
        monkeypatch.setenv("FUSION_PLANNER_CPU_GEMM_16BIT", mode)
        compiled = CpuBackend(SPEC, threads=1, gemm_library="torch").compile(plan)
        assert compiled.kernel_facts[0]["impl"] == impl
        feed = {n: a.astype(numpy_dtype(dtype)) for n, a in inputs.items()} | {"w": w_t.T}
        (got,) = compiled.run(feed)
        assert close(got, want, dtype), mode
        assert (compiled.memory.arrays["w"].base is w_t.T.base) == (mode == "native")
    monkeypatch.setenv("FUSION_PLANNER_CPU_GEMM_16BIT", "sometimes")
    with pytest.raises(UsageError, match="FUSION_PLANNER_CPU_GEMM_16BIT='sometimes'"):
        CpuBackend(SPEC, threads=1, gemm_library="torch").compile(plan)


def _packing_backend(monkeypatch, threads: int, tile_bytes: int | None = None, dtype: str = "bf16",
                     post_ops_pay: bool = True):
    """A CPU backend multiplying ``dtype`` from packed weights (bf16 natively; fp32 with numpy's BLAS for the
    rest), oneDNN's activations taken as post-ops where ``post_ops_pay`` (else the generated epilogue's); skips
    where this torch cannot pack it."""
    pytest.importorskip("torch")
    from backends.cpu.backend import CpuBackend

    monkeypatch.setattr(gemm, "post_op_pays", lambda *args: post_ops_pay)

    monkeypatch.setenv(gemm.GEMM_16BIT_ENV, "native")
    if gemm.packing_error(dtype) is not None:
        pytest.skip(f"torch cannot multiply {dtype} from packed weights here: {gemm.packing_error(dtype)}")
    monkeypatch.setenv(gemm.WEIGHTS_16BIT_ENV if dtype != "fp32" else gemm.WEIGHTS_ENV, "packed")
    library = "numpy" if dtype == "fp32" else "torch"
    return CpuBackend(SPEC, threads=threads, gemm_library=library, tile_bytes=tile_bytes, pack_min_macs=0)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("tiles", ["one", "several"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_held_weight_is_packed_once_and_shared_by_every_plan(threads, tiles, dtype, monkeypatch):
    """A read-only weight (a bound parameter) is packed by oneDNN on the first call, read packed after, by
    this plan and by another of the same backend (a search's candidates); a writable one is read as bound.
    The GEMM with an epilogue (one tile, or several), and the product alone, match the reference either way."""
    tile_bytes = None if tiles == "one" else 10 * (16 + 24) * 4  # ten rows of the product per tile
    backend = _packing_backend(monkeypatch, threads, tile_bytes, dtype)
    g = examples.mlp_epilogue(40, 24, 16, dtype)
    plans = build_candidates(g, SPEC).plans
    fused = next(p for p in plans if len(p.kernels) == 1)
    alone = next(p for p in plans if p.kernels[0].body.op == "MatMul")  # the product, then the epilogue's loop
    inputs = {n: a.astype(numpy_dtype(dtype)) for n, a in random_inputs(g, seed=5).items()}
    held = np.ascontiguousarray(inputs["w"].T).T  # nn.Linear's (N, K) layout, read-only as BoundInputs hands it
    held.setflags(write=False)
    for plan in (fused, alone):
        (want,) = execute_plan(plan, inputs)
        compiled = backend.compile(plan)
        assert compiled.memory.packable == {"w"}
        assert compiled.kernel_facts[0]["weights"] == "packed if read-only"
        if tiles == "several" and plan is fused:
            assert compiled.kernel_facts[0]["tiles"] == 4
        for _ in range(2):
            (got,) = compiled.run(dict(inputs, w=held))
            assert close(got, want, dtype), plan.notation()
        assert set(compiled.memory.packed) == {"w"}
        (got,) = compiled.run(dict(inputs, w=inputs["w"].copy()))  # writable: may change, so never packed
        assert not compiled.memory.packed and close(got, want, dtype)
    assert backend.held.copies == 1  # one packed form, shared by both plans


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_small_products_weight_is_not_packed(dtype, monkeypatch):
    """oneDNN's packed product costs a fixed 15 µs or so a call: a product of fewer than ``pack_min_macs``
    multiply-adds (a squeeze-and-excitation's, a classifier's on a few rows) keeps the library's plain one, and
    still matches the reference; one at the threshold is packed."""

    backend = _packing_backend(monkeypatch, 1, dtype=dtype)
    g = examples.mlp_epilogue(40, 24, 16, dtype)  # 40 x 24 x 16 multiply-adds
    plan = next(p for p in build_candidates(g, SPEC).plans if len(p.kernels) == 1)
    inputs, held = _with_held_weight(g, dtype, seed=5)
    (want,) = execute_plan(plan, inputs)
    for min_macs, packed in ((40 * 24 * 16 + 1, False), (40 * 24 * 16, True)):
        backend.pack_min_macs = min_macs
        compiled = backend.compile(plan)
        assert (compiled.memory.packable == {"w"}) == packed
        (got,) = compiled.run(dict(inputs, w=held))
        assert close(got, want, dtype) and bool(compiled.memory.packed) == packed
    assert type(backend)(SPEC, threads=1).pack_min_macs == gemm.PACK_MIN_MACS


def _with_held_weight(g: Graph, dtype: str, seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Random inputs of ``g`` in ``dtype``, and its weight ``w`` as a bound parameter arrives: nn.Linear's (N, K)
    layout seen as (K, N), read-only."""
    inputs = {n: a.astype(numpy_dtype(dtype)) for n, a in random_inputs(g, seed=seed).items()}
    held = np.ascontiguousarray(inputs["w"].T).T
    held.setflags(write=False)
    return inputs, held


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("epilogue", ["BIAS", "GELU_BIAS", "RELU_BIAS", "DEFAULT"])
@pytest.mark.parametrize("read_by", ["a kernel", "the caller"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_cublaslt_epilogue_on_packed_weights_runs_as_onednn_post_ops(epilogue, read_by, dtype, threads, monkeypatch):
    """A cublaslt kernel whose right operand is a packed weight is oneDNN's product with its epilogue as
    post-ops; its result is handed to the next kernel as oneDNN wrote it, or copied into a plan output; with a
    writable weight the product and generated epilogue run instead.  Every way matches the reference."""
    backend = _packing_backend(monkeypatch, threads, dtype=dtype)
    ops = {"DEFAULT": [], "BIAS": ["BiasAdd"], "GELU_BIAS": ["BiasAdd", "GeluTanh"], "RELU_BIAS": ["BiasAdd", "Relu"]}
    b = GraphBuilder(f"post-ops-{epilogue}")
    b.input("x", (24, 40), dtype)
    b.input("w", (40, 32), dtype)
    b.input("bias", (32,), dtype)
    y = b.op("mm", "MatMul", ["x", "w"])
    for op in ops[epilogue]:
        y = b.op(f"y.{op}", op, [y, "bias"] if op == "BiasAdd" else [y])
    if read_by == "the caller":
        g = b.build([y])
    else:
        out = b.op("out", "Affine", [y], {"a": 0.5, "b": 1.0})
        g = b.build([out, b.op("out2", "Relu", [out])] if epilogue == "DEFAULT" else [out])
    plans = [p for p in build_candidates(g, SPEC, cap=64).plans if p.kernels[0].epilogue == epilogue]
    assert plans and all((p.kernels[0].out in p.outputs) == (read_by == "the caller") for p in plans)
    inputs, held = _with_held_weight(g, dtype, seed=7)
    for plan in plans[:3]:
        want = execute_plan(plan, inputs)
        compiled = backend.compile(plan)
        assert compiled.kernel_facts[0]["impl"] == f"onednn-{dtype}-post-ops"
        for feed in (dict(inputs, w=held), dict(inputs, w=held), dict(inputs, w=inputs["w"].copy())):
            got = compiled.run(feed)
            assert all(close(a, e, dtype) for a, e in zip(got, want, strict=True)), plan.notation()
        compiled.run(dict(inputs, w=held))
        first = plan.kernels[0].out  # the next kernel reads oneDNN's result, not the kernel's own buffer
        assert np.shares_memory(compiled.memory.arrays[first], compiled.memory.own[first]) == (first in plan.outputs)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("activation", "attrs"), [
    ("GeluErf", {}), ("Silu", {}), ("Hardswish", {}), ("Sigmoid", {}), ("Tanh", {}), ("LeakyRelu", {"slope": 0.1}),
    ("Clamp", {"lo": 0.0, "hi": 6.0, "sides": "both"}), ("Add", {}),
])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_generated_gemm_epilogue_onednn_applies_runs_as_its_post_ops(activation, attrs, dtype, threads, monkeypatch):
    """A gemm_epilogue kernel ``activation(x @ w + bias)`` over a packed weight, the activation one oneDNN's linear
    applies (GELU of erf, SiLU, the hard ones, a clamp of two bounds...), is oneDNN's product with the bias and
    the activation as post-ops; a residual add stays the generated epilogue's.  Both match the reference, the
    result read by the next kernel."""
    backend = _packing_backend(monkeypatch, threads, dtype=dtype)
    b = GraphBuilder(f"gemm-epilogue-{activation}")
    b.input("x", (24, 40), dtype)
    b.input("w", (40, 32), dtype)
    b.input("bias", (32,), dtype)
    y = b.op("y", "BiasAdd", [b.op("mm", "MatMul", ["x", "w"]), "bias"])
    y = b.op("act", activation, [y, b.input("r", (24, 32), dtype)] if activation == "Add" else [y], attrs)
    g = b.build([b.op("out", "Affine", [y], {"a": 0.5, "b": 1.0})])
    plans = [p for p in build_candidates(g, SPEC, cap=64).plans
             if p.kernels[0].kind == KernelKind.GEMM_EPILOGUE and p.kernels[0].body.op == activation]
    assert plans
    inputs, held = _with_held_weight(g, dtype, seed=3)
    for plan in plans[:2]:
        want = execute_plan(plan, inputs)
        compiled = backend.compile(plan)
        impl = compiled.kernel_facts[0]["impl"]
        assert impl == (f"onednn-{dtype}-post-ops" if activation != "Add" else
                        ("torch-bf16-gemm+c-epilogue" if dtype == "bf16" else "numpy-gemm+c-epilogue"))
        for feed in (dict(inputs, w=held), dict(inputs, w=held), dict(inputs, w=inputs["w"].copy())):
            assert all(close(a, e, dtype) for a, e in zip(compiled.run(feed), want, strict=True)), plan.notation()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_an_activation_whose_post_op_is_slower_here_stays_the_generated_epilogues(dtype, threads, monkeypatch):
    """Where oneDNN's GELU post-op costs its product more than the epilogue would (as with AVX2 code), the
    packed product runs bare and the generated epilogue adds the bias and GELU: the reference's answer."""
    backend = _packing_backend(monkeypatch, threads, dtype=dtype, post_ops_pay=False)
    b = GraphBuilder("post-op-slower")
    b.input("x", (24, 40), dtype)
    b.input("w", (40, 32), dtype)
    b.input("bias", (32,), dtype)
    y = b.op("y", "GeluTanh", [b.op("b", "BiasAdd", [b.op("mm", "MatMul", ["x", "w"]), "bias"])])
    g = b.build([b.op("out", "Affine", [y], {"a": 0.5, "b": 1.0})])
    plan = next(p for p in build_candidates(g, SPEC, cap=64).plans if p.kernels[0].epilogue == "GELU_BIAS")
    inputs, held = _with_held_weight(g, dtype, seed=4)
    want = execute_plan(plan, inputs)
    compiled = backend.compile(plan)
    assert "post-ops" not in compiled.kernel_facts[0]["impl"]
    for feed in (dict(inputs, w=held), dict(inputs, w=held)):
        assert all(close(a, e, dtype) for a, e in zip(compiled.run(feed), want, strict=True))
    assert compiled.packs == 1  # the weight is packed all the same: the bare product reads it


def test_the_post_op_choice_is_measured_once_per_shape_and_threads_and_recorded(monkeypatch, tmp_path):
    """oneDNN's activation is a post-op only where it is no slower than the product followed by the activation's
    own pass, by the margin; the choice is timed once per shape and thread count, recorded, and read back by a
    new process."""
    pytest.importorskip("torch")

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    timed: list = []

    def timing(dtype, unary, shape, threads):  # GELU's post-op: 20% slower than product + pass on 2 threads, 2% on one
        timed.append((shape, threads))
        return {"post-ops": 1.2 if threads == 2 else 1.02, "epilogue": 1.0}

    probe = gemm.time_post_op
    monkeypatch.setattr(gemm, "time_post_op", timing)
    gelu = gemm.LINEAR_UNARY["GeluTanh"]({})
    gemm.post_op_pays.cache_clear()
    try:
        assert gemm.post_op_pays("fp32", gelu, (128, 768, 3072), 1)
        assert not gemm.post_op_pays("fp32", gelu, (128, 768, 3072), 2)
        gemm.post_op_pays.cache_clear()  # a new process: the records answer
        assert gemm.post_op_pays("fp32", gelu, (128, 768, 3072), 1)
        assert not gemm.post_op_pays("fp32", gelu, (128, 768, 3072), 2)
        assert timed == [((128, 768, 3072), 1), ((128, 768, 3072), 2)]
    finally:
        gemm.post_op_pays.cache_clear()
    if gemm.packing_error("fp32") is None:  # the probe itself: both forms timed
        seconds = probe("fp32", gelu, (16, 64, 64), 2)
        assert set(seconds) == set(gemm.POST_OP_CHOICES) and min(seconds.values()) > 0


@pytest.mark.parametrize("activation", sorted(gemm.LINEAR_UNARY))
def test_the_activation_pass_that_prices_the_epilogue_computes_the_post_op(activation):
    """The post-op choice prices the generated epilogue by torch's activation over the product: it must be the
    function oneDNN's post-op applies (GELU's erf and tanh forms apart)."""
    pytest.importorskip("torch")
    if gemm.packing_error("fp32") is not None:
        pytest.skip(gemm.packing_error("fp32"))
    unary = gemm.LINEAR_UNARY[activation]({"lo": -0.5, "hi": 0.5, "sides": "both", "slope": 0.1})
    rng = np.random.default_rng(1)
    a, w = (gemm.aligned_copy(rng.standard_normal(s, dtype=np.float32)) for s in ((8, 32), (16, 32)))
    bias = rng.standard_normal(16, dtype=np.float32)
    weight = gemm.pack_weight(np.ascontiguousarray(w.T), "fp32")
    fused = gemm.packed_linear("fp32", unary)(a, weight, bias)
    priced = unary.torch(gemm.packed_linear("fp32")(a, weight, bias))
    np.testing.assert_allclose(priced.numpy(), fused.numpy(), rtol=1e-5, atol=1e-5)


def test_packed_16_bit_weights_are_chosen_by_measurement_and_refused_where_torch_cannot_pack(monkeypatch, tmp_path):
    """auto packs only where packing measured faster (the padded rule: the sum by the margin, no shape slower),
    recorded once; ``packed`` where torch cannot pack names the variable and the reason; a bad value is refused."""
    pytest.importorskip("torch")

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(gemm.WEIGHTS_16BIT_ENV, raising=False)
    monkeypatch.setattr(gemm, "packing_error", lambda dtype: None)
    timings = iter([{"packed": [0.7, 0.7, 0.7], "given": [1.0, 1.0, 1.0]},
                    {"packed": [0.5, 0.5, 1.2], "given": [1.0, 1.0, 1.0]}])
    measured = []
    monkeypatch.setattr(gemm, "time_16bit_layouts", lambda dtype: measured.append(dtype) or next(timings))
    gemm.measured_16bit_layout.cache_clear()
    try:
        assert gemm.weight_layout_16bit("bf16") == "packed" and measured == ["bf16"]
        gemm.measured_16bit_layout.cache_clear()  # a new process: the record answers
        assert gemm.weight_layout_16bit("bf16") == "packed" and measured == ["bf16"]
        assert gemm.weight_layout_16bit("fp16") == "given" and measured == ["bf16", "fp16"]  # slower on one shape
    finally:
        gemm.measured_16bit_layout.cache_clear()
    monkeypatch.setattr(gemm, "packing_error", lambda dtype: "RuntimeError: no bf16 units")
    assert gemm.weight_layout_16bit("bf16") == "given"  # auto: nothing to measure
    monkeypatch.setenv(gemm.WEIGHTS_16BIT_ENV, "packed")
    with pytest.raises(BackendError, match="FUSION_PLANNER_CPU_WEIGHTS_16BIT=packed, but .*no bf16 units"):
        gemm.weight_layout_16bit("bf16")
    monkeypatch.setenv(gemm.WEIGHTS_16BIT_ENV, "folded")
    with pytest.raises(UsageError, match="FUSION_PLANNER_CPU_WEIGHTS_16BIT='folded'"):
        gemm.weight_layout_16bit("bf16")


def test_the_16_bit_layout_probe_times_both_layouts_of_each_shape(monkeypatch):
    """The probe itself (no stand-in), where torch packs bf16: a positive time per layout and shape."""
    _packing_backend(monkeypatch, 1)

    seconds = gemm.time_16bit_layouts("bf16")
    assert set(seconds) == set(gemm.WEIGHT_LAYOUTS_16BIT)
    assert all(len(v) == len(gemm.LAYOUT_SHAPES) and min(v) > 0 for v in seconds.values())


def test_16_bit_inputs_of_their_own_dtype_are_bound_not_converted():
    """A bf16 call input handed over as bf16 (what the torch importer passes) is read in place as its bits."""
    from backends.cpu.backend import CpuBackend

    g = examples.ew_chain(3, 777, "bf16")
    plan = build_candidates(g, SPEC).best
    inputs = random_inputs(g, seed=1)
    (want,) = execute_plan(plan, inputs)
    compiled = CpuBackend(SPEC, threads=1).compile(plan)
    x = inputs["x"].astype(numpy_dtype("bf16"))
    binds, loads = compiled.binds, compiled.loads
    (got,) = compiled.run({"x": x})
    assert compiled.binds == binds + 1 and compiled.loads == loads
    assert close(got, want, "bf16")


# ---------------------------------------------------------------- RoPE: tiles and rotated reads


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("norm", [False, True], ids=["rope", "rope-then-rmsnorm"])
def test_every_rope_plan_matches_the_reference(dtype, norm):
    """x*cos + rotate_half(x)*sin over heads in every plan: the tables read at the row modulo their rows, the
    rotated input read in two half loops (elementwise) or at (c + d/2) % d (inside a row kernel), 1 and 2 threads."""
    g = examples.rope(2, 6, 48, 3, dtype, norm)
    plans = build_candidates(g, load_device("seed-k4"), cap=64).plans
    one = min(plans, key=lambda p: len(p.kernels))
    assert len(one.kernels) == 2 and {"RotateHalf", "TileMul"} <= set(one.kernels[1].ops)  # Heads, then one kernel
    x = random_inputs(g, seed=4)
    want = execute_graph(g, x)[0]
    for plan, threads in [(p, 1) for p in plans] + [(one, 2)]:
        got = cpu_backend(threads=threads).compile(plan).run(x)[0]
        assert close(got, want, dtype), (g.name, plan.notation(), threads)


def test_a_rotated_read_in_a_gemm_epilogue_matches_the_reference():
    """RotateHalf of a stored tensor added to a GEMM result: the epilogue's loop runs in the two halves too."""
    b = GraphBuilder("gemm-plus-rotated")
    b.input("a", (10, 12), "fp32")
    b.input("w", (12, 8), "fp32")
    b.input("y", (10, 8), "fp32")
    out = b.op("out", "Add", [b.op("mm", "MatMul", ["a", "w"]), b.op("rot", "RotateHalf", ["y"])])
    g = b.build([out])
    plans = build_candidates(g, load_device("seed-k4"), cap=64).plans
    fused = [p for p in plans if len(p.kernels) == 1]
    assert fused and fused[0].kernels[0].kind == "gemm_epilogue"
    x = random_inputs(g, seed=2)
    want = execute_graph(g, x)[0]
    for plan in plans:
        assert close(cpu_backend().compile(plan).run(x)[0], want, "fp32"), plan.notation()


@pytest.mark.parametrize("library", ["numpy", "torch"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_held_weight_is_copied_once_into_padded_rows(library, threads, monkeypatch):
    """With padded weights, a read-only right operand (a bound parameter) is copied into padded rows on the first
    call and read from there after, by this plan and by every other plan of the same backend (a search's
    candidates); a writable one is still read in place.  Every way agrees with the reference."""
    if library == "torch":
        pytest.importorskip("torch")
    from backends.cpu.backend import CpuBackend
    from backends.cpu.buffers import ALIGN

    g = examples.mlp_epilogue(48, 40, 32, "fp32")
    plan = next(p for p in build_candidates(g, load_device("h200")).plans if len(p.kernels) == 2)
    inputs = random_inputs(g)
    (want,) = execute_graph(g, inputs, "device")
    monkeypatch.setenv(gemm.WEIGHTS_ENV, "padded")
    backend = CpuBackend(SPEC, threads=threads, gemm_library=library)
    compiled = backend.compile(plan)
    assert compiled.padded == {"w"}
    held = np.ascontiguousarray(inputs["w"].T).T  # nn.Linear's layout, read-only as BoundInputs hands it over
    held.setflags(write=False)
    loads = compiled.loads
    for _ in range(3):
        (got,) = compiled.run(dict(inputs, w=held))
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    stored = compiled.memory.arrays["w"]
    assert compiled.loads == loads + 1 and stored.strides[0] // ALIGN % 2 == 1 and stored.ctypes.data % ALIGN == 0
    other = backend.compile(plan)  # another candidate of the same search: the same padded copy, no new one
    (got,) = other.run(dict(inputs, w=held))
    assert other.memory.arrays["w"] is stored and other.loads == 0 and backend.held.copies == 1
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    writable = inputs["w"].copy()
    (got,) = compiled.run(dict(inputs, w=writable))
    assert compiled.memory.arrays["w"] is writable  # a call input: read in place
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    monkeypatch.setenv(gemm.WEIGHTS_ENV, "given")
    assert CpuBackend(SPEC, threads=threads, gemm_library=library).compile(plan).padded == frozenset()


@pytest.mark.parametrize("library", ["numpy", "torch"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_product_alone_is_written_by_the_library_into_the_output(library, threads, monkeypatch):
    """A GEMM kernel that is only its MatMul has no tile and no epilogue: the library writes the output rows."""
    if library == "torch":
        pytest.importorskip("torch")
    from backends.cpu.backend import CpuBackend

    monkeypatch.setenv(gemm.WEIGHTS_ENV, "given")  # the library's route (packed weights: oneDNN's)

    b = GraphBuilder("product")
    b.input("x", (80, 24), "fp32")
    b.input("w", (24, 40), "fp32")
    g = b.build([b.op("y", "MatMul", ["x", "w"])])
    plan = build_candidates(g, load_device("h200")).plans[0]  # one kernel, a gemm_epilogue or cublaslt one
    assert [k.body.op for k in plan.kernels] == ["MatMul"]
    compiled = CpuBackend(SPEC, threads=threads, gemm_library=library).compile(plan)
    assert compiled.kernel_facts[0]["impl"] == f"{library}-gemm" and "scratch_bytes" not in compiled.kernel_facts[0]
    inputs = random_inputs(g, seed=2)
    first = compiled.run(inputs)[0]
    np.testing.assert_allclose(first, inputs["x"] @ inputs["w"], rtol=2e-5, atol=2e-5)
    assert compiled.run(inputs)[0] is not first  # each call's output is its own array


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("epilogue", [False, True], ids=["product", "one-tile"])
def test_a_torch_gemm_keeps_operand_views_only_while_the_arrays_stay(threads, epilogue, monkeypatch):
    """torch's product keeps the views of its operands between calls; a call that binds other arrays (another
    input read in place, another weight) is multiplied from those, never from a kept view of the old ones."""
    pytest.importorskip("torch")
    from backends.cpu.backend import CpuBackend

    monkeypatch.setenv(gemm.WEIGHTS_ENV, "given")  # torch.mm's route

    b = GraphBuilder("kept")
    b.input("x", (40, 24), "fp32")
    b.input("w", (24, 32), "fp32")
    b.input("bias", (32,), "fp32")
    mm = b.op("mm", "MatMul", ["x", "w"])
    g = b.build([b.op("y", "BiasAdd", [mm, "bias"]) if epilogue else mm])
    plan = min(build_candidates(g, load_device("h200")).plans, key=lambda p: len(p.kernels))
    compiled = CpuBackend(SPEC, threads=threads, gemm_library="torch").compile(plan)
    assert compiled.kernel_facts[0]["impl"] == ("torch-gemm+c-epilogue" if epilogue else "torch-gemm")
    rng = np.random.default_rng(0)
    for _ in range(3):
        x, w, bias = (rng.standard_normal(s, dtype=np.float32) for s in ((40, 24), (24, 32), (32,)))
        (got,) = compiled.run({"x": x, "w": w, "bias": bias})
        np.testing.assert_allclose(got, x @ w + (bias if epilogue else 0), rtol=2e-5, atol=2e-5)


def test_only_a_plan_that_may_call_numpys_blas_limits_its_threads_on_each_call():
    """threadpoolctl's limit costs 50-70 µs a call after the kernels evicted the caches: a plan enters it only
    where a step may call numpy's BLAS (a numpy Opaque implementation here), never for torch-backed Opaque calls,
    which run on torch's threads."""
    torch = pytest.importorskip("torch")
    import planner

    class LogSoftmax(torch.nn.Module):
        def forward(self, x):
            return torch.log_softmax(x, dim=-1) * 2.0

    x = torch.randn(4, 8)
    result = planner.plan(LogSoftmax(), (x,), backend="cpu")
    assert any(k.kind == KernelKind.OPAQUE for k in result.plan.kernels)
    assert result.compiled.uses_torch and not result.compiled.uses_blas
    torch.testing.assert_close(result(x), torch.log_softmax(x, dim=-1) * 2.0)
    assert cpu_backend().compile(build_candidates(opaque_graph(), SPEC).unfused).uses_blas
