"""CUDA kernels of standalone ops: attention's head layouts and batched products, and the fused attention kernel
(an online softmax: the scores are never stored)."""

from __future__ import annotations

import math
from collections.abc import Callable

from backends.codegen import (
    CodegenError,
)
from backends.cupy.kernel import CTYPE, FROM_FLOAT, PRELUDE, TO_FLOAT, CudaKernel, kernel_name, shape_salt
from planner.core.graph import TensorType
from planner.core.kinds import KernelKind
from planner.core.ops import GATHERS, LAYOUT_COPIES
from planner.core.plans import Expr, Kernel, Load
from planner.core.shapes import WINDOW, window_out

# ---------------------------------------------------------------- standalone kernels
# attention's layouts and batched products, each one thread per output element in a grid-stride loop (no shared
# memory, no barrier, the same arithmetic as the C backend's); the fused attention, a warp per query row

STANDALONE_BLOCK = 128
#: the channels-last image ops (``core.ops``): layout copies, Im2col, the pools
IMAGE_OPS = frozenset({"ChannelsLast", "ChannelsFirst", "Im2col", "MaxPool", "AvgPool", "SpatialMean",
                       "DepthwiseConv"})
ATTENTION_OPS = frozenset({"Attention", "MaskedAttention", "BiasedAttention"})


def _grid_stride(total: int, lines: list[str]) -> list[str]:
    return [f"  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < {total}LL;",
            "       e += (long long)blockDim.x * gridDim.x) {", *(f"    {line}" for line in lines), "  }"]


def _layout_lines(body: Expr, shape: tuple[int, ...], out_shape: tuple[int, ...]) -> list[str]:
    """``out[e] = p0[source index]`` for the layout copies (``core.ops.LAYOUT_COPIES``: copies of the bits)."""
    a = body.attr_dict
    if body.op == "Columns":
        offset, width = int(a["offset"]), int(a["width"])
        return [f"out[e] = p0[(e / {width}) * {shape[-1]} + {offset} + e % {width}];"]
    if body.op == "Regroup":
        return ["out[e] = p0[e];"]
    heads = int(a["heads"])
    if body.op == "Heads":
        seq, offset, width = int(a["seq"]), int(a["offset"]), int(a["width"])
        dh, cols = width // heads, shape[-1]
        return [f"const long long d = e % {dh}, s = (e / {dh}) % {seq}, g = e / {dh * seq};",
                f"out[e] = p0[((g / {heads}) * {seq} + s) * {cols} + {offset} + (g % {heads}) * {dh} + d];"]
    if body.op == "Merge":
        _, seq, d = shape
        return [f"const long long col = e % {heads * d}, row = e / {heads * d};",
                f"out[e] = p0[(((row / {seq}) * {heads} + col / {d}) * {seq} + row % {seq}) * {d} + col % {d}];"]
    group = math.prod(out_shape[1:])  # GroupRepeat: each output group copies input group g / heads
    return [f"out[e] = p0[(e / {group * heads}) * {group} + e % {group}];"]


def _image_lines(body: Expr, shape: tuple[int, ...], out_shape: tuple[int, ...], load: Callable[[int, str], str],
                 store: Callable[[str], str]) -> list[str]:
    """One output element of the channels-last ops: the layout copies (bits), Im2col (0 in the padding),
    MaxPool (-inf padding), AvgPool and SpatialMean (fp32 sums) and DepthwiseConv (an fp32 sum over the taps of weight
    ``p1``), over input ``p0`` of ``shape``."""
    a = body.attr_dict
    if body.op == "ChannelsLast":
        c, px = int(a["channels"]), int(a["pixels"])
        return [f"const long long ch = e % {c}, p = (e / {c}) % {px}, n = e / {c * px};",
                f"out[e] = p0[(n * {c} + ch) * {px} + p];"]
    if body.op == "ChannelsFirst":
        px, c = int(a["pixels"]), shape[-1]
        return [f"const long long p = e % {px}, ch = (e / {px}) % {c}, n = e / {px * c};",
                f"out[e] = p0[(n * {px} + p) * {c} + ch];"]
    c = shape[-1]
    if body.op == "SpatialMean":
        px = int(a["pixels"])
        return [f"const long long ch = e % {c}, n = e / {c};", "float acc = 0.0f;",
                f"for (long long p = 0; p < {px}; ++p) acc += {load(0, f'(n * {px} + p) * {c} + ch')};",
                store(f"acc / {float(px)!r}f")]
    h, w, kh, kw, sh, sw, ph, pw, dh, dw = (int(a[x]) for x in WINDOW)
    oh, ow = window_out(a)
    at = f"((n * {h} + ih) * {w} + iw) * {c} + ch"
    inside = f"ih >= 0 && ih < {h} && iw >= 0 && iw < {w}"
    if body.op == "Im2col":
        return [f"const long long ch = e % {c}, j = (e / {c}) % {kw}, i = (e / {c * kw}) % {kh};",
                f"const long long px = e / {c * kw * kh}, ox = px % {ow}, oy = (px / {ow}) % {oh}, n = px / {ow * oh};",
                f"const long long ih = oy * {sh} - {ph} + i * {dh}, iw = ox * {sw} - {pw} + j * {dw};",
                f"if ({inside}) out[e] = p0[{at}]; else {{ {store('0.0f')} }}"]
    pixel = f"const long long ch = e % {c}, px = e / {c}, ox = px % {ow}, oy = (px / {ow}) % {oh}, n = px / {ow * oh};"
    if body.op == "AvgPool":  # an fp32 sum, divided as the op says
        divisor = int(a["divisor"]) or (kh * kw if int(a["include_pad"]) else 0)
        return [pixel, "float acc = 0.0f; long long inside = 0;",
                f"for (long long i = 0; i < {kh}; ++i) for (long long j = 0; j < {kw}; ++j) {{",
                f"  const long long ih = oy * {sh} - {ph} + i * {dh}, iw = ox * {sw} - {pw} + j * {dw};",
                f"  if ({inside}) {{ acc += {load(0, at)}; ++inside; }}",
                "}", store(f"acc / {float(divisor)!r}f" if divisor else "acc / (float)inside")]
    if body.op == "DepthwiseConv":  # each channel's taps (the weight's (kh*kw, C) rows), summed in fp32
        return [pixel, "float acc = 0.0f;",
                f"for (long long i = 0; i < {kh}; ++i) for (long long j = 0; j < {kw}; ++j) {{",
                f"  const long long ih = oy * {sh} - {ph} + i * {dh}, iw = ox * {sw} - {pw} + j * {dw};",
                f"  if ({inside}) acc += {load(0, at)} * {load(1, f'(i * {kw} + j) * {c} + ch')};",
                "}", store("acc")]
    return [pixel,
            "float m = fp_neg_inf();",
            f"for (long long i = 0; i < {kh}; ++i) for (long long j = 0; j < {kw}; ++j) {{",
            f"  const long long ih = oy * {sh} - {ph} + i * {dh}, iw = ox * {sw} - {pw} + j * {dw};",
            f"  if ({inside}) m = fp_max(m, {load(0, at)});",
            "}", store("m")]


def _product_lines(body: Expr, shapes: list[tuple[int, ...]], load: Callable[[int, str], str],
                   store: Callable[[str], str]) -> list[str]:
    """One element of a batched product: BatchScores (q @ k^T, causal: keys after the query are -inf) or
    BatchApply (p @ v), summed in fp32."""
    (g_, s_, k_), b_shape = shapes
    if body.op == "BatchScores":
        t_ = b_shape[1]
        causal = bool(body.attr_dict.get("causal", 0))
        head = [f"const long long t = e % {t_}, i = (e / {t_}) % {s_}, g = e / {s_ * t_};"]
        if causal:
            head.append(f"if (t > i) {{ {store('fp_neg_inf()')} continue; }}")
        a_at, b_at = f"(g * {s_} + i) * {k_} + x", f"(g * {t_} + t) * {k_} + x"
    else:
        n_ = b_shape[2]
        head = [f"const long long n = e % {n_}, i = (e / {n_}) % {s_}, g = e / {s_ * n_};"]
        a_at, b_at = f"(g * {s_} + i) * {k_} + x", f"(g * {k_} + x) * {n_} + n"
    return [*head, "float acc = 0.0f;", f"for (long long x = 0; x < {k_}; ++x) acc += {load(0, a_at)} * {load(1, b_at)};",
            store("acc")]


def _attention_lines(body: Expr, shapes: list[tuple[int, ...]], load: Callable[[int, str], str],
                     store_at: Callable[[str, str], str]) -> list[str]:
    """One query row of softmax(scale * q@k^T [+ mask]) @ v per warp, with an online softmax: the lanes split the
    head's columns (the query's in registers), each score is their sum by shuffles, taken from lane 0 so every
    lane holds the same bits; the running max, sum and output columns are rescaled as the max grows. A key whose
    score is -inf (hidden) adds nothing, so a query whose every key is hidden gives 0/0 (NaN) as the unfused
    form does; a NaN score makes its row NaN."""
    (_, s_, d_), (_, t_, _), (_, _, e_) = shapes[:3]
    a = body.attr_dict
    scale, causal = float(a["scale"]), bool(a.get("causal", 0))
    at = {"MaskedAttention": f"g * {t_} + j",  # a row of keys per group
          "BiasedAttention": f"(g * {s_} + i) * {t_} + j"}.get(body.op)  # a row per query
    mask = "" if at is None else f" + {load(3, at)}"
    last = f"(i + 1 < {t_} ? i + 1 : {t_})" if causal else f"{t_}"
    dq, eq = -(-d_ // 32), -(-e_ // 32)  # this lane's query and output columns: lane, lane + 32, ...
    return [f"const long long i = e % {s_}, g = e / {s_};",
            f"float q[{dq}], acc[{eq}];",
            f"for (int u = 0; u < {dq}; ++u) {{ const long long x = lane + 32 * u; "
            f"q[u] = x < {d_} ? {load(0, f'(g * {s_} + i) * {d_} + x')} : 0.0f; }}",
            f"for (int u = 0; u < {eq}; ++u) acc[u] = 0.0f;",
            "float m = fp_neg_inf(), l = 0.0f;",
            f"for (long long j = 0; j < {last}; ++j) {{",
            "  float dot = 0.0f;",
            f"  for (int u = 0; u < {dq}; ++u) {{ const long long x = lane + 32 * u; "
            f"if (x < {d_}) dot += q[u] * {load(1, f'(g * {t_} + j) * {d_} + x')}; }}",
            "  for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);",
            "  dot = __shfl_sync(0xffffffffu, dot, 0);",
            f"  const float sc = {scale!r}f * dot{mask};",
            "  if (sc == fp_neg_inf()) continue;  // the same on every lane",
            "  const float mn = fp_max(m, sc), alpha = expf(m - mn), pj = expf(sc - mn);",
            "  l = l * alpha + pj;",
            f"  for (int u = 0; u < {eq}; ++u) {{ const long long c = lane + 32 * u; "
            f"if (c < {e_}) acc[u] = acc[u] * alpha + pj * {load(2, f'(g * {t_} + j) * {e_} + c')}; }}",
            "  m = mn;",
            "}",
            f"for (int u = 0; u < {eq}; ++u) {{ const long long c = lane + 32 * u; "
            f"if (c < {e_}) {{ {store_at(f'(g * {s_} + i) * {e_} + c', 'acc[u] / l')} }} }}"]


def _warp_stride(rows: int, lines: list[str]) -> list[str]:
    """A warp per row ``e``, the warps striding over the rows (every lane of a warp takes the same rows)."""
    return ["  const int lane = threadIdx.x & 31;",
            f"  for (long long e = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; e < {rows}LL;",
            "       e += ((long long)blockDim.x * gridDim.x) >> 5) {", *(f"    {line}" for line in lines), "  }"]


def _loop(body: Expr, shapes: list[tuple[int, ...]], out_shape: tuple[int, ...],
          load: Callable[[int, str], str], store_at: Callable[[str, str], str]) -> tuple[int, list[str]]:
    """The kernel's threads (for its grid) and its body: a grid-stride loop over the output's elements, or over
    query rows a warp each (the fused attention)."""
    total = math.prod(out_shape)
    if body.op in ATTENTION_OPS:
        rows = math.prod(out_shape[:-1])
        return rows * 32, _warp_stride(rows, _attention_lines(body, shapes, load, store_at))
    if body.op in IMAGE_OPS:
        lines = _image_lines(body, shapes[0], out_shape, load, lambda v: store_at("e", v))
    elif body.op in LAYOUT_COPIES:
        lines = _layout_lines(body, shapes[0], out_shape)
    elif body.op in GATHERS:  # ids carried as fp32: one that is no row of the table stops the kernel (an error)
        d, rows = int(out_shape[-1]), shapes[1][0]
        lines = [f"const float f = p0[e / {d}]; const long long r = (long long)f;",
                 f"if (!(f == (float)r && r >= 0 && r < {rows}LL)) fp_bad_index();",
                 f"out[e] = p1[r * {d} + e % {d}];"]
    elif body.op in ("BatchScores", "BatchApply"):
        lines = _product_lines(body, shapes, load, lambda v: store_at("e", v))
    else:
        raise CodegenError(f"standalone op {body.op} has no CUDA form")
    return total, _grid_stride(total, lines)


def standalone_kernel(k: Kernel, tensors: dict[str, TensorType]) -> CudaKernel:
    """A standalone kernel (one standalone op over loaded tensors) as CUDA."""
    body = k.body
    if not all(isinstance(a, Load) for a in body.args):
        raise CodegenError(f"standalone kernel {k.describe()} reads computed values: no CUDA form")
    ins = [a.tensor for a in body.args if isinstance(a, Load)]
    out_t = tensors.get(k.out, body.type)
    shapes = [tuple(tensors[t].shape) for t in ins]
    load = lambda i, at: TO_FLOAT[tensors[ins[i]].dtype].format(f"p{i}[{at}]")  # noqa: E731
    store_at = lambda at, v: f"out[{at}] = {FROM_FLOAT[out_t.dtype].format(v)};"  # noqa: E731
    total, loop = _loop(body, shapes, tuple(out_t.shape), load, store_at)
    params = [f"const {CTYPE[tensors[t].dtype]}* __restrict__ p{i}" for i, t in enumerate(ins)]
    params.append(f"{CTYPE[out_t.dtype]}* __restrict__ out")
    name = kernel_name(KernelKind.STANDALONE, k.out, shape_salt(k, tensors))
    src = [PRELUDE, f'extern "C" __global__ void {name}({", ".join(params)}) {{', *loop, "}"]
    work = max(1, -(-total // STANDALONE_BLOCK))
    return CudaKernel(name, KernelKind.STANDALONE, "\n".join(src) + "\n", (*ins, k.out), STANDALONE_BLOCK,
                      (work, 1), grid_per_sm=8)


