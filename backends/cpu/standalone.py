"""The CPU forms of the standalone ops: attention's head layouts, its batched products and the fused kernel.

Each runs on fp32 buffers bound in the plan's memory: ``Heads`` and ``Merge`` are numpy copies through
strided views, ``BatchScores`` and ``BatchApply`` the GEMM library's batched product, and ``Attention`` one
generated C function (:func:`attention_source`) that computes softmax(scale * q@k^T) @ v a block of keys
at a time with an online softmax, groups split across the worker pool.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.codegen import CodegenError
from backends.cpu import parallel
from backends.cpu.codegen import storage_forms
from backends.cpu.compiler import recorded_choice
from backends.cpu.prelude import PRELUDE, SYMBOL, with_simd
from planner.core import semantics as sem
from planner.core.dtypes import DTYPES, numpy_dtype
from planner.core.env import env_choice
from planner.core.machine import cpu_model
from planner.core.ops import POOLS
from planner.core.plans import Expr, Load
from planner.core.shapes import WINDOW, window_out

log = logging.getLogger(__name__)

#: vectors of keys per block of the attention kernel, and of value columns (:func:`attention_source`)
KEY_VECTORS = 2
#: keys per block of the attention kernel with 16-lane vectors (with 8 lanes, half as many)
KEY_BLOCK = KEY_VECTORS * 16


@dataclass(frozen=True)
class GroupLayout:
    """Where the generated attention kernel finds group g's (rows, width) block of an operand (or writes its
    result's): at element ``((g / repeat) / heads) * rows * row_stride + ((g / repeat) % heads) * head_step``, its
    rows ``row_stride`` apart.  A (G, rows, width) buffer is ``contiguous``; a Heads view of token rows
    (:func:`heads_layout`) reads each head's columns in place; a GroupRepeat view (``repeated``) reads group
    g / repeat of its source; the merged layout writes each head's columns of the token rows (a Merge's)."""

    rows: int
    row_stride: int
    heads: int = 1
    head_step: int = 0
    repeat: int = 1

    @classmethod
    def contiguous(cls, rows: int, width: int) -> GroupLayout:
        return cls(rows, width)

    def repeated(self, times: int) -> GroupLayout:
        return GroupLayout(self.rows, self.row_stride, self.heads, self.head_step, self.repeat * times)

    def offset_c(self, g: str = "g") -> str:
        """C for group ``g``'s first element."""
        group = g if self.repeat == 1 else f"({g} / {self.repeat})"
        if self.heads == 1:
            return f"{group} * {self.rows * self.row_stride}"
        return f"({group} / {self.heads}) * {self.rows * self.row_stride} + ({group} % {self.heads}) * {self.head_step}"


def attention_layouts(body: Expr, out: str, layouts: Mapping[str, GroupLayout]) -> dict[str, GroupLayout]:
    """The :class:`GroupLayout` of each operand and of the result ``out`` of attention ``body`` that is not
    contiguous, by role (``q``, ``k``, ``v``, ``mask``, ``out``), from the plan's ``layouts`` by tensor."""
    order = [a.tensor for a in body.args if isinstance(a, Load)]
    roles = (*("q", "k", "v", "mask")[:len(order)], "out")
    return {role: layouts[n] for role, n in zip(roles, [*order, out], strict=True) if n in layouts}


def heads_layout(body: Expr, source_width: int) -> GroupLayout:
    """A Heads result read in place from its token rows (``source_width`` columns each, the view's first element
    at the Heads' column offset): head h of batch b at row b * seq, column h * width / heads."""
    attrs = body.attr_dict
    heads, seq, width = (int(attrs[a]) for a in ("heads", "seq", "width"))
    return GroupLayout(seq, source_width, heads, width // heads)


def merged_layout(heads: int, seq: int, width: int) -> GroupLayout:
    """An attention result written as its Merge's token rows: group b * heads + h at row b * seq, column h * width."""
    return GroupLayout(seq, heads * width, heads, width)

#: ``bmm(a, b, out)``: ``out[g] = a[g] @ b[g]`` for fp32 3-D arrays (``b`` may be a transposed view)
BatchMatMul = Callable[[np.ndarray, np.ndarray, np.ndarray], None]


def numpy_bmm(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    np.matmul(a, b, out=out)


def torch_bmm() -> BatchMatMul:
    """``torch.bmm`` on zero-copy views (torch is imported: the GEMM library choice checked it)."""
    import torch  # optional dependency

    def bmm(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        torch.bmm(torch.from_numpy(a), torch.from_numpy(b), out=torch.from_numpy(out))

    return bmm


def torch_bmm_16bit(dtype: str) -> BatchMatMul:
    """``torch.bmm`` of 16-bit operands held as their bits (``uint16``), in torch's native product (the
    caller checked :func:`backends.cpu.gemm.native_16bit`), rounded to ``dtype``."""
    import torch  # optional dependency

    kind = getattr(torch, DTYPES[dtype].torch_name)

    def bmm(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        torch.bmm(torch.from_numpy(a).view(kind), torch.from_numpy(b).view(kind), out=torch.from_numpy(out).view(kind))

    return bmm


def torch_attention(body: Expr, dtype: str) -> Callable[..., Any]:
    """``attend(q, k, v, mask=None)``: torch's fused ``scaled_dot_product_attention`` of an Attention kernel's
    operands (fp32, or a 16-bit dtype's bits), the result a (batch, heads, seq, e) tensor (fp32 accumulation and an
    online softmax, as the generated kernel; its ``is_causal`` is the op's top-left mask): for 16-bit dtypes torch
    multiplies natively, and fp32 where it measured faster (:func:`measured_attention`).  An operand is (groups, seq, d) as stored, or a (batch, heads, seq, d) strided view of the
    projection it was taken from (:func:`heads_view`): torch's kernel reads either, and given views it writes
    its result in (batch, seq, heads, e) order, which :func:`merged_rows` then reads as token rows."""
    import torch  # optional dependency

    kind = getattr(torch, DTYPES[dtype].torch_name)
    scale, causal = float(body.attr_dict["scale"]), bool(body.attr_dict.get("causal", 0))

    def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None) -> Any:
        # 4-D operands: torch's fused CPU kernel takes 4-D ones only (3-D ran its math path, 6x slower)
        lead = next((x.shape[:2] for x in (q, k, v) if x.ndim == 4), (1, q.shape[0]))
        q_t, k_t, v_t = (torch.from_numpy(x if x.ndim == 4 else x.reshape(*lead, *x.shape[1:])).view(kind)
                         for x in (q, k, v))
        # a mask's one row of keys per group, or a bias's row per query: broadcast over the queries, or not
        m_t = None if mask is None else torch.from_numpy(mask.reshape(*lead, -1, mask.shape[-1])).view(kind)
        return torch.nn.functional.scaled_dot_product_attention(q_t, k_t, v_t, attn_mask=m_t, is_causal=causal,
                                                                scale=scale)

    return attend


#: which kernel computes an fp32 attention: ``auto`` (the default) the faster of the generated kernel and torch's
#: fused one where torch is loaded, measured once per machine, versions, shapes and threads
#: (:func:`measured_attention`); ``generated`` or ``torch`` force one
ATTENTION_ENV = "FUSION_PLANNER_CPU_ATTENTION"
ATTENTION_KERNELS = ("generated", "torch")
#: torch's kernel must be this much faster than the generated one to replace it: the measurement's noise
ATTENTION_MARGIN = 0.05
#: the generated attention kernel's design (:func:`attention_source`): a choice recorded against another is made again
GENERATED_ATTENTION = "register-blocked-2"


def measured_attention(body: Expr, shapes: Mapping[str, tuple[int, ...]], threads: int,
                       measure: Callable[[], Mapping[str, float]], *, code: Sequence[str]) -> str:
    """``generated`` or ``torch``: which kernel computes fp32 attention ``body`` (operands of ``shapes``) on
    ``threads`` threads (:data:`ATTENTION_ENV`).  ``auto`` takes the choice recorded in the kernel cache for this
    CPU, torch's version, op, shapes, threads and the generated code's target flags (``code``: AVX2 code on an
    AVX-512 machine is another contender), else times both (``measure()``: seconds per kernel) and keeps
    torch's only where it is :data:`ATTENTION_MARGIN` faster.  On one Sapphire Rapids core (2026-12-05) torch's
    took 6.7 ms against the generated kernel's 10.2 for 12 heads of 512 tokens, and 7.0 against 5.5 causal."""
    value = env_choice(ATTENTION_ENV, ("auto", *ATTENTION_KERNELS), "auto")
    if value != "auto":
        return value
    import torch  # optional dependency (auto measures only where it is loaded)

    key = {"cpu": cpu_model(), "torch": torch.__version__, "generated": GENERATED_ATTENTION, "op": body.op,
           "causal": int(body.attr_dict.get("causal", 0)),
           "shapes": [list(shapes[a.tensor]) for a in body.args if isinstance(a, Load)], "threads": threads,
           "code": list(code)}

    def decide() -> tuple[str, Mapping[str, float]]:
        seconds = measure()
        choice = "torch" if seconds["torch"] * (1 + ATTENTION_MARGIN) < seconds["generated"] else "generated"
        log.info("fp32 %s %s on %d thread(s): %s (generated %.2f ms, torch %.2f ms)", body.op, key["shapes"],
                 threads, choice, seconds["generated"] * 1e3, seconds["torch"] * 1e3)
        return choice, seconds

    return recorded_choice("attention", key, ATTENTION_KERNELS, decide, "the attention kernel choice")


def heads_view(body: Expr) -> Callable[[np.ndarray], np.ndarray]:
    """``view(x)``: a Heads kernel's result as a (batch, heads, seq, width/heads) strided view of its token rows
    ``x``, no copy: for readers that take strided operands (torch's fused attention)."""
    attrs = body.attr_dict
    heads, seq, offset, width = (int(attrs[a]) for a in ("heads", "seq", "offset", "width"))

    def view(x: np.ndarray) -> np.ndarray:
        cols = x.reshape(-1, seq, x.shape[-1])[:, :, offset:offset + width]
        return cols.reshape(-1, seq, heads, width // heads).transpose(0, 2, 1, 3)

    return view


def merged_rows(y: np.ndarray) -> np.ndarray:
    """A (batch, heads, seq, e) attention result as (batch, seq, heads, e): the Merge of it, a view."""
    return y.transpose(0, 2, 1, 3)


def batch_matmul(library: str) -> BatchMatMul:
    return torch_bmm() if library == "torch" else numpy_bmm


#: the attention kernel's register block: the scores of this many queries against :data:`KEY_VECTORS` vectors of keys
#: (and their outputs against as many vectors of value columns) are accumulators kept in registers, 16 of 32 with
#: AVX-512; 12 of the 16 of AVX2, which leave room for the two vectors of keys and the query value broadcast
#: (the shape of the classic 6 x 16 AVX2 GEMM micro-kernel).  One Zen 4 core, 24 groups of 128 x 128, d 64, with
#: a bias: AVX2 code 1.36 ms at 6 x 2 vectors, 2.03 at 4 x 3, 1.93 at 3 x 4, 1.59 at 8 x 1; AVX-512 code 1.26 at
#: 8 x 2, 1.27 at 6 x 4, 1.34 at 12 x 2, 1.61 at 8 x 3 (2026-12-07, the online-softmax kernel before it: 2.35 and 1.77)
QUERY_BLOCK = 8
QUERY_BLOCK_AVX2 = 6


def attention_source(seq: int, keys: int, dim: int, vdim: int, scale: float, causal: bool, masked: bool = False,
                     biased: bool = False, layouts: Mapping[str, GroupLayout] | None = None) -> str:
    """C for softmax(scale * q@k^T) @ v over groups [g0, g1): q (S, D), k (T, D), v (T, E), out (S, E) per group.

    Per group the keys are transposed once into a zero-padded scratch (D, T rounded up to a key block). Each
    block of :data:`QUERY_BLOCK` queries (:data:`QUERY_BLOCK_AVX2` with 8-lane vectors) then takes three steps,
    each a small register-blocked product or pass over one scratch row per query, (T) floats, in L1 or L2: its
    scores against each block of ``KEY_VECTORS`` vectors of keys, built in registers by D rounds of
    multiply-adds, scaled, the mask or bias added, stored; each row's max, exponentials (libmvec) and sum; and
    the rows of exponentials times the values, a block of value columns at a time in registers, divided by the
    sums.  The [S, T] scores of a group never exist; the two products run as a GEMM micro-kernel does (the
    online-softmax kernel this replaced kept its outputs in memory and ran at 0.6-0.75x its speed).  Causal:
    query i reads keys 0..i, key blocks past a query block are skipped.  ``masked``: a further input, one row
    of T keys per group added to the scaled scores (an attention mask).  ``biased``: the further input is a row
    of T per query (S, T) per group (T5's relative position bias, a causal or padding mask as a bias).  Either
    is read in place but for a row's last key block where T does not fill it, copied zero-padded; a key block it
    hides (-inf) from every query of a block is skipped where no score of the group can be NaN or infinite
    (``D max|q| max|k| scale`` below a bound), its scores -inf as the unfused form's.  A NaN score makes its row
    NaN, as in the unfused form; so does a query whose every key is hidden (0/0), as there.  ``layouts``: where each group's block of ``q``, ``k``, ``v``,
    ``mask`` and ``out`` lies (:class:`GroupLayout`; contiguous (G, rows, width) where not given); a mask's
    rows are T apart."""
    if not scale > 0:
        raise CodegenError(f"attention kernel: scale must be positive, got {scale!r}")
    s_, t_, d_, e_ = (int(x) for x in (seq, keys, dim, vdim))
    lay = {"q": GroupLayout.contiguous(s_, d_), "k": GroupLayout.contiguous(t_, d_), "v": GroupLayout.contiguous(t_, e_),
           "mask": GroupLayout.contiguous(s_ if biased else 1, t_), "out": GroupLayout.contiguous(s_, e_),
           **(layouts or {})}
    if lay["mask"].row_stride != t_:
        raise CodegenError(f"attention kernel: a mask's rows must be {t_} apart, got {lay['mask'].row_stride}")
    mask_param = "const float* restrict mask, " if masked or biased else ""
    mask_at = f"mask + {lay['mask'].offset_c()}" if masked or biased else "NULL"
    return with_simd(PRELUDE + f"""
#include <stdlib.h>
#define FP_S {s_}
#define FP_T {t_}
#define FP_D {d_}
#define FP_E {e_}
#if FP_VL == 16
#define FP_QB {QUERY_BLOCK}
#else
#define FP_QB {QUERY_BLOCK_AVX2}
#endif
#define FP_NV {KEY_VECTORS}
#define FP_KB (FP_NV * FP_VL)
#define FP_TP (((FP_T + FP_KB - 1) / FP_KB) * FP_KB)
#define FP_NB (FP_TP / FP_KB)
#define FP_EP (((FP_E + FP_KB - 1) / FP_KB) * FP_KB)
#define FP_CAUSAL {int(bool(causal))}
#define FP_MASKED {int(bool(masked))}
#define FP_BIASED {int(bool(biased))}
#define FP_QRS {lay["q"].row_stride}
#define FP_KRS {lay["k"].row_stride}
#define FP_VRS {lay["v"].row_stride}
#define FP_ORS {lay["out"].row_stride}
/* no score reaches this magnitude where |q| and |k| are bounded so: below FLT_MAX by a margin for rounding */
#define FP_SCORE_BOUND 1e37

/* the row of T keys added to query i's scores: a bias's row i, or the mask's one row (NULL: none) */
static inline const float* fp_added_row(const float* mg, int64_t i) {{
    return FP_BIASED ? mg + i * FP_T : mg;
}}

/* max |x_i| over n floats (NaN where one is NaN), in vectors: a scalar max is a serial chain as slow as the
   products it guards */
static float fp_abs_max(const float* x, int64_t n) {{
    fp_va m = fp_va_fill(0.0f);
    const fp_vai magnitude = (fp_vai)fp_va_fill(0.0f) | 0x7fffffff;
    int64_t i = 0;
    for (; i + FP_VL <= n; i += FP_VL) m = fp_va_max((fp_va)((fp_vai)fp_va_load(x + i) & magnitude), m);
    float top = fp_va_hmax(m);
    for (; i < n; ++i) top = fp_max(fabsf(x[i]), top);
    return top;
}}

/* Does the mask or bias hide every key of block b (-inf) from each query i0 .. i0 + nq - 1? */
static int fp_hidden_block(const float* mg, int64_t i0, int64_t nq, int64_t b) {{
    const int64_t t1 = (b + 1) * FP_KB < FP_T ? (b + 1) * FP_KB : FP_T;
    for (int64_t r = 0; r < (FP_BIASED ? nq : 1); ++r) {{
        const float* row = fp_added_row(mg, i0 + r);
        for (int64_t t = b * FP_KB; t < t1; ++t)
            if (row[t] != -INFINITY) return 0;
    }}
    return 1;
}}

void {SYMBOL}(const float* restrict q, const float* restrict k, const float* restrict v, {mask_param}float* restrict out,
               int64_t g0, int64_t g1, int64_t unused) {{
    (void)unused;
    const float scale = {float(scale)!r}f;
    float* kt = (float*)aligned_alloc(64, sizeof(float) * (FP_D * FP_TP + FP_QB * FP_TP + FP_KB
                                                           + (FP_E == FP_EP ? 0 : FP_T * FP_EP)));
    if (!kt) return;
    float* p = kt + FP_D * FP_TP;  /* a block of queries' scores, then their exponentials */
    float* tail = p + FP_QB * FP_TP;  /* the last key block of a mask or bias row, zero-padded */
    float* vpad = tail + FP_KB;  /* the values, their rows padded to whole blocks of columns (where E needs it) */
    int live[FP_NB];  /* the key blocks some query of a block sees */
    fp_vai lane;
    for (int j = 0; j < FP_VL; ++j) lane[j] = j;
    const fp_va ninf = fp_va_fill(-INFINITY);
    for (int64_t g = g0; g < g1; ++g) {{
        const float* qg = q + {lay["q"].offset_c()};
        const float* kg = k + {lay["k"].offset_c()};
        const float* vg = v + {lay["v"].offset_c()};
        const float* mg = {mask_at};
        float* og = out + {lay["out"].offset_c()};
        for (int64_t d = 0; d < FP_D; ++d) {{
            float* row = kt + d * FP_TP;
            for (int64_t t = 0; t < FP_T; ++t) row[t] = kg[t * FP_KRS + d];
            for (int64_t t = FP_T; t < FP_TP; ++t) row[t] = 0.0f;
        }}
        /* a block the mask hides is skipped only where every score is finite (then its -inf is the unfused
           form's): |q.k| <= D max|q| max|k| (a NaN or inf fails the test) */
        int skips = 0;
        if (FP_MASKED || FP_BIASED) {{
            float qmax = 0.0f;
            for (int64_t i = 0; i < FP_S; ++i) qmax = fp_max(fp_abs_max(qg + i * FP_QRS, FP_D), qmax);
            skips = (double)qmax * fp_abs_max(kt, FP_D * FP_TP) * FP_D * scale < FP_SCORE_BOUND;
        }}
        const float* vb = vg;
        int64_t vrs = FP_VRS;
        if (FP_E != FP_EP) {{
            for (int64_t t = 0; t < FP_T; ++t)
                for (int64_t e = 0; e < FP_EP; ++e) vpad[t * FP_EP + e] = e < FP_E ? vg[t * FP_VRS + e] : 0.0f;
            vb = vpad;
            vrs = FP_EP;
        }}
        for (int64_t i0 = 0; i0 < FP_S; i0 += FP_QB) {{
            const int64_t nq = FP_S - i0 < FP_QB ? FP_S - i0 : FP_QB;
            const int64_t last = FP_CAUSAL ? (i0 + nq < FP_T ? i0 + nq : FP_T) : FP_T;
            const int64_t blocks = (last + FP_KB - 1) / FP_KB, span = blocks * FP_KB;
            const float* qr[FP_QB];  /* a block's rows past the last query repeat it: computed, never written */
            for (int r = 0; r < FP_QB; ++r) qr[r] = qg + (r < nq ? i0 + r : FP_S - 1) * FP_QRS;
            for (int64_t b = 0; b < blocks; ++b) {{
                const int64_t t0 = b * FP_KB;
                live[b] = !(skips && fp_hidden_block(mg, i0, nq, b));
                if (!live[b]) {{
                    for (int r = 0; r < nq; ++r)
                        for (int u = 0; u < FP_NV; ++u) memcpy(p + r * FP_TP + t0 + FP_VL * u, &ninf, sizeof ninf);
                    continue;
                }}
                fp_va sc[FP_QB][FP_NV];
                for (int r = 0; r < FP_QB; ++r)
                    for (int u = 0; u < FP_NV; ++u) sc[r][u] = fp_va_fill(0.0f);
                for (int64_t d = 0; d < FP_D; ++d) {{
                    fp_va kv[FP_NV];
                    for (int u = 0; u < FP_NV; ++u) kv[u] = fp_va_load(kt + d * FP_TP + t0 + FP_VL * u);
                    for (int r = 0; r < FP_QB; ++r) {{
                        const float qd = qr[r][d];
                        for (int u = 0; u < FP_NV; ++u) sc[r][u] = fp_va_madd(sc[r][u], qd, kv[u]);
                    }}
                }}
                for (int r = 0; r < nq; ++r) {{
                    /* keys past the last one, and (causal) past this query, are -inf */
                    const int64_t visible = FP_CAUSAL && i0 + r + 1 < FP_T ? i0 + r + 1 : FP_T;
                    const int64_t limit = visible - t0;
                    const float* added = (FP_MASKED || FP_BIASED) ? fp_added_row(mg, i0 + r) + t0 : NULL;
                    if ((FP_MASKED || FP_BIASED) && t0 + FP_KB > FP_T) {{  /* a row's last block, zero-padded */
                        for (int64_t t = 0; t < FP_KB; ++t) tail[t] = t0 + t < FP_T ? added[t] : 0.0f;
                        added = tail;
                    }}
                    for (int u = 0; u < FP_NV; ++u) {{
                        fp_vai idx = lane + FP_VL * u;
                        fp_va s = scale * sc[r][u];
                        if (FP_MASKED || FP_BIASED) s = s + fp_va_load(added + FP_VL * u);
                        s = fp_va_below(idx, (int32_t)limit, s, ninf);
                        memcpy(p + r * FP_TP + t0 + FP_VL * u, &s, sizeof s);
                    }}
                }}
            }}
            float inv[FP_QB];
            for (int r = 0; r < FP_QB; ++r) {{
                float* pr = p + r * FP_TP;
                if (r >= nq) {{  /* rows past the last query: no weight on any value */
                    for (int64_t j = 0; j < span; ++j) pr[j] = 0.0f;
                    inv[r] = 0.0f;
                    continue;
                }}
                fp_va mv = ninf;
                for (int64_t t0 = 0; t0 < span; t0 += FP_VL) mv = fp_va_max(mv, fp_va_load(pr + t0));
                const float mn = fp_va_hmax(mv);
                /* every key hidden: the exponentials against 0, all 0, and the row 0/0 (NaN), as unfused */
                const float mb = mn == -INFINITY ? 0.0f : mn;
                /* a hidden key's -inf: 0 (past a causal query's own key, without an exponential) */
                const int64_t seen = FP_CAUSAL && i0 + r + 1 < span ? i0 + r + 1 : span;
                for (int64_t j = 0; j < seen; ++j) pr[j] = fp_exp(pr[j] - mb);
                for (int64_t j = seen; j < span; ++j) pr[j] = 0.0f;
                fp_va sv = fp_va_fill(0.0f);
                for (int64_t t0 = 0; t0 < span; t0 += FP_VL) sv = sv + fp_va_load(pr + t0);
                inv[r] = 1.0f / fp_va_hadd(sv);
            }}
            for (int64_t e0 = 0; e0 < FP_EP; e0 += FP_KB) {{
                fp_va o[FP_QB][FP_NV];
                for (int r = 0; r < FP_QB; ++r)
                    for (int u = 0; u < FP_NV; ++u) o[r][u] = fp_va_fill(0.0f);
                for (int64_t b = 0; b < blocks; ++b) {{
                    if (!live[b]) continue;
                    const int64_t j1 = (b + 1) * FP_KB < last ? (b + 1) * FP_KB : last;
                    for (int64_t j = b * FP_KB; j < j1; ++j) {{
                        fp_va vv[FP_NV];
                        for (int u = 0; u < FP_NV; ++u) vv[u] = fp_va_load(vb + j * vrs + e0 + FP_VL * u);
                        for (int r = 0; r < FP_QB; ++r) {{
                            const float pj = p[r * FP_TP + j];
                            for (int u = 0; u < FP_NV; ++u) o[r][u] = fp_va_madd(o[r][u], pj, vv[u]);
                        }}
                    }}
                }}
                for (int r = 0; r < nq; ++r) {{
                    float* orow = og + (i0 + r) * FP_ORS + e0;
                    for (int u = 0; u < FP_NV; ++u) {{
                        const fp_va y = o[r][u] * inv[r];
                        if (e0 + FP_VL * (u + 1) <= FP_E) memcpy(orow + FP_VL * u, &y, sizeof y);
                        else for (int j = 0; j < FP_VL && e0 + FP_VL * u + j < FP_E; ++j) orow[FP_VL * u + j] = y[j];
                    }}
                }}
            }}
        }}
    }}
    free(kt);
}}
""")


#: channels a depthwise convolution sums at once (one 16-wide vector kept in a register across the taps)
DEPTHWISE_BLOCK = 16
#: neighbouring output pixels whose windows lie inside the image summed at once (each weight vector loaded once
#: for them) where a window is :data:`DEPTHWISE_WIDE` columns or more; narrower windows one pixel at a time.  On
#: one core of a Sapphire Rapids VM (gcc 12, fp32): 96 channels of 56x56, 7x7: 8 pixels 346 µs, 1 pixel 415,
#: oneDNN's channels-last convolution 320; 144 channels of 56x56, 3x3: 1 pixel 133 µs, 8 pixels 170, oneDNN 197
DEPTHWISE_PIXELS = 8
DEPTHWISE_WIDE = 5
#: the standalone ops with a generated kernel: attention, without a mask, with one (a row of keys per group), with
#: a bias (a row of keys per query)
ATTENTION_OPS = ("Attention", "MaskedAttention", "BiasedAttention")


def attention_shapes(body: Expr, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, int, int, int, int]:
    """(groups, S, T, D, E) of an Attention (or MaskedAttention) body over loads."""
    q, k, v = (shapes[a.tensor] for a in body.args[:3] if isinstance(a, Load))
    return q[0], q[1], k[1], q[2], v[2]


def source_of(body: Expr, shapes: Mapping[str, tuple[int, ...]],
              layouts: Mapping[str, GroupLayout] | None = None) -> str | None:
    """The generated C a standalone kernel loads: attention's (its operands and result in ``layouts``, by role:
    ``q``, ``k``, ``v``, ``mask``, ``out``), and pooling's."""
    if body.op in POOLS:
        return pool_source(body)
    if body.op == "DepthwiseConv":
        return depthwise_source(body)
    if body.op not in ATTENTION_OPS:
        return None
    _, s, t, d, e = attention_shapes(body, shapes)
    attrs = body.attr_dict
    return attention_source(s, t, d, e, float(attrs["scale"]), bool(attrs.get("causal", 0)),
                            masked=body.op == "MaskedAttention", biased=body.op == "BiasedAttention", layouts=layouts)


#: the first and one past the last tap of a window whose input index start + tap * step lies in [0, size): C
TAP_RANGE_C = """
static inline int64_t fp_first_tap(int64_t start, int64_t step) { return start >= 0 ? 0 : (-start + step - 1) / step; }
static inline int64_t fp_end_tap(int64_t start, int64_t step, int64_t size, int64_t taps) {
    const int64_t end = start >= size ? 0 : (size - 1 - start) / step + 1;
    return end < taps ? end : taps;
}
"""


def depthwise_source(body: Expr) -> str:
    """A depthwise convolution of channels-last rows of the body's dtype (``x``, and the weight's (kh*kw, C) taps
    ``w``): for each output pixel, each block of :data:`DEPTHWISE_BLOCK` channels summed over the window's taps in
    fp32 (the padding left out) in a small local array the compiler keeps in a vector register across the taps
    (an array of all channels stayed in memory: 5.4 ms against oneDNN's 0.32 for 96 channels of 56x56, 7x7);
    output rows ``r0``..``r1`` (image by output row) per call."""
    h, w, kh, kw, sh, sw, ph, pw, dh, dw = (int(body.attr_dict[a]) for a in WINDOW)
    oh, ow = window_out(body.attr_dict)
    channels = int(body.type.shape[-1])
    ctype, load, store = storage_forms(body.type.dtype)

    def block(width: str) -> str:
        return f"""{{
                float acc[{width}];
                for (int64_t c = 0; c < {width}; ++c) acc[c] = 0.0f;
                for (int64_t ky = ky0; ky < ky1; ++ky) {{
                    const {ctype}* restrict row = image + ((oy * {sh} - {ph} + ky * {dh}) * FP_W) * FP_C + c0;
                    const {ctype}* restrict taps = w + ky * {kw} * FP_C + c0;
                    for (int64_t kx = kx0; kx < kx1; ++kx) {{
                        const {ctype}* restrict px = row + (ox * {sw} - {pw} + kx * {dw}) * FP_C;
                        const {ctype}* restrict wt = taps + kx * FP_C;
                        for (int64_t c = 0; c < {width}; ++c) acc[c] += {load.format("px[c]")} * {load.format("wt[c]")};
                    }}
                }}
                for (int64_t c = 0; c < {width}; ++c) o[c0 + c] = {store.format("acc[c]")};
            }}"""

    def pixels(width: str) -> str:  # FP_P neighbouring output pixels whose windows lie inside: one weight load each
        return f"""{{
                float acc[FP_P][{width}];
                for (int64_t p = 0; p < FP_P; ++p) for (int64_t c = 0; c < {width}; ++c) acc[p][c] = 0.0f;
                for (int64_t ky = ky0; ky < ky1; ++ky) {{
                    const {ctype}* restrict row = image + ((oy * {sh} - {ph} + ky * {dh}) * FP_W + ox * {sw} - {pw}) * FP_C + c0;
                    const {ctype}* restrict taps = w + ky * {kw} * FP_C + c0;
                    for (int64_t kx = 0; kx < {kw}; ++kx) {{
                        const {ctype}* restrict wt = taps + kx * FP_C;
                        for (int64_t p = 0; p < FP_P; ++p) {{
                            const {ctype}* restrict px = row + (p * {sw} + kx * {dw}) * FP_C;
                            for (int64_t c = 0; c < {width}; ++c) acc[p][c] += {load.format("px[c]")} * {load.format("wt[c]")};
                        }}
                    }}
                }}
                for (int64_t p = 0; p < FP_P; ++p)
                    for (int64_t c = 0; c < {width}; ++c) o[p * FP_C + c0 + c] = {store.format("acc[p][c]")};
            }}"""

    inner = (w - 1 + pw - (kw - 1) * dw) // sw  # the last output column whose window lies inside the row
    return PRELUDE + TAP_RANGE_C + f"""
#define FP_H {h}
#define FP_W {w}
#define FP_C {channels}
#define FP_OH {oh}
#define FP_OW {ow}
#define FP_B {DEPTHWISE_BLOCK}
#define FP_P {DEPTHWISE_PIXELS if kw >= DEPTHWISE_WIDE else 1}
#define FP_INNER {inner}


void {SYMBOL}(const float* x0, const float* w0, float* out0, int64_t r0, int64_t r1, int64_t unused) {{
    (void)unused;
    const {ctype}* restrict x = (const {ctype}*)x0;
    const {ctype}* restrict w = (const {ctype}*)w0;
    {ctype}* restrict out = ({ctype}*)out0;
    for (int64_t r = r0; r < r1; ++r) {{
        const int64_t oy = r % FP_OH;
        const {ctype}* image = x + (r / FP_OH) * FP_H * FP_W * FP_C;
        const int64_t ky0 = fp_first_tap(oy * {sh} - {ph}, {dh}), ky1 = fp_end_tap(oy * {sh} - {ph}, {dh}, FP_H, {kh});
        for (int64_t ox = 0; ox < FP_OW; ++ox) {{
            const int64_t kx0 = fp_first_tap(ox * {sw} - {pw}, {dw}), kx1 = fp_end_tap(ox * {sw} - {pw}, {dw}, FP_W, {kw});
            {ctype}* restrict o = out + (r * FP_OW + ox) * FP_C;
            if (kx0 == 0 && kx1 == {kw} && ox + FP_P <= FP_OW && ox + FP_P - 1 <= FP_INNER) {{
                int64_t c0 = 0;
                for (; c0 + FP_B <= FP_C; c0 += FP_B) {pixels("FP_B")}
                if (c0 < FP_C) {pixels("FP_C % FP_B")}
                ox += FP_P - 1;
                continue;
            }}
            int64_t c0 = 0;
            for (; c0 + FP_B <= FP_C; c0 += FP_B) {block("FP_B")}
            if (c0 < FP_C) {block("FP_C % FP_B")}
        }}
    }}
}}
"""


def pool_source(body: Expr) -> str:
    """The generated kernel of a pooling op (``core.ops.POOLS``) of channels-last rows."""
    if body.op == "MaxPool":
        return maxpool_source(body, int(body.type.shape[-1]))
    if body.op == "AvgPool":
        return avgpool_source(body, int(body.type.shape[-1]))
    return spatial_mean_source(int(body.attr_dict["pixels"]), int(body.type.shape[-1]), body.type.dtype)


def _pool_head(h: int, w: int, channels: int, oh: int, ow: int, ctype: str) -> str:
    """A pooling kernel's sizes and its loop down to one output row: ``image`` the row's image, ``oy`` its index,
    ``acc`` a channel vector of fp32 (the kernel closes the loop and the function)."""
    return f"""
#define FP_H {h}
#define FP_W {w}
#define FP_C {channels}
#define FP_OH {oh}
#define FP_OW {ow}

void {SYMBOL}(const float* x0, float* out0, int64_t r0, int64_t r1, int64_t unused) {{
    (void)unused;
    const {ctype}* restrict x = (const {ctype}*)x0;
    {ctype}* restrict out = ({ctype}*)out0;
    float acc[FP_C] __attribute__((aligned(64)));
    for (int64_t r = r0; r < r1; ++r) {{
        const int64_t oy = r % FP_OH;
        const {ctype}* image = x + (r / FP_OH) * FP_H * FP_W * FP_C;"""


def maxpool_source(body: Expr, channels: int) -> str:
    """Max pooling of channels-last rows of the body's dtype: each output pixel's channels, a vector, the largest
    of its window's pixels (padding left out, as torch's -inf; a NaN wins, as in torch), compared as floats,
    output rows ``r0``..``r1`` (image by output row) per call.  torch's own pooling of the same fp32 rows took
    227 µs for 8x32x32x32 (3x3, stride 2) on one core of a Sapphire Rapids VM, its NCHW one 2.3 ms; this 24."""
    h, w, kh, kw, sh, sw, ph, pw, dh, dw = (int(body.attr_dict[a]) for a in WINDOW)
    oh, ow = window_out(body.attr_dict)
    ctype, load, store = storage_forms(body.type.dtype)
    return PRELUDE + _pool_head(h, w, channels, oh, ow, ctype) + f"""
        for (int64_t ox = 0; ox < FP_OW; ++ox) {{
            for (int64_t c = 0; c < FP_C; ++c) acc[c] = -INFINITY;
            for (int64_t ky = 0; ky < {kh}; ++ky) {{
                const int64_t iy = oy * {sh} - {ph} + ky * {dh};
                if (iy < 0 || iy >= FP_H) continue;
                for (int64_t kx = 0; kx < {kw}; ++kx) {{
                    const int64_t ix = ox * {sw} - {pw} + kx * {dw};
                    if (ix < 0 || ix >= FP_W) continue;
                    const {ctype}* restrict px = image + (iy * FP_W + ix) * FP_C;
                    for (int64_t c = 0; c < FP_C; ++c) {{
                        const float v = {load.format("px[c]")};
                        acc[c] = (v > acc[c] || v != v) ? v : acc[c];
                    }}
                }}
            }}
            {ctype}* restrict o = out + (r * FP_OW + ox) * FP_C;
            for (int64_t c = 0; c < FP_C; ++c) o[c] = {store.format("acc[c]")};
        }}
    }}
}}
"""


def avgpool_source(body: Expr, channels: int) -> str:
    """Average pooling of channels-last rows of the body's dtype: each output pixel's channels, a vector, the fp32
    sum of its window's pixels inside the image divided as ``AvgPool`` says; output rows ``r0``..``r1`` (image by
    output row) per call.  The taps inside are a range computed first: with a test per tap around the sum (max
    pooling's form), gcc 12 -O3 -march=native vectorised the loop over a row's taps and summed wrongly (values of
    1e30 on a 9x11 image, 3x3 windows, stride 2, padding 1; -fno-tree-loop-vectorize or -O2 gave the sum)."""
    h, w, kh, kw, sh, sw, ph, pw, dh, dw = (int(body.attr_dict[a]) for a in WINDOW)
    oh, ow = window_out(body.attr_dict)
    ctype, load, store = storage_forms(body.type.dtype)
    divisor = int(body.attr_dict["divisor"]) or (kh * kw if int(body.attr_dict["include_pad"]) else 0)
    result = f"acc[c] / {float(divisor)!r}f" if divisor else "acc[c] / (float)((ky1 - ky0) * (kx1 - kx0))"
    return PRELUDE + TAP_RANGE_C + _pool_head(h, w, channels, oh, ow, ctype) + f"""
        const int64_t ky0 = fp_first_tap(oy * {sh} - {ph}, {dh}), ky1 = fp_end_tap(oy * {sh} - {ph}, {dh}, FP_H, {kh});
        for (int64_t ox = 0; ox < FP_OW; ++ox) {{
            const int64_t kx0 = fp_first_tap(ox * {sw} - {pw}, {dw}), kx1 = fp_end_tap(ox * {sw} - {pw}, {dw}, FP_W, {kw});
            for (int64_t c = 0; c < FP_C; ++c) acc[c] = 0.0f;
            for (int64_t ky = ky0; ky < ky1; ++ky) {{
                const {ctype}* restrict row = image + (oy * {sh} - {ph} + ky * {dh}) * FP_W * FP_C;
                for (int64_t kx = kx0; kx < kx1; ++kx) {{
                    const {ctype}* restrict px = row + (ox * {sw} - {pw} + kx * {dw}) * FP_C;
                    for (int64_t c = 0; c < FP_C; ++c) acc[c] += {load.format("px[c]")};
                }}
            }}
            {ctype}* restrict o = out + (r * FP_OW + ox) * FP_C;
            for (int64_t c = 0; c < FP_C; ++c) o[c] = {store.format(result)};
        }}
    }}
}}
"""


#: input rows one unit of a generated transpose covers: a cache line of each output row (16 fp32, 32 16-bit)
TRANSPOSE_LINE = 64


def transpose_source(rows: int, cols: int, itemsize: int) -> str:
    """``x`` (images of ``rows`` x ``cols`` elements of ``itemsize`` bytes: fp32, or a 16-bit dtype's bits)
    transposed into ``out`` (images of ``cols`` x ``rows``): ChannelsLast (rows = channels) and ChannelsFirst
    (rows = pixels).  Units ``r0``..``r1``: image by a cache line's worth of input rows (:func:`transpose_units`:
    whole lines written, rows read in order), each in 8x8 blocks transposed in registers (AVX: fp32 by
    unpack/shuffle/permute of 256-bit rows; 16-bit by SSE2 unpacks), the edges elementwise.  An image of 64 x 3136
    fp32 took 43-50 µs on one core of a Sapphire Rapids VM, torch's blocked 2-D copy 121-135, numpy's strided one
    57, memcpy 20.  Fewer than 8 rows (an RGB image's channels): an image a unit, pixel by pixel, the row count a
    constant the compiler vectorizes with interleaved stores."""
    if itemsize not in (2, 4):
        raise CodegenError(f"no generated transpose of {itemsize}-byte elements")
    ctype = "float" if itemsize == 4 else "uint16_t"
    line = TRANSPOSE_LINE // itemsize
    block = r"""
#if defined(__AVX__)
#include <immintrin.h>
static inline void fp_block8(const float* restrict s, float* restrict d) {
    const __m256 r0 = _mm256_loadu_ps(s + 0 * FP_B), r1 = _mm256_loadu_ps(s + 1 * FP_B);
    const __m256 r2 = _mm256_loadu_ps(s + 2 * FP_B), r3 = _mm256_loadu_ps(s + 3 * FP_B);
    const __m256 r4 = _mm256_loadu_ps(s + 4 * FP_B), r5 = _mm256_loadu_ps(s + 5 * FP_B);
    const __m256 r6 = _mm256_loadu_ps(s + 6 * FP_B), r7 = _mm256_loadu_ps(s + 7 * FP_B);
    const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
    const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps(d + 0 * FP_A, _mm256_permute2f128_ps(s0, s4, 0x20));
    _mm256_storeu_ps(d + 1 * FP_A, _mm256_permute2f128_ps(s1, s5, 0x20));
    _mm256_storeu_ps(d + 2 * FP_A, _mm256_permute2f128_ps(s2, s6, 0x20));
    _mm256_storeu_ps(d + 3 * FP_A, _mm256_permute2f128_ps(s3, s7, 0x20));
    _mm256_storeu_ps(d + 4 * FP_A, _mm256_permute2f128_ps(s0, s4, 0x31));
    _mm256_storeu_ps(d + 5 * FP_A, _mm256_permute2f128_ps(s1, s5, 0x31));
    _mm256_storeu_ps(d + 6 * FP_A, _mm256_permute2f128_ps(s2, s6, 0x31));
    _mm256_storeu_ps(d + 7 * FP_A, _mm256_permute2f128_ps(s3, s7, 0x31));
}
#define FP_BLOCK8 1
#endif
""" if itemsize == 4 else r"""
#if defined(__SSE2__)
#include <emmintrin.h>
static inline void fp_block8(const uint16_t* restrict s, uint16_t* restrict d) {
    __m128i a[8], b[8], c[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm_loadu_si128((const __m128i*)(s + i * FP_B));
    for (int i = 0; i < 4; ++i) {
        b[2 * i] = _mm_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
        b[2 * i + 1] = _mm_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
    }
    c[0] = _mm_unpacklo_epi32(b[0], b[2]); c[1] = _mm_unpackhi_epi32(b[0], b[2]);
    c[2] = _mm_unpacklo_epi32(b[1], b[3]); c[3] = _mm_unpackhi_epi32(b[1], b[3]);
    c[4] = _mm_unpacklo_epi32(b[4], b[6]); c[5] = _mm_unpackhi_epi32(b[4], b[6]);
    c[6] = _mm_unpacklo_epi32(b[5], b[7]); c[7] = _mm_unpackhi_epi32(b[5], b[7]);
    for (int i = 0; i < 4; ++i) {
        _mm_storeu_si128((__m128i*)(d + (2 * i) * FP_A), _mm_unpacklo_epi64(c[i], c[i + 4]));
        _mm_storeu_si128((__m128i*)(d + (2 * i + 1) * FP_A), _mm_unpackhi_epi64(c[i], c[i + 4]));
    }
}
#define FP_BLOCK8 1
#endif
"""
    if rows < 8:  # fewer rows than a block (an RGB image's 3 channels): one unit an image, pixel by pixel
        return PRELUDE + f"""
#define FP_A {rows}
#define FP_B {cols}

void {SYMBOL}(const float* x0, float* out0, int64_t r0, int64_t r1, int64_t unused) {{
    (void)unused;
    for (int64_t n = r0; n < r1; ++n) {{
        const {ctype}* restrict x = (const {ctype}*)x0 + n * (int64_t)FP_A * FP_B;
        {ctype}* restrict out = ({ctype}*)out0 + n * (int64_t)FP_A * FP_B;
        for (int64_t j = 0; j < FP_B; ++j)  /* the rows' count a constant: interleaved vector stores */
            for (int64_t i = 0; i < FP_A; ++i) out[j * FP_A + i] = x[i * FP_B + j];
    }}
}}
"""
    return PRELUDE + f"""
#define FP_A {rows}
#define FP_B {cols}
#define FP_LINE {line}
#define FP_UNITS_PER_IMAGE {(rows + line - 1) // line}
""" + block + f"""
void {SYMBOL}(const float* x0, float* out0, int64_t r0, int64_t r1, int64_t unused) {{
    (void)unused;
    for (int64_t u = r0; u < r1; ++u) {{
        const int64_t n = u / FP_UNITS_PER_IMAGE;
        const int64_t i0 = (u % FP_UNITS_PER_IMAGE) * FP_LINE;
        const int64_t i1 = i0 + FP_LINE < FP_A ? i0 + FP_LINE : FP_A;
        const {ctype}* restrict x = (const {ctype}*)x0 + n * (int64_t)FP_A * FP_B;
        {ctype}* restrict out = ({ctype}*)out0 + n * (int64_t)FP_A * FP_B;
        int64_t j = 0;
#ifdef FP_BLOCK8
        for (; j + 8 <= FP_B; j += 8) {{
            int64_t i = i0;
            for (; i + 8 <= i1; i += 8) fp_block8(x + i * FP_B + j, out + j * FP_A + i);
            for (; i < i1; ++i)
                for (int64_t k = j; k < j + 8; ++k) out[k * FP_A + i] = x[i * FP_B + k];
        }}
#endif
        for (; j < FP_B; ++j)
            for (int64_t i = i0; i < i1; ++i) out[j * FP_A + i] = x[i * FP_B + j];
    }}
}}
"""


def transpose_units(images: int, rows: int, itemsize: int) -> int:
    """The units :func:`transpose_source`'s kernel splits across threads: each image's input rows, by as many
    as fill an output cache line."""
    line = TRANSPOSE_LINE // itemsize
    return images * ((rows + line - 1) // line)


def rows_call(fn: Any, pool: parallel.WorkerPool, threads: int, rows: int,
              addr: Callable[[], list[int]]) -> Callable[[], None]:
    """Run a generated function of rows ``r0``..``r1`` with its rows split across the pool."""
    ranges = parallel.split(rows, threads)

    def call() -> None:
        ptrs = addr()
        pool.run_kernel(fn, len(ptrs), [[*ptrs, r0, r1, 0] for r0, r1 in ranges])

    return call


def gather_source(n_rows: int, row_bytes: int) -> str:
    """C for Embedding over rows [r0, r1) of the ids (fp32, one per output row): each id's table row (its stored
    bytes, any dtype) copied into the output row.  An id that is not a whole row number below ``n_rows`` (NaN
    included: every comparison with it is false) stops the copy and leaves its position in ``bad[0]``, which
    the caller set to -1; the caller then raises the op's error (:func:`gather_rows`)."""
    return PRELUDE + f"""
#define FP_ROWS {int(n_rows)}
#define FP_ROW_BYTES {int(row_bytes)}

void {SYMBOL}(const float* restrict ids, const char* restrict table, int64_t* restrict bad, char* restrict out,
              int64_t r0, int64_t r1, int64_t unused) {{
    (void)unused;
    for (int64_t r = r0; r < r1; ++r) {{
        const float id = ids[r];
        if (!(id >= 0.0f && id < (float)FP_ROWS) || (float)(int64_t)id != id) {{
            bad[0] = r;
            return;
        }}
        memcpy(out + r * FP_ROW_BYTES, table + (int64_t)id * FP_ROW_BYTES, FP_ROW_BYTES);
    }}
}}
"""


def gather_rows(ids: np.ndarray, table: np.ndarray, out: np.ndarray) -> None:
    """Embedding: the table's rows (their stored bits, any dtype) at the ids, checked, into ``out``."""
    rows = sem.table_rows(ids, table.shape[0])
    np.take(table, rows, axis=0, out=out.reshape(len(rows), table.shape[1]))


def _bits_tensor(a: np.ndarray) -> Any:
    """Array ``a`` (fp32, or a 16-bit dtype's bits) as a torch tensor over its memory, of a dtype torch copies."""
    import torch  # optional dependency

    return torch.from_numpy(a if a.dtype == np.float32 else a.view(np.int16))


def channels_copy(body: Expr) -> Callable[[np.ndarray, np.ndarray], None]:
    """``copy(x, out)`` for ChannelsLast / ChannelsFirst of elements of other sizes than a generated transpose
    takes (:func:`transpose_source`): the (C, pixels) planes of each image transposed by numpy."""
    attrs = body.attr_dict
    to_last = body.op == "ChannelsLast"
    pixels = int(attrs["pixels"])

    def copy(x: np.ndarray, out: np.ndarray) -> None:
        c = int(attrs["channels"]) if to_last else x.shape[-1]
        src = x.reshape(-1, c, pixels) if to_last else x.reshape(-1, pixels, c)
        dst = out.reshape(-1, pixels, c) if to_last else out.reshape(-1, c, pixels)
        np.copyto(dst, src.transpose(0, 2, 1))

    return copy


def spatial_mean_source(pixels: int, channels: int, dtype: str) -> str:
    """The mean of each image's ``pixels`` channels-last rows (global average pooling) of ``dtype``, summed in
    double as the reference's ``np.mean(..., dtype=float64)``, images ``r0``..``r1`` per call. torch's mean of the
    same rows, called from a plan just after a convolution, took about 70 µs for 8x32x16x16 fp32 on one core of a
    Sapphire Rapids VM: several cold torch calls for 256 KB of reads."""
    ctype, load, store = storage_forms(dtype)
    return PRELUDE + f"""
#define FP_P {pixels}
#define FP_C {channels}

void {SYMBOL}(const float* x0, float* out0, int64_t r0, int64_t r1, int64_t unused) {{
    (void)unused;
    const {ctype}* restrict x = (const {ctype}*)x0;
    {ctype}* restrict out = ({ctype}*)out0;
    double acc[FP_C] __attribute__((aligned(64)));
    for (int64_t n = r0; n < r1; ++n) {{
        const {ctype}* restrict image = x + n * FP_P * FP_C;
        for (int64_t c = 0; c < FP_C; ++c) acc[c] = 0.0;
        for (int64_t p = 0; p < FP_P; ++p) {{
            const {ctype}* restrict px = image + p * FP_C;
            for (int64_t c = 0; c < FP_C; ++c) acc[c] += (double){load.format("px[c]")};
        }}
        {ctype}* restrict o = out + n * FP_C;
        for (int64_t c = 0; c < FP_C; ++c) o[c] = {store.format("(float)(acc[c] / FP_P)")};
    }}
}}
"""


def layout_copy(body: Expr) -> Callable[[np.ndarray, np.ndarray], None]:
    """``copy(x, out)`` for the layout copies (``core.ops.LAYOUT_COPIES``): one strided numpy copy."""
    attrs = body.attr_dict
    if body.op == "Im2col":

        def im2col_copy(x: np.ndarray, out: np.ndarray) -> None:
            sem.im2col(x, attrs, out)

        return im2col_copy
    if body.op in ("ChannelsLast", "ChannelsFirst"):
        return channels_copy(body)
    if body.op == "Columns":
        offset, width = int(attrs["offset"]), int(attrs["width"])

        def columns_copy(x: np.ndarray, out: np.ndarray) -> None:
            np.copyto(out, x[..., offset:offset + width])

        return columns_copy
    if body.op == "Regroup":

        def regroup_copy(x: np.ndarray, out: np.ndarray) -> None:
            np.copyto(out, x.reshape(out.shape))

        return regroup_copy
    heads = int(attrs["heads"])
    if body.op == "GroupRepeat":
        rows = int(attrs["rows"])

        def repeat_copy(m: np.ndarray, out: np.ndarray) -> None:  # m: (batch * rows, T) or (groups, rows, T)
            np.copyto(out.reshape(-1, heads, rows, m.shape[-1]), m.reshape(-1, 1, rows, m.shape[-1]))

        return repeat_copy
    if body.op == "Heads":
        seq, offset, width = int(attrs["seq"]), int(attrs["offset"]), int(attrs["width"])
        dh = width // heads

        def heads_copy(x: np.ndarray, out: np.ndarray) -> None:
            cols = x.reshape(-1, seq, x.shape[-1])[:, :, offset:offset + width].reshape(-1, seq, heads, dh)
            np.copyto(out.reshape(-1, heads, seq, dh), cols.transpose(0, 2, 1, 3))

        return heads_copy

    def merge_copy(y: np.ndarray, out: np.ndarray) -> None:
        g, s, d = y.shape
        np.copyto(out.reshape(g // heads, s, heads, d), y.reshape(g // heads, heads, s, d).transpose(0, 2, 1, 3))

    return merge_copy


def scores_writer(body: Expr, bmm: BatchMatMul, dtype: str = "fp32") -> Callable[[np.ndarray, np.ndarray, np.ndarray], None]:
    """``write(q, k, out)`` for BatchScores: the batched product with k transposed, then the causal mask
    (``out`` stored as ``dtype``: float32, or the bits of a 16-bit dtype)."""
    causal = bool(body.attr_dict["causal"])
    masks: dict[tuple[int, int], np.ndarray] = {}
    minus_inf = np.array(-np.inf, numpy_dtype(dtype))
    if dtype != "fp32":
        minus_inf = minus_inf.view(np.uint16)

    def write(q: np.ndarray, k: np.ndarray, out: np.ndarray) -> None:
        bmm(q, k.transpose(0, 2, 1), out)
        if causal:
            s, t = out.shape[1:]
            mask = masks.get((s, t))
            if mask is None:
                mask = masks[(s, t)] = np.triu(np.ones((s, t), dtype=bool), 1)
            out[:, mask] = minus_inf

    return write


def attention_call(fn: Any, pool: parallel.WorkerPool, threads: int, groups: int,
                   addr: Callable[[], list[int]]) -> Callable[[], None]:
    """Run the generated attention function (q, k, v[, mask], out) with its groups split across the pool."""
    return rows_call(fn, pool, threads, groups, addr)
