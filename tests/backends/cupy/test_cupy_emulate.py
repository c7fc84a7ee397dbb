"""Generated elementwise CUDA, executed on the host: the kernel text compiled by nvcc as host code.

Elementwise kernels use no shared memory or barriers, so running every
(block, thread) pair in sequence is exact.  The built-in index variables are
renamed to host globals; everything else (vector loads and stores, fp16/bf16
conversion, the scalar tail, bias broadcasting, the fat probe) is the
generated text itself.  This checks the arithmetic and the indexing without a
GPU.
"""

import re
import subprocess
from dataclasses import replace

import numpy as np
import pytest

from backends.cupy.codegen import generate
from backends.cupy.kernel import CTYPE
from planner.core.cost import load_device
from planner.core.dtypes import numpy_dtype
from planner.core.examples import attention, ew_chain, layer_norm, mlp_epilogue, rms_norm, rope, softmax
from planner.core.graph import GraphBuilder
from planner.core.reference import execute_plan, prepare_inputs, random_inputs, run_kernel
from planner.egraph.candidates import build_candidates

pytestmark = pytest.mark.nvcc

GRID = 3  # few blocks so the grid-stride loop wraps several times


READ_FILE = r"""
static void* read_file(const char* path) {
  FILE* f = fopen(path, "rb"); fseek(f, 0, SEEK_END); long n = ftell(f); fseek(f, 0, SEEK_SET);
  void* p = aligned_alloc(64, (n + 63) / 64 * 64 + 64); if (fread(p, 1, n, f) != (size_t)n) exit(3); fclose(f); return p;
}
static void write_file(const char* path, const void* p, long n) {
  FILE* f = fopen(path, "wb"); fwrite(p, 1, n, f); fclose(f);
}
"""


def _sequential(c) -> tuple[str, str]:
    """A kernel without barriers or shuffles: every (block, thread) pair in turn is exact. Its body (the built-in
    index variables as host globals) and the launch, over buffers named by the kernel's parameters."""
    body = c.source.replace('extern "C" __global__ void', "void")
    for v in ("blockIdx", "threadIdx", "blockDim", "gridDim"):
        body = re.sub(rf"\b{v}\.x\b", f"emu_{v}", body)
    grid = GRID if c.grid_per_sm else c.grid[0]  # grid-stride loops wrap several times; a block per row doesn't
    launch = (f"  emu_blockDim = {c.block}; emu_gridDim = {grid};\n"
              f"  for (emu_blockIdx = 0; emu_blockIdx < {grid}; ++emu_blockIdx)\n"
              f"    for (emu_threadIdx = 0; emu_threadIdx < {c.block}; ++emu_threadIdx) {c.name}(ARGS);\n")
    return body, launch


def _threaded(c) -> tuple[str, str]:
    """A kernel that shares memory, waits at barriers or shuffles between lanes: one host thread per CUDA thread of
    each block in turn (``WMMA_SHIM``'s barriers, lane table and wmma model)."""
    body = c.source.replace("#include <mma.h>", "").replace("using namespace nvcuda;", "")
    body = body.replace('extern "C" __global__ void', "void").replace(f"__launch_bounds__({c.block}) ", "")
    body = body.replace("__shared__", "static").replace("__syncthreads()", "emu_sync()")
    body = body.replace("__syncwarp()", "emu_syncwarp()")
    body = re.sub(r"__shfl_xor_sync\(0xffffffffu, (\w+), (\w+)\)", r"emu_shfl(\1, (emu_tx % 32) ^ \2)", body)
    body = re.sub(r"__shfl_sync\(0xffffffffu, (\w+), (\w+)\)", r"emu_shfl(\1, \2)", body)
    body = body.replace("blockIdx.x", "emu_bx").replace("blockIdx.y", "emu_by").replace("threadIdx.x", "emu_tx")
    body = body.replace("blockDim.x", str(c.block)).replace("gridDim.x", str(c.grid[0]))
    gx, gy = c.grid
    launch = (f"  {{ std::barrier<> block_bar({c.block}); emu_block_bar = &block_bar;\n"
              f"    for (int w = 0; w < {c.block // 32}; ++w) emu_warp_bar[w] = new std::barrier<>(32);\n"
              f"    for (emu_by = 0; emu_by < {gy}; ++emu_by)\n"
              f"      for (emu_bx = 0; emu_bx < {gx}; ++emu_bx) {{\n"
              f"        std::vector<std::thread> ts;\n"
              f"        for (int t = 0; t < {c.block}; ++t) ts.emplace_back([=] {{ emu_tx = t; {c.name}(ARGS); }});\n"
              f"        for (auto& t : ts) t.join();\n"
              f"      }}\n"
              f"    for (int w = 0; w < {c.block // 32}; ++w) delete emu_warp_bar[w]; }}\n")
    return body, launch


def _program(kernels, tensors, inputs: list[str], outputs: list[str]) -> str:
    """One host program running ``kernels`` (generated CUDA) in order over host buffers: the inputs read from the
    files named first on its command line, the outputs written to the files named after them."""
    index = {t: i for i, t in enumerate(tensors)}
    lines = [f"  {CTYPE[tensors[t].dtype]}* t{index[t]} = ({CTYPE[tensors[t].dtype]}*)read_file(argv[{i + 1}]);"
             for i, t in enumerate(inputs)]
    made = set(inputs)
    bodies = []
    for c in kernels:
        body, launch = (_threaded if "__syncthreads" in c.source or "__shfl" in c.source else _sequential)(c)
        bodies.append(body)
        out = c.params[-1]
        if out not in made:
            lines.append(f"  {CTYPE[tensors[out].dtype]}* t{index[out]} = ({CTYPE[tensors[out].dtype]}*)"
                         f"aligned_alloc(64, ({tensors[out].nbytes} + 63) / 64 * 64);")
            made.add(out)
        lines.append(launch.replace("ARGS", ", ".join(f"t{index[p]}" for p in c.params)))
    lines += [f"  write_file(argv[{len(inputs) + 1 + i}], t{index[t]}, {tensors[t].nbytes});"
              for i, t in enumerate(outputs)]
    return "\n".join(["#include <cuda_fp16.h>", "#include <cuda_bf16.h>", WMMA_SHIM,
                      "static long long emu_blockIdx, emu_threadIdx, emu_blockDim, emu_gridDim;", *bodies, READ_FILE,
                      "int main(int argc, char** argv) {", *lines, "  return 0;", "}", ""])


def _to_storage(x: np.ndarray, dtype: str) -> bytes:
    return np.ascontiguousarray(x.astype(numpy_dtype(dtype))).tobytes()


def _run_host(plan, inputs, tmp_path):
    """Execute every kernel of ``plan`` through its generated source, all in one host program (one compile);
    returns the outputs."""
    kernels = [generate(k, plan.tensors) for k in plan.kernels]
    written = {k.out for k in plan.kernels}
    reads = sorted({p for c in kernels for p in c.params[:-1]} - written)
    prog = tmp_path / "plan.cu"
    prog.write_text(_program(kernels, plan.tensors, reads, list(plan.outputs)))
    exe = tmp_path / "plan"
    subprocess.run(["nvcc", "-O1", "-std=c++20", "-o", str(exe), str(prog)], check=True, capture_output=True,
                   timeout=300)
    files = []
    for i, t in enumerate(reads):
        f = tmp_path / f"in{i}.bin"
        f.write_bytes(_to_storage(np.asarray(inputs[t]), plan.tensors[t].dtype))
        files.append(str(f))
    outs = [tmp_path / f"out{i}.bin" for i in range(len(plan.outputs))]
    subprocess.run([str(exe), *files, *map(str, outs)], check=True, capture_output=True, timeout=300)
    return [np.frombuffer(f.read_bytes(), dtype=numpy_dtype(plan.tensors[o].dtype)).reshape(plan.tensors[o].shape)
            .astype(np.float32) for f, o in zip(outs, plan.outputs, strict=True)]


def _pixel_scale(images: int, pixels: int, channels: int, dtype: str, row: bool = False):
    """Channels-last rows (images*pixels, C) times a weight per image and channel (images, C), then SiLU; with
    ``row`` inside a row kernel (minus the row's mean)."""
    b = GraphBuilder(f"pixel-scale-{images}x{pixels}x{channels}-{dtype}")
    b.input("x", (images * pixels, channels), dtype)
    b.input("s", (images, channels), dtype)
    y = b.op("y", "Silu", [b.op("scaled", "PixelMul", [b.op("a", "Affine", ["x"], {"a": 1.5, "b": 0.25}), "s"])])
    if row:
        y = b.op("centred", "SubRow", [y, b.op("mean", "RowMean", [y])])
    return b.build([y])


def _masked_softmax(groups: int, seq: int, keys: int, dtype: str):
    """softmax(x + m) over scores x (G, S, T) and a mask m of one row of keys per group (G, 1, T)."""
    b = GraphBuilder(f"masked-softmax-{groups}x{seq}x{keys}-{dtype}")
    b.input("x", (groups, seq, keys), dtype)
    b.input("m", (groups, 1, keys), dtype)
    s = b.op("s", "MaskAdd", ["x", "m"])
    e = b.op("e", "Exp", [b.op("shift", "SubRow", [s, b.op("top", "RowMax", [s])])])
    return b.build([b.op("p", "DivRow", [e, b.op("sum", "RowSum", [e])])])


def _plan(graph, pred):
    return next(p for p in build_candidates(graph, load_device("h200")).plans if pred(p))


@pytest.mark.parametrize(
    ("graph", "pred"),
    [
        # fp32 chain, 4-wide vectors + a 3-element tail
        (ew_chain(4, 4 * 256 * GRID * 2 + 3, "fp32"), lambda p: len(p.kernels) == 1),
        # fat probe: identity on values
        (ew_chain(2, 1003, "fp32", fat_temps=8), lambda p: len(p.kernels) == 1),
        # fp16 epilogue with bias broadcast (8-wide vectors, 16 columns)
        (mlp_epilogue(13, 16, 8, "fp16"), lambda p: p.partition == (1, 3) and p.kernels[0].kind == "gemm_epilogue"),
        # bf16, bias of 12 columns: scalar path with i % cols
        (mlp_epilogue(7, 12, 8, "bf16"), lambda p: p.partition == (1, 1, 2) and p.kernels[0].kind == "gemm_epilogue"),
        # row kernels, a block per row: residual + LayerNorm in one kernel (fp16), and op by op; one warp per
        # row up to 255 columns, then warps that combine their partials in shared memory (128 and 256 threads)
        (layer_norm(3, 1030, "fp16"), lambda p: len(p.kernels) == 1),
        (softmax(2, 520, "fp32"), lambda p: len(p.kernels) == 1),
        (layer_norm(9, 40, "fp16"), lambda p: len(p.kernels) == 1),
        (layer_norm(5, 24, "fp32"), lambda p: len(p.kernels) == 10),
        (softmax(6, 33, "bf16"), lambda p: len(p.kernels) == 1),
        # LLaMA's RMSNorm: bf16 rows, fp32 statistics between two Casts, in one row kernel and as a lone Cast
        (rms_norm(7, 40, "bf16"), lambda p: len(p.kernels) == 1),
        (rms_norm(5, 24, "fp16"), lambda p: ("Cast",) in [k.ops for k in p.kernels]),
        # RoPE after Heads: tables read modulo their size, the rotated input per half (vector lanes stay in one
        # half: 4-wide fp32 and 8-wide bf16 over halves of 8; scalar over halves of 3), then inside a row kernel
        (rope(2, 6, 48, 3, "fp32"), lambda p: len(p.kernels) == 2),
        (rope(2, 6, 48, 3, "bf16"), lambda p: len(p.kernels) == 2),
        (rope(1, 5, 12, 2, "fp32"), lambda p: len(p.kernels) == 2),
        (rope(2, 6, 48, 3, "fp16", norm=True), lambda p: len(p.kernels) == 2),
        # an attention mask read one row per group: inside the softmax's row kernel, and alone (vector lanes in
        # one row: 4-wide over rows of 40; scalar over rows of 13)
        (_masked_softmax(4, 6, 40, "fp32"), lambda p: len(p.kernels) == 1),
        (_masked_softmax(4, 6, 40, "fp32"), lambda p: p.kernels[0].ops == ("MaskAdd",)),
        (_masked_softmax(3, 5, 13, "bf16"), lambda p: p.kernels[0].ops == ("MaskAdd",)),
        # squeeze-and-excitation's weights, one row per image of channels-last rows (vector lanes over 40
        # channels; scalar over 13), alone and inside a row kernel
        (_pixel_scale(3, 7, 40, "fp32"), lambda p: len(p.kernels) == 1),
        (_pixel_scale(2, 5, 13, "bf16"), lambda p: len(p.kernels) == 1),
        (_pixel_scale(3, 4, 24, "fp32", row=True), lambda p: len(p.kernels) == 1),
    ],
)
def test_generated_elementwise_code_matches_the_reference(graph, pred, tmp_path):
    plan = _plan(graph, pred)
    inputs = random_inputs(graph, seed=3)
    gemm = [k for k in plan.kernels if k.kind != "elementwise"]
    mem = dict(inputs)
    if gemm:  # the GEMM itself runs in numpy; only elementwise kernels are emulated
        for k in gemm:
            store = prepare_inputs(plan.tensors, inputs, list(inputs), "device")
            mem[k.out] = run_kernel(k, store, "device")
        plan = replace(plan, kernels=tuple(k for k in plan.kernels if k.kind == "elementwise"))
    got = _run_host(plan, mem, tmp_path)
    want = execute_plan(plan, mem, mode="device")
    for a, b in zip(got, want, strict=True):
        # same fp32 arithmetic; only FMA contraction and libm ulps may differ
        np.testing.assert_allclose(a, b, rtol=2e-3 if plan.tensors[plan.outputs[0]].dtype != "fp32" else 1e-5,
                                   atol=1e-5)


# ---------------------------------------------------------------- the wmma GEMM + epilogue kernel
# One std::thread per CUDA thread (barriers for __syncthreads/__syncwarp), blocks in sequence, and a
# host model of the wmma fragment API in which every lane holds the whole 16x16 tile.

WMMA_SHIM = r"""
#include <barrier>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
static int emu_bx, emu_by;
static thread_local int emu_tx;
static std::barrier<>* emu_block_bar;
static std::barrier<>* emu_warp_bar[32];
static void emu_sync() { emu_block_bar->arrive_and_wait(); }
static void emu_syncwarp() { emu_warp_bar[emu_tx / 32]->arrive_and_wait(); }
// a warp's lanes exchange through a table: write, wait for the warp, read the other lane, wait again
static float emu_lanes[32][32];
static float emu_shfl(float v, int lane) {
  const int w = emu_tx / 32;
  emu_lanes[w][emu_tx % 32] = v; emu_syncwarp();
  const float got = emu_lanes[w][lane]; emu_syncwarp();
  return got;
}
static float emu_f(float v) { return v; }
static float emu_f(__half v) { return __half2float(v); }
static float emu_f(__nv_bfloat16 v) { return __bfloat162float(v); }
namespace wmma {
struct matrix_a {}; struct matrix_b {}; struct accumulator {}; struct row_major {};
enum layout_t { mem_row_major };
template <class Use, int M, int N, int K, class T, class L = void> struct fragment { float x[256]; };
template <class F> void fill_fragment(F& f, float v) { for (float& e : f.x) e = v; }
template <class Use, class T, class L>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, L>& f, const T* p, unsigned ldm) {
  for (int r = 0; r < 16; ++r) for (int c = 0; c < 16; ++c) f.x[r * 16 + c] = emu_f(p[r * ldm + c]);
}
template <class T, class L>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, T, L>& a,
              const fragment<matrix_b, 16, 16, 16, T, L>& b, const fragment<accumulator, 16, 16, 16, float>& c) {
  float t[256];
  for (int i = 0; i < 16; ++i) for (int j = 0; j < 16; ++j) {
    float s = c.x[i * 16 + j];
    for (int k = 0; k < 16; ++k) s += a.x[i * 16 + k] * b.x[k * 16 + j];
    t[i * 16 + j] = s;
  }
  for (int e = 0; e < 256; ++e) d.x[e] = t[e];
}
inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm, layout_t) {
  for (int r = 0; r < 16; ++r) for (int c = 0; c < 16; ++c) p[r * ldm + c] = f.x[r * 16 + c];
}
}
"""


@pytest.mark.parametrize(
    ("m", "n", "k", "dtype", "partition"),
    [
        (13, 20, 24, "fp16", (4,)),  # every edge partial, scalar loads (N, K not multiples of 8)
        (130, 136, 40, "bf16", (4,)),  # two row blocks, 16-byte loads, partial K tile
        (40, 24, 16, "fp16", (3, 1)),  # GEMM+bias+GELU epilogue only
    ],
)
def test_generated_gemm_epilogue_matches_the_reference(m, n, k, dtype, partition, tmp_path):
    graph = mlp_epilogue(m, n, k, dtype)
    plan = _plan(graph, lambda p: p.partition == partition and p.kernels[0].kind == "gemm_epilogue")
    kern = plan.kernels[0]
    inputs = random_inputs(graph, seed=5, scale=0.5)
    (got,) = _run_host(replace(plan, kernels=(kern,), outputs=(kern.out,)), inputs, tmp_path)
    want = run_kernel(kern, prepare_inputs(plan.tensors, inputs, list(inputs), "device"), "device")
    # fp32 accumulation in another order, then one rounding to fp16/bf16
    np.testing.assert_allclose(got, want, rtol=2e-2 if dtype == "bf16" else 2e-3, atol=2e-2 if dtype == "bf16" else 2e-3)


# ---------------------------------------------------------------- attention's standalone kernels


@pytest.mark.parametrize(
    ("dtype", "causal", "masked", "fused", "seq"),
    [("fp32", True, False, True, 9), ("fp32", True, False, False, 9), ("fp32", False, True, True, 9),
     ("fp32", False, True, False, 9), ("bf16", True, False, True, 9), ("fp16", False, True, True, 9),
     ("fp32", True, False, True, 70), ("fp32", False, True, True, 40)],  # keys in tiles of 32 and a partial one
)
def test_generated_attention_kernels_match_the_reference(dtype, causal, masked, fused, seq, tmp_path):
    """A whole attention plan through its generated CUDA (the layouts, the batched products, the row kernels, the
    fused online-softmax kernel, the mask repeated over heads), executed on the host, equals the reference."""
    graph = attention(batch=2, seq=seq, d_model=24, heads=3, dtype=dtype, causal=causal, masked=masked)
    attn_ops = {"Attention", "MaskedAttention"}
    plans = build_candidates(graph, load_device("h200")).plans
    plan = next(p for p in plans if any(k.body.op in attn_ops for k in p.kernels) == fused)
    assert {"standalone"} <= {k.kind for k in plan.kernels}
    inputs = random_inputs(graph, seed=5)
    if masked:  # hide the last two keys of batch 1, as a padding mask does
        inputs["mask"] = np.zeros_like(inputs["mask"])
        inputs["mask"][1, -2:] = -np.inf
        if seq > 32:  # and a whole tile of keys: the fused kernel skips it
            inputs["mask"][1, :32] = -np.inf
    got = _run_host(plan, inputs, tmp_path)
    want = execute_plan(plan, inputs, mode="device")
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-2 if dtype != "fp32" else 1e-5, atol=2e-2 if dtype != "fp32" else 1e-5)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_generated_gather_and_column_copies_match_the_reference(dtype, tmp_path):
    """Rows of a table at token ids (the Embedding gather with its id check) and columns of the rows taken
    (Columns), then an elementwise kernel, through their generated CUDA executed on the host, equal the
    reference; an id outside the table stops the kernel."""
    b = GraphBuilder(f"gather-columns-{dtype}")
    b.input("ids", (4, 6), "fp32")
    b.input("table", (50, 40), dtype)
    taken = b.op("taken", "Columns", [b.op("rows", "Embedding", ["ids", "table"])], {"offset": 8, "width": 24})
    graph = b.build([b.op("out", "Silu", [taken])])
    plan = _plan(graph, lambda p: len(p.kernels) == 3)
    assert [k.describe() for k in plan.kernels] == ["standalone[Embedding]", "standalone[Columns]", "elementwise[Silu]"]
    inputs = random_inputs(graph, seed=5)
    got = _run_host(plan, inputs, tmp_path)
    want = execute_plan(plan, inputs, mode="device")
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
    with pytest.raises(subprocess.CalledProcessError):
        _run_host(plan, {**inputs, "ids": np.full_like(inputs["ids"], 50.0)}, tmp_path)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_generated_regroup_copies_match_the_reference(dtype, tmp_path):
    """Token rows viewed as rows of a head's length (Regroup), each shifted by its max in a row kernel, viewed
    back: through their generated CUDA executed on the host, equal the reference."""
    b = GraphBuilder(f"per-head-{dtype}")
    b.input("x", (6, 32), dtype)
    heads = b.op("heads", "Regroup", ["x"], {"width": 8})
    shifted = b.op("shifted", "SubRow", [heads, b.op("top", "RowMax", [heads])])
    graph = b.build([b.op("out", "Regroup", [shifted], {"width": 32})])
    plan = _plan(graph, lambda p: len(p.kernels) == 3)
    assert [k.describe() for k in plan.kernels] == ["standalone[Regroup]", "elementwise[RowMax+SubRow]",
                                                   "standalone[Regroup]"]
    inputs = random_inputs(graph, seed=6)
    got = _run_host(plan, inputs, tmp_path)
    np.testing.assert_allclose(got[0], execute_plan(plan, inputs, mode="device")[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_generated_image_kernels_match_the_reference(dtype, tmp_path):
    """A small convolutional network's standalone kernels through their generated CUDA (channels-last copies,
    Im2col with padding, stride and dilation, max and average pooling, the spatial mean, a depthwise convolution),
    executed on the host, equal the reference."""
    window = {"height": 7, "width": 6, "kh": 3, "kw": 2, "sh": 2, "sw": 1, "ph": 1, "pw": 1, "dh": 1, "dw": 2}
    pool = {"height": 7, "width": 6, "kh": 3, "kw": 3, "sh": 2, "sw": 2, "ph": 1, "pw": 1, "dh": 1, "dw": 1}
    b = GraphBuilder(f"images-{dtype}")
    b.input("x", (2 * 5 * 7, 6), dtype)  # (2, 5, 7, 6) in torch's order, stored flat
    rows = b.op("rows", "ChannelsLast", ["x"], {"channels": 5, "pixels": 42})
    patches = b.op("patches", "Im2col", [rows], window)
    pooled = b.op("pooled", "MaxPool", [rows], pool)
    back = b.op("back", "ChannelsFirst", [rows], {"pixels": 42, "width": 6})
    mean = b.op("mean", "SpatialMean", [rows], {"pixels": 42})
    b.input("taps", (6, 5), dtype)
    depthwise = b.op("depthwise", "DepthwiseConv", [rows, "taps"], window)
    averaged = [b.op(f"avg{i}", "AvgPool", [rows], {**pool, "include_pad": inc, "divisor": div})
                for i, (inc, div) in enumerate(((1, 0), (0, 0), (1, 4)))]
    graph = b.build([patches, pooled, back, mean, depthwise, *averaged])
    plan = _plan(graph, lambda p: True)
    assert {k.body.op for k in plan.kernels} == {"ChannelsLast", "Im2col", "MaxPool", "ChannelsFirst", "SpatialMean",
                                                 "DepthwiseConv", "AvgPool"}
    inputs = random_inputs(graph, seed=6)
    got = _run_host(plan, inputs, tmp_path)
    want = execute_plan(plan, inputs, mode="device")
    tol = 1e-6 if dtype == "fp32" else 1e-2
    for a, w in zip(got, want, strict=True):
        np.testing.assert_allclose(a, w, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_generated_biased_attention_matches_the_reference(dtype, tmp_path):
    """softmax(scale * q@kT + bias) @ v with a bias row per query (T5's relative position bias), the rule's
    one BiasedAttention kernel, through its generated CUDA executed on the host, equals the reference."""
    b = GraphBuilder(f"biased-attention-{dtype}")
    for name, shape in (("q", (3, 9, 8)), ("k", (3, 11, 8)), ("v", (3, 11, 6)), ("bias", (3, 9, 11))):
        b.input(name, shape, dtype)
    s = b.op("s", "Add", [b.op("scaled", "Affine", [b.op("qk", "BatchScores", ["q", "k"])], {"a": 0.5, "b": 0.0}),
                          "bias"])
    e = b.op("e", "Exp", [b.op("shift", "SubRow", [s, b.op("top", "RowMax", [s])])])
    p = b.op("p", "DivRow", [e, b.op("sum", "RowSum", [e])])
    graph = b.build([b.op("out", "BatchApply", [p, "v"])])
    plan = _plan(graph, lambda p: [k.body.op for k in p.kernels] == ["BiasedAttention"])
    inputs = random_inputs(graph, seed=4)
    got = _run_host(plan, inputs, tmp_path)
    want = execute_plan(plan, inputs, mode="device")
    tol = 1e-5 if dtype == "fp32" else 2e-2
    np.testing.assert_allclose(got[0], want[0], rtol=tol, atol=tol)
