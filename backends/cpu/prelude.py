"""The C the CPU backend's kernels share: the compiler flags they are built with, the prelude every source starts
with (the helpers the op table's snippets call, 16-bit conversions, 16-lane vectors), and how a pointer
parameter is indexed."""

from __future__ import annotations

SYMBOL = "fp_kernel"
#: -fno-trapping-math: nothing here reads floating-point exception flags, and without it gcc 12 will not
#: if-convert a select (ReLU) followed by arithmetic, so such loops stay scalar and branchy
BASE_FLAGS = ("-O3", "-fPIC", "-shared", "-fno-trapping-math")
#: FMA contraction of a*x + b (fp contract fast) or none; see Compiler.fma and docs/backends.md
CONTRACT_FLAGS = {True: "-ffp-contract=fast", False: "-ffp-contract=off"}
NATIVE_FLAGS = ("-march=native",)
#: x86 only: on AVX-512 targets gcc otherwise keeps 256-bit vectors; fused chains of a dozen or more ops
#: are bound by vector throughput, and 512-bit vectors ran them 1.6x faster here (docs/backends.md)
WIDE_VECTOR_FLAGS = ("-mprefer-vector-width=512",)
#: glibc's vector math library for tanhf/erff/expf (see PRELUDE), used when it links
VECTOR_MATH = (("-fno-math-errno", "-DFP_VECTOR_MATH=1"), ("-lmvec",))

#: index kinds of a pointer parameter: the output's layout, a row vector
#: broadcast over rows (a bias), or the fp32 GEMM tile of a GEMM+epilogue kernel
INDEX = {
    "full": "{p}[r * cols + c]",
    "col": "{p}[c]",
    "row": "{p}[r]",  # one value per row (a row kernel's per-row operand)
    "tile": "{p}[(r - r0) * cols + c]",
    "wrap": "{p}[(r % {period}) * cols + c]",  # a tile of the output's trailing dims: its rows repeat
    "group": "{p}[(r / {period}) * cols + c]",  # one row per group of {period} output rows (an attention mask)
    # RotateHalf's input: the other half's column, negated in the first half; the loop over a row runs in
    # two halves, each filling in its shift and sign (see _loop_function), so both stay contiguous loads
    "rot": "{p}[r * cols + c + FP_ROT_SHIFT]",
}

PRELUDE = r"""#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(FP_VECTOR_MATH) && defined(__x86_64__) && defined(__GLIBC__)
/* glibc declares these SIMD variants (libmvec) only under -ffast-math, which
   would also break the IEEE rounding the conversions below rely on. */
float tanhf(float) __attribute__((__simd__("notinbranch")));
float erff(float) __attribute__((__simd__("notinbranch")));
float expf(float) __attribute__((__simd__("notinbranch")));
#endif

static inline float fp_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t fp_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* ReLU as x86's max(zero, x), which answers x when they compare equal or either is NaN: NaN and -0 are kept.
   The zero is a variable gcc cannot fold: with a constant zero gcc lowers the vectorised select to a compare and
   a mask (a 20-op chain 30% slower in cache on a Zen 4 core with AVX2 code, 84% of memcpy against 101% at 4x the
   last-level cache), and a branch on a constant it threads into every later op of a fused chain. */
__attribute__((weak, visibility("hidden"))) float fp_relu_zero = 0.0f;
static inline float fp_relu(float x) { const float zero = fp_relu_zero; return zero > x ? zero : x; }

/* torch.maximum / torch.minimum as bit masks (x86's max answers NaN for one operand only): NaN if either operand is
   NaN, the second when they compare equal (so max(-0, +0) = +0 and max(+0, -0) = -0, as torch and numpy answer). */
static inline float fp_pick(float a, float b, uint32_t take_a) {
    uint32_t m = -take_a;
    return fp_bits_f32((fp_f32_bits(a) & m) | (fp_f32_bits(b) & ~m));
}
static inline float fp_max(float a, float b) { return fp_pick(a, b, (uint32_t)((a > b) | (a != a))); }
static inline float fp_min(float a, float b) { return fp_pick(a, b, (uint32_t)((a < b) | (a != a))); }

/* A row reduction's 16 partial results as one vector (GCC/clang vector extensions): gcc vectorises
   neither the NaN-keeping max of a loop-carried partial nor the loop around it otherwise. */
typedef float fp_v16 __attribute__((vector_size(64)));
typedef int32_t fp_v16i __attribute__((vector_size(64)));
static inline fp_v16 fp_v16_load(const float* p) { fp_v16 v; memcpy(&v, p, 64); return v; }
static inline fp_v16 fp_v16_fill(float x) { fp_v16 v; for (int j = 0; j < 16; ++j) v[j] = x; return v; }
static inline fp_v16 fp_v16_add(fp_v16 a, fp_v16 b) { return a + b; }
static inline fp_v16 fp_v16_max(fp_v16 a, fp_v16 b) {
    fp_v16i m = (a > b) | (a != a);
    return (fp_v16)(((fp_v16i)a & m) | ((fp_v16i)b & ~m));
}
/* Lanes j and j^h exchanged: a reduction's tree stays in registers (a round trip of the 16 partials through
   the stack stalled every row on store forwarding: softmax over rows of 128 took 2.4 ms against 1.9 ms). The
   pairs are those of a tree over an array, so the sums are bit for bit the same. */
#if defined(__clang__)
#define FP_V16_SHUFFLE(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define FP_V16_SHUFFLE(v, ...) __builtin_shuffle(v, (fp_v16i){__VA_ARGS__})
#endif
static inline fp_v16 fp_v16_swap8(fp_v16 v) { return FP_V16_SHUFFLE(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7); }
static inline fp_v16 fp_v16_swap4(fp_v16 v) { return FP_V16_SHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11); }
static inline fp_v16 fp_v16_swap2(fp_v16 v) { return FP_V16_SHUFFLE(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13); }
static inline fp_v16 fp_v16_swap1(fp_v16 v) { return FP_V16_SHUFFLE(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14); }
static inline float fp_v16_hadd(fp_v16 v) {
    v = v + fp_v16_swap8(v);
    v = v + fp_v16_swap4(v);
    v = v + fp_v16_swap2(v);
    v = v + fp_v16_swap1(v);
    return v[0];
}
static inline float fp_v16_hmax(fp_v16 v) {
    v = fp_v16_max(v, fp_v16_swap8(v));
    v = fp_v16_max(v, fp_v16_swap4(v));
    v = fp_v16_max(v, fp_v16_swap2(v));
    v = fp_v16_max(v, fp_v16_swap1(v));
    return v[0];
}

#if defined(__AVX2__) && !defined(__AVX512F__)
/* The vectors the kernels keep their partials and score blocks in (``fp_va``, ``FP_VL`` lanes): 8 lanes here, in
   256-bit registers.  gcc 12 cannot hold a 64-byte vector in two of them: it carried a row's partials through the stack
   and lowered comparisons, 16-lane shuffles and scalar broadcasts one lane at a time (AVX2 code on a Sapphire
   Rapids core: the softmax kernel 4x slower than AVX-512 code, the attention kernel 12x). */
typedef float fp_v8 __attribute__((vector_size(32)));
typedef int32_t fp_v8i __attribute__((vector_size(32)));
#if defined(__clang__)
#define FP_V8_SHUFFLE(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define FP_V8_SHUFFLE(v, ...) __builtin_shuffle(v, (fp_v8i){__VA_ARGS__})
#endif
#define FP_VL 8
typedef fp_v8 fp_va;
typedef fp_v8i fp_vai;
static inline fp_va fp_va_load(const float* p) { fp_va v; memcpy(&v, p, sizeof v); return v; }
static inline fp_va fp_va_fill(float x) { return (fp_va){x, x, x, x, x, x, x, x}; }
static inline fp_va fp_va_max(fp_va a, fp_va b) {
    fp_vai m = (a > b) | (a != a);
    return (fp_va)(((fp_vai)a & m) | ((fp_vai)b & ~m));
}
static inline fp_va fp_va_swap(fp_va v, int h) {
    return h == 4 ? FP_V8_SHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3)
         : h == 2 ? FP_V8_SHUFFLE(v, 2, 3, 0, 1, 6, 7, 4, 5) : FP_V8_SHUFFLE(v, 1, 0, 3, 2, 5, 4, 7, 6);
}
#else
#define FP_VL 16
typedef fp_v16 fp_va;
typedef fp_v16i fp_vai;
static inline fp_va fp_va_load(const float* p) { return fp_v16_load(p); }
static inline fp_va fp_va_fill(float x) { return fp_v16_fill(x); }
static inline fp_va fp_va_max(fp_va a, fp_va b) { return fp_v16_max(a, b); }
static inline fp_va fp_va_swap(fp_va v, int h) {
    return h == 8 ? fp_v16_swap8(v) : h == 4 ? fp_v16_swap4(v) : h == 2 ? fp_v16_swap2(v) : fp_v16_swap1(v);
}
#endif
/* acc + s * v; a where lane index ``idx`` is below ``limit``, else b; the sum and the maximum of the lanes (the
   pairs of a tree over an array, as above) */
static inline fp_va fp_va_madd(fp_va acc, float s, fp_va v) { return acc + s * v; }
static inline fp_va fp_va_below(fp_vai idx, int32_t limit, fp_va a, fp_va b) {
    fp_vai m = idx < limit;
    return (fp_va)(((fp_vai)a & m) | ((fp_vai)b & ~m));
}
static inline float fp_va_hadd(fp_va v) {
    for (int h = FP_VL / 2; h >= 1; h /= 2) v = v + fp_va_swap(v, h);
    return v[0];
}
static inline float fp_va_hmax(fp_va v) {
    for (int h = FP_VL / 2; h >= 1; h /= 2) v = fp_va_max(v, fp_va_swap(v, h));
    return v[0];
}

static inline float fp_bf16_to_f32(uint16_t h) { return fp_bits_f32((uint32_t)h << 16); }

/* Branch-free conversions (so loops vectorise); the fp16 pair follows
   Maratyszcza's FP16 library (MIT) and needs IEEE round-to-nearest-even float
   arithmetic without flush-to-zero, which these flags guarantee. */
static inline uint16_t fp_f32_to_bf16(float f) {
    uint32_t u = fp_f32_bits(f);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;      /* round to nearest even */
    uint32_t qnan = (u >> 16) | 0x40u;                                /* NaN stays a (quiet) NaN */
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? qnan : rounded);
}

static inline float fp_f16_to_f32(uint16_t h) {
    uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    float normal = fp_bits_f32((two_w >> 4) + (0xe0u << 23)) * 0x1.0p-112f;
    float subnormal = fp_bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
    uint32_t bits = two_w < (1u << 27) ? fp_f32_bits(subnormal) : fp_f32_bits(normal);
    return fp_bits_f32(sign | bits);
}

static inline uint16_t fp_f32_to_f16(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;             /* overflows to inf where fp16 does */
    uint32_t w = fp_f32_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xff000000u;
    bias = bias < 0x71000000u ? 0x71000000u : bias;
    base = fp_bits_f32((bias >> 1) + 0x07800000u) + base;              /* the add rounds to fp16 precision */
    uint32_t bits = fp_f32_bits(base);
    uint32_t nonsign = ((bits >> 13) & 0x7c00u) + (bits & 0x0fffu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign));
}

/* erf as a rational function (the coefficients of Eigen's and XLA's float erf), x clamped to [-4, 4] where
   erf is +-1 in fp32: inline arithmetic, so a loop of it vectorises with no vector-math call (libmvec's erff
   ran GELU over a 128x3072 tile 2.5x slower than a ReLU); max error 4.4e-7 against fp64 erf, NaN stays NaN. */
static inline float fp_erf(float x) {
    const float c = x > 4.0f ? 4.0f : (x < -4.0f ? -4.0f : x), c2 = c * c;
    float p = -2.72614225801306e-10f;
    p = p * c2 + 2.77068142495902e-08f;
    p = p * c2 - 2.10102402082508e-06f;
    p = p * c2 - 5.69250639462346e-05f;
    p = p * c2 - 7.34990630326855e-04f;
    p = p * c2 - 2.95459980854025e-03f;
    p = p * c2 - 1.60960333262415e-02f;
    float q = -1.45660718464996e-05f;
    q = q * c2 - 2.13374055278905e-04f;
    q = q * c2 - 1.68282697438203e-03f;
    q = q * c2 - 7.37332916720468e-03f;
    q = q * c2 - 1.42647390514189e-02f;
    return c * p / q;
}

/* tanh as a rational function too (Eigen's float tanh, x clamped to +-7.905 where tanh is +-1 in fp32; near 0
   the ratio's leading terms give x within 1.3e-7 relative): the tanh GELU of a 128x3072 tile, fp32, one core,
   171 -> 142 us against libmvec's tanhf; max error 3.9e-7 against fp64 tanh, NaN stays NaN. */
static inline float fp_tanh(float x) {
    const float c = x > 7.90531110763549805f ? 7.90531110763549805f : (x < -7.90531110763549805f ? -7.90531110763549805f : x);
    const float c2 = c * c;
    float p = -2.76076847742355e-16f;
    p = p * c2 + 2.00018790482477e-13f;
    p = p * c2 - 8.60467152213735e-11f;
    p = p * c2 + 5.12229709037114e-08f;
    p = p * c2 + 1.48572235717979e-05f;
    p = p * c2 + 6.37261928875436e-04f;
    p = p * c2 + 4.89352455891786e-03f;
    float q = 1.19825839466702e-06f;
    q = q * c2 + 1.18534705686654e-04f;
    q = q * c2 + 2.26843463243900e-03f;
    q = q * c2 + 4.89352518554385e-03f;
    return c * p / q;
}

/* Cast's rounding in registers: the value a store of that dtype would keep */
static inline float fp_round_bf16(float x) { return fp_bf16_to_f32(fp_f32_to_bf16(x)); }
static inline float fp_round_f16(float x) { return fp_f16_to_f32(fp_f32_to_f16(x)); }
"""

#: per storage dtype: C element type, load conversion, store conversion


#: e**x and the fast maximum of a row reduction (``fp_exp``, ``fp_va_qmax``): added after :data:`PRELUDE` by
#: :func:`with_simd` only to a source that calls them (with gcc, their vector forms call the builtins the
#: intrinsics wrap: ``<immintrin.h>``, which other compilers include, cost every compiler run 0.13-0.2 s)
SIMD_SOURCE = r"""
#ifndef FP_SIMD_SOURCE
#define FP_SIMD_SOURCE
#if (defined(__x86_64__) || defined(__i386__)) && !(defined(__GNUC__) && !defined(__clang__))
#include <immintrin.h>
#endif
/* gcc: the vector types, and the builtins that <immintrin.h>'s intrinsics wrap, called by name (the same machine
   code, objdump's word): the header took 0.2 of the 0.3 s a compiler run of a kernel calling fp_exp took on a
   Zen 4 core (2026-12-07), and a plan's first search runs several */
#if defined(__GNUC__) && !defined(__clang__)
typedef float fp_v4sf __attribute__((vector_size(16), may_alias));
typedef float fp_v8sf __attribute__((vector_size(32), may_alias));
typedef int fp_v8si __attribute__((vector_size(32), may_alias));
typedef unsigned fp_v8su __attribute__((vector_size(32), may_alias));
typedef float fp_v16sf __attribute__((vector_size(64), may_alias));
#define FP_SPLAT8I(v) ((fp_v8si){v, v, v, v, v, v, v, v})
#define FP_SPLAT16(v) ((fp_v16sf){v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v})
/* an AVX-512 builtin unmasked (every lane written) at the current rounding, as its intrinsic calls it */
#define FP_ALL16(name, ...) __builtin_ia32_##name##_mask(__VA_ARGS__, (fp_v16sf){0}, (unsigned short)-1, 4)
#endif

/* e**x as Cephes' expf: x = n ln2 + r (n rounded by the 1.5 * 2**23 shift, r in [-ln2/2, ln2/2] in two steps of
   Cody and Waite), Cephes' polynomial for e**r in Horner's form, then the scale by 2**n in two exact halves, so
   a result below the normal range is a subnormal rounded once and one past FLT_MAX is inf; x clamped to
   [-104, 89], where e**x is already 0 and inf in fp32; NaN stays NaN.  Within 1 ulp of fp64 exp (the tests'
   sweep: 0.9).  Every step is an fmaf or one rounding, as in the vector forms below: a lane gets the same bits
   whichever form computed it. */
#define FP_EXP_MAGIC 12582912.0f  /* 1.5 * 2**23: added, it rounds to an integer; its bits' low half holds it */
/* the clamp, log2(e), ln 2 in a high part exact in any product with n and a low part, and Cephes' coefficients:
   every form reads these names, so the forms cannot drift apart */
#define FP_EXP_LO -104.0f
#define FP_EXP_HI 89.0f
#define FP_EXP_LOG2E 1.44269504088896341f
#define FP_EXP_LN2_HI 0.693359375f
#define FP_EXP_LN2_LO -2.12194440e-4f
#define FP_EXP_P0 1.9875691500e-4f
#define FP_EXP_P1 1.3981999507e-3f
#define FP_EXP_P2 8.3334519073e-3f
#define FP_EXP_P3 4.1665795894e-2f
#define FP_EXP_P4 1.6666665459e-1f
#define FP_EXP_P5 5.0000001201e-1f
/* e**r = (..(p0 r + p1) r + .. + 1) r + 1; ``k(i)`` is coefficient i in a form's width */
#define FP_EXP_COEFFS FP_EXP_P0, FP_EXP_P1, FP_EXP_P2, FP_EXP_P3, FP_EXP_P4, FP_EXP_P5, 1.0f, 1.0f
#define FP_EXP_POLY(fmadd, k, r) \
    fmadd(fmadd(fmadd(fmadd(fmadd(fmadd(fmadd(k(0), r, k(1)), r, k(2)), r, k(3)), r, k(4)), r, k(5)), r, k(6)), r, k(7))
static const float fp_exp_coeffs[8] = {FP_EXP_COEFFS};
#define FP_EXP_K1(i) fp_exp_coeffs[i]
static inline float fp_exp_lane(float x) {
    const float c = x > FP_EXP_HI ? FP_EXP_HI : (x < FP_EXP_LO ? FP_EXP_LO : x);
    const float t = fmaf(c, FP_EXP_LOG2E, FP_EXP_MAGIC), n = t - FP_EXP_MAGIC;
    const float r = fmaf(-n, FP_EXP_LN2_LO, fmaf(-n, FP_EXP_LN2_HI, c));
    const float e = FP_EXP_POLY(fmaf, FP_EXP_K1, r);
    const uint32_t k = fp_f32_bits(t) - fp_f32_bits(FP_EXP_MAGIC), k1 = (uint32_t)((int32_t)k >> 1), k2 = k - k1;
    return e * fp_bits_f32((k1 + 127u) << 23) * fp_bits_f32((k2 + 127u) << 23);
}

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)
/* A loop calling fp_exp is vectorised by gcc with calls to the vector forms below (the x86-64 vector function
   ABI's names), as it would call libmvec's expf; their bodies are ours: the AVX-512 one scales in one
   instruction, and no lane below -87 (a masked score's -inf) takes a scalar path, as in libmvec.  Softmax
   over rows of 128 on a Zen 4 core: 1.9 -> 1.6 ms with the fast maximum below. */
float fp_exp(float) __attribute__((simd("notinbranch"), const, nothrow, visibility("hidden")));
float fp_exp_entry(float x) __asm__("fp_exp");
__attribute__((visibility("hidden"))) float fp_exp_entry(float x) { return fp_exp_lane(x); }
#define FP_EXP_LANES(name, type, lanes) \
    __attribute__((visibility("hidden"))) type name(type x) { \
        float v[lanes]; memcpy(v, &x, sizeof v); \
        for (int j = 0; j < lanes; ++j) v[j] = fp_exp_lane(v[j]); \
        memcpy(&x, v, sizeof v); return x; \
    }
FP_EXP_LANES(_ZGVbN4v_fp_exp, fp_v4sf, 4)
FP_EXP_LANES(_ZGVcN8v_fp_exp, fp_v8sf, 8)
/* AVX2 has no scalef.  Where every lane is within [-87, 87] (every result normal), e * 2**n in one step, the
   exponent's bits from t's in one integer add; otherwise (a masked score's -inf, a subnormal or an infinite result,
   a NaN) the clamp and the two exact halves, out of line.  The constants are whole vectors in memory, which the
   instructions read as operands (a weak array, which gcc cannot fold into broadcasts of one float each: a third
   of the call's instructions). */
#define FP_K8(v) {v, v, v, v, v, v, v, v}
enum { FP_E8_ABS, FP_E8_LIMIT, FP_E8_LO, FP_E8_HI, FP_E8_LOG2E, FP_E8_MAGIC, FP_E8_LN2_HI,
       FP_E8_LN2_LO, FP_E8_P };
__attribute__((weak, visibility("hidden"), aligned(32))) float fp_exp_k8[FP_E8_P + 8][8] = {
    FP_K8(-0.0f), FP_K8(87.0f), FP_K8(FP_EXP_LO), FP_K8(FP_EXP_HI), FP_K8(FP_EXP_LOG2E), FP_K8(FP_EXP_MAGIC),
    FP_K8(FP_EXP_LN2_HI), FP_K8(FP_EXP_LN2_LO), FP_K8(FP_EXP_P0), FP_K8(FP_EXP_P1), FP_K8(FP_EXP_P2), FP_K8(FP_EXP_P3),
    FP_K8(FP_EXP_P4), FP_K8(FP_EXP_P5), FP_K8(1.0f), FP_K8(1.0f)};
#define FP_E8(i) (*(const fp_v8sf*)fp_exp_k8[i])
#define FP_EXP_K8(i) FP_E8(FP_E8_P + (i))
/* integer lanes add and subtract modulo 2**32, as the intrinsics do (unsigned: no overflow for gcc to assume away) */
static inline fp_v8si fp_add8i(fp_v8si a, fp_v8si b) { return (fp_v8si)((fp_v8su)a + (fp_v8su)b); }
static inline fp_v8si fp_sub8i(fp_v8si a, fp_v8si b) { return (fp_v8si)((fp_v8su)a - (fp_v8su)b); }
static inline fp_v8sf fp_exp8_poly(fp_v8sf c, fp_v8sf* t) {  /* e**r, and t = c log2(e) + the shift */
    *t = __builtin_ia32_vfmaddps256(c, FP_E8(FP_E8_LOG2E), FP_E8(FP_E8_MAGIC));
    const fp_v8sf n = *t - FP_E8(FP_E8_MAGIC);
    const fp_v8sf r = __builtin_ia32_vfnmaddps256(n, FP_E8(FP_E8_LN2_LO), __builtin_ia32_vfnmaddps256(n, FP_E8(FP_E8_LN2_HI), c));
    return FP_EXP_POLY(__builtin_ia32_vfmaddps256, FP_EXP_K8, r);
}
static inline fp_v8sf fp_exp8_scale(fp_v8sf e, fp_v8si exponent) {  /* e * 2**(exponent - 127), exponent in [1, 254] */
    return e * (fp_v8sf)__builtin_ia32_pslldi256(exponent, 23);
}
/* a subnormal or an infinite result, or a NaN: out of line, so the common call keeps its constants as operands */
__attribute__((noinline)) static fp_v8sf fp_exp8_wide(fp_v8sf x) {
    fp_v8sf t;  /* x86's max and min answer their second operand where one is NaN: x */
    const fp_v8sf e = fp_exp8_poly(__builtin_ia32_minps256(FP_E8(FP_E8_HI), __builtin_ia32_maxps256(FP_E8(FP_E8_LO), x)), &t);
    const fp_v8si k = fp_sub8i((fp_v8si)t, FP_SPLAT8I(0x4B400000));
    const fp_v8si k1 = __builtin_ia32_psradi256(k, 1), bias = FP_SPLAT8I(127);
    return fp_exp8_scale(fp_exp8_scale(e, fp_add8i(k1, bias)), fp_add8i(fp_sub8i(k, k1), bias));
}
static inline fp_v8sf fp_exp8_normal(fp_v8sf x) {  /* every lane's result normal: one step */
    fp_v8sf t;
    const fp_v8sf e = fp_exp8_poly(x, &t);
    return fp_exp8_scale(e, fp_add8i((fp_v8si)t, FP_SPLAT8I(127 - 0x4B400000)));
}
__attribute__((visibility("hidden"))) fp_v8sf _ZGVdN8v_fp_exp(fp_v8sf x) {
    const fp_v8sf size = __builtin_ia32_andnps256(FP_E8(FP_E8_ABS), x);
    const int outside = __builtin_ia32_movmskps256(__builtin_ia32_cmpps256(size, FP_E8(FP_E8_LIMIT), 0x16));
    if (__builtin_expect(outside != 0, 0)) {
        /* lanes at or below -104 are 0 in every form (a hidden key's -inf, or torch's finfo.min mask): where they
           are the only ones outside, the others in one step and those zeroed (their garbage masked), in line:
           the out-of-line call cost a softmax with a quarter of each row masked 40% on a Zen 4 core */
        const fp_v8sf zero = __builtin_ia32_cmpps256(x, FP_E8(FP_E8_LO), 0x12);
        if (__builtin_ia32_movmskps256(zero) != outside) return fp_exp8_wide(x);
        return __builtin_ia32_andnps256(zero, fp_exp8_normal(x));
    }
    return fp_exp8_normal(x);
}
#if defined(__AVX512F__)
#define FP_FMADD16(a, b, c) __builtin_ia32_vfmaddps512_mask(a, b, c, (unsigned short)-1, 4)
#define FP_FNMADD16(a, b, c) __builtin_ia32_vfnmaddps512_mask(a, b, c, (unsigned short)-1, 4)
__attribute__((visibility("hidden"))) fp_v16sf _ZGVeN16v_fp_exp(fp_v16sf x) {
    /* x86's max and min answer their second operand where one is NaN: x */
    const fp_v16sf c = FP_ALL16(minps512, FP_SPLAT16(FP_EXP_HI), FP_ALL16(maxps512, FP_SPLAT16(FP_EXP_LO), x));
    const fp_v16sf t = FP_FMADD16(c, FP_SPLAT16(FP_EXP_LOG2E), FP_SPLAT16(FP_EXP_MAGIC));
    const fp_v16sf n = t - FP_SPLAT16(FP_EXP_MAGIC);
    const fp_v16sf r = FP_FNMADD16(n, FP_SPLAT16(FP_EXP_LN2_LO),
                                      FP_FNMADD16(n, FP_SPLAT16(FP_EXP_LN2_HI), c));
#define FP_EXP_K16(i) FP_SPLAT16(fp_exp_coeffs[i])
    return FP_ALL16(scalefps512, FP_EXP_POLY(FP_FMADD16, FP_EXP_K16, r), n);  /* rounded once, as in two halves */
}
#endif
#else
static inline float fp_exp(float x) { return fp_exp_lane(x); }
#endif

/* A maximum through a row as x86's max instruction (the second operand where either is NaN): fp_va_max keeps a
   NaN with two compares and a blend on the loop-carried chain, which held softmax's first pass to a fifth of
   its speed.  A reduction through it also marks the lanes that read a NaN (fp_va_isnan), merges the marks in a
   tree of their own (fp_vai_swap), and answers NaN where one is marked: NaN exactly where an element is. */
#if defined(__AVX2__) && !defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
static inline fp_va fp_va_qmax(fp_va a, fp_va b) { return (fp_va)__builtin_ia32_maxps256((fp_v8sf)a, (fp_v8sf)b); }
#elif defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
static inline fp_va fp_va_qmax(fp_va a, fp_va b) {
    return (fp_va)FP_ALL16(maxps512, (fp_v16sf)a, (fp_v16sf)b);
}
#elif defined(__AVX2__) && !defined(__AVX512F__)
static inline fp_va fp_va_qmax(fp_va a, fp_va b) { return (fp_va)_mm256_max_ps((__m256)a, (__m256)b); }
#elif defined(__AVX512F__)
static inline fp_va fp_va_qmax(fp_va a, fp_va b) { return (fp_va)_mm512_max_ps((__m512)a, (__m512)b); }
#else
static inline fp_va fp_va_qmax(fp_va a, fp_va b) { return fp_va_max(a, b); }
#endif
static inline fp_vai fp_va_isnan(fp_va v) { return v != v; }
static inline fp_vai fp_vai_swap(fp_vai v, int h) { return (fp_vai)fp_va_swap((fp_va)v, h); }
#endif
"""
#: what in a kernel's source calls for :data:`SIMD_SOURCE`
SIMD_CALLS = ("fp_exp(", "fp_va_qmax(")


def with_simd(source: str) -> str:
    """``source`` (starting with :data:`PRELUDE`) with :data:`SIMD_SOURCE` after the prelude where it calls what
    that defines."""
    if not source.startswith(PRELUDE) or not any(call in source for call in SIMD_CALLS):
        return source
    return PRELUDE + SIMD_SOURCE + source[len(PRELUDE):]
