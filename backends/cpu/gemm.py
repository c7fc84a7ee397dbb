"""Which library multiplies a GEMM kernel's tiles: numpy's BLAS or torch's (``torch.mm``).

The generated C epilogue runs on each fp32 tile either way; only the product comes from the library.
torch's x86 wheels ship MKL, numpy's OpenBLAS: on one core here (fp32, 2026-12-01) MKL reached
74-80 GFLOP/s on GPT-2's MLP shapes (128x768x3072, 128x3072x768) against OpenBLAS's 52-63, and 51-87
against 27-55 on the 16-64-row tiles of a split GEMM; 64x2048x2048 was a tie.

That order is not every machine's: on an AMD EPYC (Zen 4) core (2026-12-02) OpenBLAS beat MKL by 5-20% on
the same shapes (1024³: 22.4 against 26.7 ms).  So ``FUSION_PLANNER_CPU_GEMM``: ``auto`` (the default)
takes numpy when torch is not imported (a graph, not a torch model, is being planned: torch is not loaded
for it), else the library that multiplies :data:`PROBE_SHAPES` faster on one thread here, measured once
per machine and library versions (about 0.1 s) and kept in the kernel cache (``gemm-library.json``);
torch keeps it unless numpy is :data:`PROBE_MARGIN` faster.  ``torch`` and ``numpy`` force one.

16-bit operands are widened to fp32 for the product, except where torch multiplies their dtype in the
CPU's own instructions (bf16 on AMX or AVX-512 BF16, fp16 on AMX-FP16): there torch's product reads the
stored bits into a tile of the storage dtype, which the epilogue reads (the product rounded once, as
eager torch rounds a Linear's output).  On a Sapphire Rapids core (2026-12-02) bf16 ``torch.mm`` was 5.4x (128x768x3072) and
7.2x (1024x768x3072) faster than fp32; fp16 without AMX-FP16 was no faster than fp32, so it is widened.
``FUSION_PLANNER_CPU_GEMM_16BIT``: ``auto`` (the default) decides as above, ``widen`` widens every 16-bit
product, ``native`` takes torch's on any CPU (where it has no 16-bit units torch converts inside, slowly: for
tests and comparisons).  The same choice covers 16-bit batched products and attention (``standalone.py``).

fp32 weights (tensors only GEMM libraries read, as the right operand, held constant between calls: a module's
parameters) are stored once in the layout their library multiplies fastest: ``padded`` (K, N) rows an odd number
of cache lines apart (``buffers.padded_matrix``), ``given``, read in place as bound (an nn.Linear weight
as its (K, N) transpose), or, where torch is loaded, ``packed``: reordered once into oneDNN's blocked form and
multiplied by oneDNN (as 16-bit weights below).  On a Sapphire Rapids core (2026-12-03) padded rows made MKL
1.2-1.6x and OpenBLAS 1.1-1.3x faster on GPT-2's and a 2048-wide MLP's GEMMs.  On an AMD EPYC (Zen 4) core
(2026-12-04) packed fp32 weights multiplied 1.1-1.4x faster than OpenBLAS, MKL and jax.jit's XLA on GPT-2's
shapes, 64x2048x2048 and 1024x1024x1024.  Which layout wins depends on the product's shape: on that core
(2026-12-06) packed beat padded OpenBLAS by 7-12% on 1024x1024x1024, 64x2048x2048, 128x3072x768 and
256x768x3072, by 4% on 128x768x3072 and not at all on 128x768x768, and with every library narrowed to AVX2
code (``benchmarks/avx2.py``) padded OpenBLAS beat packed by 0-9% on each.  So ``FUSION_PLANNER_CPU_WEIGHTS``:
``auto`` (the default) chooses per product (:func:`shape_layout`): the layouts timed on the product's own shape
(the rows of one tile) as the plan runs it (on its threads: with AVX2 code padded OpenBLAS won every shape on
one thread and packed most of them on two), once per shape, thread count, machine, library and versions
(``gemm-weights-<hash>.json`` in the kernel cache), ``given`` kept unless another is faster by :data:`PROBE_MARGIN` (``packed`` judged against the
better of the other two; a product of fewer than :data:`PACK_MIN_MACS` multiply-adds never packed).  ``packed``,
``padded`` and ``given`` force one for every product (``packed`` is an error where torch is not loaded or cannot
pack fp32).  One layout for every product, timed on three small shapes, took padded on that core in one process
and packed in another (5.98 against 5.82 ms, inside the margin), and with it every large product lost or won
its 7-12%.

16-bit weights torch multiplies natively are either read as ``given`` (nn.Linear's (N, K) layout; oneDNN
reorders the operand into its blocked form inside every product) or ``packed``: reordered once into oneDNN's
blocked form (``torch.ops.mkldnn._reorder_linear_weight``, what Inductor's weight freezing does) and
multiplied by ``torch.ops.mkldnn._linear_pointwise``, which writes a fresh tensor the epilogue reads as its
tile.  On a Sapphire Rapids core (AMX, 2026-12-03) packed bf16 weights multiplied 1.3-1.5x faster on GPT-2's
shapes at 128 rows (warm and with cold caches), 1.3x at 512x2048x5632, 1.1-1.2x on a 16-row decode step, and
tied at 2048 rows.  ``FUSION_PLANNER_CPU_WEIGHTS_16BIT``: ``auto`` (the default) times both on
:data:`LAYOUT_SHAPES` in the dtype once per machine and versions (``gemm-weights-<dtype>.json``) and keeps
``given`` unless ``packed`` wins by the rule above; ``packed`` forces it (an error where this torch cannot
pack the dtype), ``given`` never packs.  Only a read-only array (a bound parameter) is packed, once, and
shared by every plan of the backend; a writable weight may change between calls and is read as given.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from backends.cpu.buffers import aligned_empty, padded_matrix
from backends.cpu.compiler import cache_dir, keep_record, read_record, recorded_choice
from backends.cpu.parallel import WorkerPool, gemm_parts, split, torch_threads
from planner.backend import BackendError
from planner.core.dtypes import DTYPES
from planner.core.env import env_choice
from planner.core.errors import UsageError
from planner.core.machine import cpu_model, target_isa
from planner.core.shapes import WINDOW, window_out

log = logging.getLogger(__name__)

GEMM_ENV = "FUSION_PLANNER_CPU_GEMM"
GEMM_16BIT_ENV = "FUSION_PLANNER_CPU_GEMM_16BIT"
WEIGHTS_ENV = "FUSION_PLANNER_CPU_WEIGHTS"
WEIGHT_LAYOUTS = ("packed", "padded", "given")
WEIGHTS_16BIT_ENV = "FUSION_PLANNER_CPU_WEIGHTS_16BIT"
WEIGHT_LAYOUTS_16BIT = ("packed", "given")
LIBRARIES = ("numpy", "torch")
#: the torch.cpu capability checks under which torch multiplies a 16-bit dtype natively
#: the 16-bit float dtypes torch may multiply natively (and oneDNN from packed weights)
DTYPES_16BIT = ("bf16", "fp16")
_NATIVE_16BIT = {"bf16": ("_is_amx_tile_supported", "_is_avx512_bf16_supported"), "fp16": ("_is_amx_fp16_supported",)}
#: ``mm(a, b, out)``: ``out[:] = a @ b`` for fp32 C-contiguous 2-D arrays
MatMul = Callable[[np.ndarray, np.ndarray, np.ndarray], None]


def library_from_env(choice: str | None = None) -> str:
    """The GEMM library a backend uses: ``choice``, else ``$FUSION_PLANNER_CPU_GEMM``, else ``auto``."""
    what = "gemm_library" if choice else GEMM_ENV
    if choice is not None and choice.strip().lower() not in ("auto", *LIBRARIES):
        raise UsageError(f"gemm_library={choice[:40]!r}: expected auto, {', '.join(LIBRARIES)}")
    value = env_choice(GEMM_ENV, ("auto", *LIBRARIES), "auto", given=choice)
    if value == "auto":
        return measured_library() if "torch" in sys.modules else "numpy"
    if value == "torch":
        try:
            import torch  # noqa: F401  (optional dependency)
        except ImportError as exc:
            raise BackendError(f"{what}=torch, but torch cannot be imported ({exc})") from None
    return value


def numpy_mm(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    np.matmul(a, b, out=out)


def torch_mm(dtype: str = "fp32", keep: tuple[bool, bool, bool] = (False, False, False)) -> MatMul:
    """``torch.mm`` on zero-copy views of the arrays (torch is imported: :func:`library_from_env` checked); the
    operands of a 16-bit ``dtype`` are its bits (``uint16``), multiplied in torch's native product and rounded to
    it.  ``keep[i]``: operand i (a, b, out) is usually the same array call after call (a weight, a plan's own
    buffer), so its tensor view is kept while it is; a view cost ~3 µs to make, several times that right after a
    large kernel evicted the interpreter's own data, on each of a plan's kernels.  Never keep an array the plan
    hands out (a kept view would keep a caller's output alive)."""
    import torch  # optional dependency

    from planner.torch.ops import numpy_view

    kind = _torch_dtype(dtype) if dtype in DTYPES_16BIT else None
    kept: list[tuple[np.ndarray, Any] | None] = [None, None, None]

    def view(i: int, x: np.ndarray) -> Any:
        hit = kept[i]
        if hit is not None and hit[0] is x:
            return hit[1]
        t = numpy_view(x) if kind is None else numpy_view(x).view(kind)
        if keep[i]:
            kept[i] = (x, t)
        return t

    def mm(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        torch.mm(view(0, a), view(1, b), out=view(2, out))

    return mm


#: a convolution as a GEMM's product: ``conv(x, w, bias, other, unary)`` of channels-last rows x (N*H*W, C) and
#: the GEMM's weight w (kh*kw*C, O), giving the product's (N*OH*OW, O) rows (a tensor torch owns); with oneDNN's
#: post-ops ``+ bias`` (O,), ``+ other`` (rows like the result) and ``relu`` applied in the convolution itself
Convolution = Callable[..., Any]
@dataclass(frozen=True)
class UnaryPostOp:
    """An activation oneDNN's convolution applies to its result: oneDNN's name, scalars and algorithm, and
    ``function``, ``torch.nn.functional``'s function taking the scalars (where the fused op is missing)."""

    name: str
    scalars: tuple[float, ...] = ()
    algorithm: str = ""
    function: str = ""  # empty: F's function of oneDNN's name

    def torch(self, y: Any) -> Any:
        import torch.nn.functional as F  # optional dependency

        if self.name == "gelu":
            return F.gelu(y, approximate="tanh" if self.algorithm == "tanh" else "none")
        return getattr(F, self.function or self.name)(y, *self.scalars)


NO_POST_OP = UnaryPostOp("none")
#: the activations oneDNN's convolution applies as post-ops, by the op table's name: attrs -> its post-op, or
#: None where oneDNN has no such form (one-sided clamps other than ReLU's)
CONV_UNARY: dict[str, Callable[[Mapping[str, Any]], UnaryPostOp | None]] = {
    "Relu": lambda attrs: UnaryPostOp("relu"),
    "Clamp": lambda attrs: (UnaryPostOp("hardtanh", (float(attrs["lo"]), float(attrs["hi"])))
                            if attrs["sides"] == "both" else None),
    "LeakyRelu": lambda attrs: UnaryPostOp("leaky_relu", (float(attrs["slope"]),)),
    "Hardswish": lambda attrs: UnaryPostOp("hardswish"),
    "Hardsigmoid": lambda attrs: UnaryPostOp("hardsigmoid"),
    "Silu": lambda attrs: UnaryPostOp("swish", function="silu"),
    "Sigmoid": lambda attrs: UnaryPostOp("sigmoid"),
    "Tanh": lambda attrs: UnaryPostOp("tanh"),
}
#: the post-ops oneDNN applies after a residual add (its binary convolution refuses the others)
CONV_BINARY_UNARY = frozenset({"none", "relu"})
#: the activations oneDNN's packed linear applies as post-ops (:func:`packed_linear`; the unary fusions
#: Inductor makes): the convolution's, and GELU in both of its forms
LINEAR_UNARY: dict[str, Callable[[Mapping[str, Any]], UnaryPostOp | None]] = {
    **CONV_UNARY,
    "GeluErf": lambda attrs: UnaryPostOp("gelu", algorithm="none"),
    "GeluTanh": lambda attrs: UnaryPostOp("gelu", algorithm="tanh"),
}


def torch_conv(dtype: str, window: Mapping[str, int]) -> Convolution:
    """The product ``Im2col(x) @ w`` as torch's own convolution (oneDNN: no patches are stored) of the rows
    seen as a channels-last (N, C, H, W) batch and the weight as (O, C, kh, kw), reordered once per read-only
    weight array (a bound parameter; what torch.compile does only when freezing); the result read back as rows
    (oneDNN keeps the channels-last layout it was given).  Post-ops (bias, a residual, ReLU) go to oneDNN's fused
    convolution where torch has it, else they are computed after it."""
    import torch  # optional dependency

    from planner.torch.ops import numpy_view

    kind = _torch_dtype(dtype) if dtype in DTYPES_16BIT else None
    h, w_, kh, kw, sh, sw, ph, pw, dh, dw = (int(window[a]) for a in WINDOW)
    oh, ow = window_out(window)
    fused = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_convolution_pointwise")
    kept: list[tuple[np.ndarray, Any] | None] = [None]

    def tensor(x: np.ndarray) -> Any:
        return numpy_view(x) if kind is None else numpy_view(x).view(kind)

    def weight(w: np.ndarray, c: int, images: int) -> Any:
        """The weight as (O, C, kh, kw); for oneDNN's fused convolution reordered into its own blocked form, which
        is kept while the weight is the same read-only array (a bound parameter: it cannot change in place)."""
        hit = kept[0]
        if hit is not None and hit[0] is w:
            return hit[1]
        o = w.shape[-1]
        t = tensor(w).view(kh, kw, c, o).permute(3, 2, 0, 1).contiguous(memory_format=torch.channels_last)
        if not w.flags.writeable:  # a writable one may change before the next call: the convolution reorders it
            if fused:
                t = torch.ops.mkldnn._reorder_convolution_weight(t, [ph, pw], [sh, sw], [dh, dw], 1,
                                                                 [images, c, h, w_])
            kept[0] = (w, t)
        return t

    def conv(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None, other: np.ndarray | None = None,
             unary: UnaryPostOp = NO_POST_OP) -> Any:
        c, o = x.shape[-1], w.shape[-1]
        xs = tensor(x).view(-1, h, w_, c).permute(0, 3, 1, 2)
        ws = weight(w, c, xs.shape[0])
        b = None if bias is None else tensor(bias)
        if fused and other is None:
            y = torch.ops.mkldnn._convolution_pointwise(xs, ws, b, [ph, pw], [sh, sw], [dh, dw], 1, unary.name,
                                                        list(unary.scalars), unary.algorithm)
        elif fused:
            assert other is not None and unary.name in CONV_BINARY_UNARY
            residual = tensor(other).view(xs.shape[0], oh, ow, o).permute(0, 3, 1, 2)
            y = torch.ops.mkldnn._convolution_pointwise.binary(xs, residual, ws, b, [ph, pw], [sh, sw], [dh, dw], 1,
                                                               "add", None, None if unary is NO_POST_OP else unary.name,
                                                               [], "")
        else:  # oneDNN's fused convolution missing: torch's, then the post-ops
            y = torch.nn.functional.conv2d(xs, ws, b, (sh, sw), (ph, pw), (dh, dw))
            if other is not None:
                y = y + tensor(other).view(xs.shape[0], oh, ow, o).permute(0, 3, 1, 2)
            if unary is not NO_POST_OP:
                y = unary.torch(y)
        return y.permute(0, 2, 3, 1).contiguous().view(-1, o)  # a view where torch kept channels last

    return conv


def torch_depthwise(dtype: str, window: Mapping[str, int]) -> Convolution:
    """A depthwise convolution of channels-last rows x (N*H*W, C) with taps w (kh*kw, C) of a 16-bit dtype torch
    multiplies natively, as torch's (oneDNN's) convolution with groups = C: the rows seen as a channels-last batch,
    the taps as (C, 1, kh, kw), kept while they are the same read-only array; the result as rows (a tensor torch
    owns).  Where the generated kernel widened each 16-bit value it took 3-7x oneDNN's time (bf16, one core)."""
    import torch  # optional dependency

    from planner.torch.ops import numpy_view

    kind = _torch_dtype(dtype)
    h, w_, kh, kw, sh, sw, ph, pw, dh, dw = (int(window[a]) for a in WINDOW)
    kept: list[tuple[np.ndarray, Any] | None] = [None]

    def taps(w: np.ndarray) -> Any:
        hit = kept[0]
        if hit is not None and hit[0] is w:
            return hit[1]
        t = numpy_view(w).view(kind).view(kh, kw, w.shape[-1]).permute(2, 0, 1).unsqueeze(1).contiguous()
        if not w.flags.writeable:
            kept[0] = (w, t)
        return t

    def conv(x: np.ndarray, w: np.ndarray) -> Any:
        c = x.shape[-1]
        xs = numpy_view(x).view(kind).view(-1, h, w_, c).permute(0, 3, 1, 2)
        y = torch.nn.functional.conv2d(xs, taps(w), None, (sh, sw), (ph, pw), (dh, dw), c)
        return y.permute(0, 2, 3, 1).contiguous().view(-1, c)  # a view where torch kept channels last

    return conv


def native_16bit(dtype: str) -> bool:
    """Does torch multiply ``dtype`` in the CPU's own instructions here, so a GEMM need not widen it to fp32?
    (torch is imported: the caller uses the torch library.)"""
    value = env_choice(GEMM_16BIT_ENV, ("auto", "native", "widen"), "auto")
    if value == "widen" or dtype not in _NATIVE_16BIT:
        return False
    if value == "native":  # forced: as on an AVX2-only machine, where torch converts inside
        return True
    if target_isa() == "avx2":  # AMX, AVX-512 BF16 are absent
        return False
    import torch  # optional dependency

    return any(getattr(torch.cpu, check, lambda: False)() for check in _NATIVE_16BIT[dtype])


def matmul(library: str) -> MatMul:
    return torch_mm() if library == "torch" else numpy_mm


# ---------------------------------------------------------------- the measured choice

#: the fp32 products ``auto`` times on one thread: a transformer projection at 128 tokens, a wider square one
PROBE_SHAPES = ((128, 768, 768), (256, 1024, 1024))
#: numpy must be this much faster (summed over the shapes) to replace torch: the measurement's noise
PROBE_MARGIN = 0.05
#: the fewest multiply-adds of a product whose read-only weight is packed for oneDNN: its packed product (with or
#: without post-ops) costs about 15 µs a call more than the library's plain one, on one Zen 4 core (2026-12-06):
#: 17 against 1.6 µs for 1x240x10 (a squeeze-and-excitation), 22 against 7 for 64x64x64, 37 against 29 for
#: 16x256x256 (2^20), but 88 against 93 for 1x1280x1000 and 1,360 against 1,578 for 128x768x768
PACK_MIN_MACS = 1 << 20
PROBE_ROUNDS = 5
PROBE_FILE = "gemm-library.json"


def _probe_key() -> dict[str, Any]:
    """What the measured choice depends on: the CPU and the libraries' versions (the BLAS builds included)."""
    import torch  # optional dependency (imported: auto measures only then)

    return {"cpu": cpu_model(), "numpy": np.__version__, "torch": torch.__version__, "blas": _blas_builds()}


def _blas_builds() -> list[str]:
    """numpy's own BLAS, as its build records it: what its products run on. Not every BLAS the process has
    loaded: scipy's, which jax brings in, made the key differ between processes, so that each re-measured the
    choice and replaced the record (the likely cause of a one-thread benchmark child whose fp32 products all ran
    8-25% slower: its choice measured in a busy moment)."""
    blas = np.show_config(mode="dicts").get("Build Dependencies", {}).get("blas", {})
    return [f"{blas.get('name')} {blas.get('version')}"]


def fastest_of(calls: Mapping[str, Callable[[], Any]], rounds: int = PROBE_ROUNDS,
               before: Mapping[str, Callable[[], Any]] | None = None) -> dict[str, float]:
    """Each call's fastest of ``rounds`` rounds (seconds), the calls interleaved round by round after a first
    round that warms them up (the measured choices here, and ``stream_probe``'s); ``before``: what runs, untimed,
    before each run of a call (the streaming probe evicts the call's arrays from the caches)."""
    runs: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds + 1):
        for name, call in calls.items():
            if before is not None:
                before[name]()
            t0 = time.perf_counter()
            call()
            runs[name].append(time.perf_counter() - t0)
    return {name: min(r[1:]) for name, r in runs.items()}


def _recorded(file: str, key: dict[str, Any], choices: tuple[str, ...], measure: Callable[[], tuple[str, Any]]) -> str:
    """The choice recorded in the kernel cache's ``file`` for ``key``; else ``measure()``'s (choice, figures),
    recorded there."""
    path = cache_dir() / file
    record = read_record(path, key)
    if record is not None and record.get("choice") in choices:
        return str(record["choice"])
    choice, seconds = measure()
    keep_record(path, {"key": key, "choice": choice, "seconds": seconds}, "the GEMM choice")
    return choice


def _time_libraries() -> dict[str, float]:
    """Seconds per library, the fastest round of each shape summed over :data:`PROBE_SHAPES`; the libraries
    interleaved round by round."""
    mms = {"numpy": numpy_mm, "torch": torch_mm()}
    rng = np.random.default_rng(0)
    best = dict.fromkeys(mms, 0.0)
    with threadpool_limits(limits=1, user_api="blas"), torch_threads(1):
        for m, k, n in PROBE_SHAPES:
            a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
            out = np.empty((m, n), np.float32)
            fastest = fastest_of({name: functools.partial(mm, a, b, out) for name, mm in mms.items()})
            for name in mms:
                best[name] += fastest[name]
    return best


@functools.cache
def measured_library() -> str:
    """numpy or torch, whichever multiplies fp32 faster here (torch unless numpy wins by the margin); measured
    once per machine and library versions, the record kept in the kernel cache."""
    def measure() -> tuple[str, dict[str, float]]:
        seconds = _time_libraries()
        choice = "numpy" if seconds["numpy"] * (1 + PROBE_MARGIN) < seconds["torch"] else "torch"
        log.info("CPU GEMM library: %s (fp32 on one thread: numpy %.2f ms, torch %.2f ms)", choice,
                 seconds["numpy"] * 1e3, seconds["torch"] * 1e3)
        return choice, seconds

    return _recorded(PROBE_FILE, _probe_key(), LIBRARIES, measure)


# ---------------------------------------------------------------- the weights' layout

#: the fp32 products the weight layout is timed on (M, K, N): rows 3, 4 and 4.0625 KiB apart as nn.Linear
#: stores its weight, 3 and 4 KiB in a C-ordered copy
LAYOUT_SHAPES = ((128, 768, 768), (64, 1024, 1024), (128, 1040, 768))
#: the kernel cache's per-shape records of the fp32 weight layout: ``gemm-weights-<hash of the key>.json``
LAYOUT_KIND = "gemm-weights"
#: :func:`weight_layout` where no layout is forced: each product's weight in the layout timed fastest for its shape
PER_SHAPE = "per-shape"
#: a product's (M, K, N)
Shape = tuple[int, int, int]


def weight_layout() -> str:
    """How fp32 weights are stored: ``packed``, ``padded`` or ``given`` where ``$FUSION_PLANNER_CPU_WEIGHTS``
    forces one, else :data:`PER_SHAPE` (module docstring); ``packed`` only where torch is loaded and packs fp32."""
    value = env_choice(WEIGHTS_ENV, ("auto", *WEIGHT_LAYOUTS), "auto")
    if value == "packed" and not fp32_packs():
        why = packing_error("fp32") if "torch" in sys.modules else "torch is not loaded"
        raise BackendError(f"{WEIGHTS_ENV}=packed, but fp32 weights cannot be packed here ({why})")
    return PER_SHAPE if value == "auto" else value


def fp32_packs() -> bool:
    """Can fp32 weights be packed here (torch loaded, and its packed product agrees with the plain one)?"""
    return "torch" in sys.modules and packing_error("fp32") is None


def _layout_key(library: str, packs: bool = False, threads: int = 1, route: str = "") -> dict[str, Any]:
    key: dict[str, Any] = {"cpu": cpu_model(), "numpy": np.__version__, "blas": _blas_builds(), "library": library}
    torch = sys.modules.get("torch")
    if (library == "torch" or packs) and torch is not None:
        key["torch"] = torch.__version__
    if packs:
        key["packs"] = True
    if threads > 1:
        key["threads"], key["route"] = threads, route
    return key


def split_product(mm: MatMul, pool: WorkerPool | None) -> MatMul:
    """``mm`` as the numpy route of a plan on ``pool``'s threads runs it: the rows cut into one block per
    worker (``parallel.gemm_parts``), each multiplied on its worker (BLAS on one thread); ``mm`` itself where
    there is no pool."""
    if pool is None or pool.threads < 2:
        return mm

    def run(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        pool.run([functools.partial(mm, a[r0:r1], b, out[r0:r1])
                  for r0, r1 in split(a.shape[0], gemm_parts(pool.threads, a.shape[0]))])

    return run


def time_layouts(mm: MatMul, packs: bool = False, shapes: Sequence[Shape] = LAYOUT_SHAPES,
                 pool: WorkerPool | None = None, threads: int = 1) -> dict[str, list[float]]:
    """Seconds per layout and shape of ``shapes`` (the fastest round), the layouts interleaved; ``packed``
    (oneDNN's product from the packed weight) only where ``packs``.  On ``threads`` threads each runs as a plan
    on them would: ``mm`` on row blocks split over ``pool`` where one is given (a numpy product, BLAS on one
    thread in each), else on torch's threads, as oneDNN's packed product."""
    rng = np.random.default_rng(0)
    layouts = _layouts(packs)
    best: dict[str, list[float]] = {layout: [] for layout in layouts}
    linear = packed_linear("fp32") if packs else None
    product = split_product(mm, pool)
    with threadpool_limits(limits=1, user_api="blas"), torch_threads(threads):
        for m, k, n in shapes:
            a = aligned_empty((m, k), np.float32)
            a[...] = rng.standard_normal((m, k), dtype=np.float32)
            weight = aligned_empty((n, k), np.float32)  # nn.Linear's (N, K) weight, read as its transpose
            weight[...] = rng.standard_normal((n, k), dtype=np.float32)
            padded = padded_matrix(k, n, np.float32)
            padded[...] = weight.T
            out = aligned_empty((m, n), np.float32)
            calls: dict[str, Callable[[], Any]] = {"padded": functools.partial(product, a, padded, out),
                                                   "given": functools.partial(product, a, weight.T, out)}
            if linear is not None:
                calls["packed"] = functools.partial(linear, a, pack_weight(weight.T, "fp32"))
            fastest = fastest_of(calls)
            for layout in layouts:
                best[layout].append(fastest[layout])
    return best


def _beats(layout: list[float], given: list[float]) -> bool:
    """Is ``layout`` faster than ``given`` (seconds per shape): on their sum by :data:`PROBE_MARGIN`, and slower
    by more than it on no shape?"""
    return sum(layout) * (1 + PROBE_MARGIN) < sum(given) and all(
        t <= g * (1 + PROBE_MARGIN) for t, g in zip(layout, given, strict=True))


def choose_layout(seconds: Mapping[str, list[float]]) -> str:
    """``given``, unless ``padded`` beats it; then ``packed`` (where timed), if it beats the better of those."""
    choice = "padded" if _beats(seconds["padded"], seconds["given"]) else "given"
    if "packed" in seconds and _beats(seconds["packed"], seconds[choice]):
        return "packed"
    return choice


#: :func:`shape_layout`'s answers in this process, by (library, packs, shape, threads, route)
_shape_layouts: dict[tuple[Any, ...], str] = {}


def shape_layout(library: str, packs: bool, shape: Shape, pool: WorkerPool | None = None) -> str:
    """The layout :func:`choose_layout` takes from :func:`time_layouts` on the product ``shape`` (M, K, N) here,
    run as a plan on ``pool`` runs it (numpy: row blocks over the pool; torch and packed: its thread count);
    measured once per shape, thread count and route, machine, library, versions and whether fp32 packs, the
    record kept in the kernel cache (and the answer in this process)."""
    threads = 1 if pool is None else pool.threads
    route = "" if threads == 1 else parallel_route(pool)
    known = _shape_layouts.get((library, packs, shape, threads, route))
    if known is not None:
        return known

    def measure() -> tuple[str, dict[str, float]]:
        seconds = time_layouts(matmul(library), packs, (shape,), pool if library == "numpy" else None, threads)
        choice = choose_layout(seconds)
        log.info("CPU GEMM weights (%s) of a %dx%dx%d product: %s (fp32 on %d thread%s: %s)", library, *shape, choice,
                 threads, "" if threads == 1 else "s",
                 ", ".join(f"{layout} {t[0] * 1e3:.3f} ms" for layout, t in seconds.items()))
        return choice, {layout: t[0] for layout, t in seconds.items()}

    key = {**_layout_key(library, packs, threads, route), "shape": list(shape)}
    choice = _shape_layouts[(library, packs, shape, threads, route)] = recorded_choice(
        LAYOUT_KIND, key, _layouts(packs), measure, "the weight layout")
    return choice


def forget_layouts() -> None:
    """Drop this process's answers of :func:`shape_layout` (the kernel cache's records stay)."""
    _shape_layouts.clear()


def parallel_route(pool: WorkerPool | None) -> str:
    """Where a pool's parallel work runs: its native pool's route (``openmp``, ``pthreads``), else ``python``."""
    native = None if pool is None else pool.native
    return "python" if native is None else native.route


def _layouts(packs: bool) -> tuple[str, ...]:
    """The fp32 weight layouts there are to choose from: ``packed`` only where fp32 packs."""
    return WEIGHT_LAYOUTS if packs else tuple(w for w in WEIGHT_LAYOUTS if w != "packed")


# ---------------------------------------------------------------- weights packed by oneDNN

#: ``linear(a, w[, bias])``: ``a @ w`` as a fresh torch tensor, ``a`` an fp32 array or a 16-bit array's bits,
#: ``w`` a :func:`pack_weight`
PackedLinear = Callable[..., Any]


def _torch_dtype(dtype: str) -> Any:
    import torch  # optional dependency (a native 16-bit product: torch is loaded)

    return getattr(torch, DTYPES[dtype].torch_name)


def pack_weight(b: np.ndarray, dtype: str) -> Any:
    """oneDNN's blocked form of a GEMM right operand ``b`` ((K, N), fp32 or a 16-bit dtype's bits as ``uint16``,
    any strides): reordered from the (N, K) weight nn.Linear stores, for :func:`packed_linear`."""
    import torch  # optional dependency

    from planner.torch.ops import numpy_view

    weight = numpy_view(np.ascontiguousarray(b.T)).view(_torch_dtype(dtype))
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def packed_linear(dtype: str, unary: UnaryPostOp = NO_POST_OP) -> PackedLinear:
    """``unary(a @ w [+ bias])`` for a packed weight ``w``, by oneDNN, the bias and the activation ``unary``
    (:data:`LINEAR_UNARY`) applied to the fp32 accumulator as post-ops before the one rounding (16-bit); the
    operands' tensor views are kept while they are the same arrays (a plan's own buffers, a bias; see
    :func:`torch_mm`)."""
    import torch  # optional dependency

    from planner.torch.ops import numpy_view

    kind, linear = _torch_dtype(dtype), torch.ops.mkldnn._linear_pointwise
    kept: dict[int, tuple[np.ndarray, Any]] = {}
    attr, scalars, algorithm = unary.name, list(unary.scalars), unary.algorithm

    def view(i: int, x: np.ndarray) -> Any:
        hit = kept.get(i)
        if hit is None or hit[0] is not x:
            hit = kept[i] = (x, numpy_view(x).view(kind))
        return hit[1]

    def run(a: np.ndarray, w: Any, bias: np.ndarray | None = None) -> Any:
        return linear(view(0, a), w, None if bias is None else view(1, bias), attr, scalars, algorithm)

    return run


#: the kernel-cache records of :func:`post_op_pays`
POST_OP_KIND = "gemm-post-ops"
POST_OP_CHOICES = ("post-ops", "epilogue")


def _operand(rng: np.random.Generator, shape: tuple[int, int], dtype: str) -> np.ndarray:
    """A random aligned operand as the backend stores it: fp32, or a 16-bit dtype's bits as ``uint16``."""
    import torch  # optional dependency (packed products: torch is loaded)

    values = rng.standard_normal(shape, dtype=np.float32)
    if dtype == "fp32":
        return aligned_copy(values)
    return aligned_copy(torch.from_numpy(values).to(_torch_dtype(dtype)).view(torch.uint16).numpy())


def time_post_op(dtype: str, unary: UnaryPostOp, shape: Shape, threads: int = 1) -> dict[str, float]:
    """Seconds (the fastest round, interleaved) of oneDNN's packed product of ``shape`` (M, K, N) with a bias,
    with the activation ``unary`` as its post-op (``post-ops``), and without it followed by a pass of the
    activation over the result (``epilogue``: the generated epilogue's work, priced by torch's own activation),
    on ``threads`` torch threads."""
    rng = np.random.default_rng(0)
    m, k, n = shape
    a, bias = _operand(rng, (m, k), dtype), _operand(rng, (1, n), dtype)[0]
    weight = pack_weight(_operand(rng, (n, k), dtype).T, dtype)  # from nn.Linear's (N, K)
    fused, plain = packed_linear(dtype, unary), packed_linear(dtype)

    def then_activation() -> Any:
        return unary.torch(plain(a, weight, bias))

    with torch_threads(threads):
        return fastest_of({"post-ops": functools.partial(fused, a, weight, bias), "epilogue": then_activation})


@functools.cache
def post_op_pays(dtype: str, unary: UnaryPostOp, shape: Shape, threads: int = 1) -> bool:
    """Is oneDNN's post-op ``unary`` no slower than the product followed by a pass of the activation over its
    result (what the generated epilogue does instead), within :data:`PROBE_MARGIN` (the tie goes to the post-op:
    one pass fewer over the result)?  oneDNN's own activations are not equally fast on every CPU: with AVX2
    code GELU's tanh form added 35% to a 128x768x3072 product on one Zen 4 core (2026-12-07), 1.6% with
    AVX-512.  Measured once per dtype, activation, shape, thread count, machine and
    versions; the record kept in the kernel cache."""
    def measure() -> tuple[str, dict[str, float]]:
        seconds = time_post_op(dtype, unary, shape, threads)
        choice = "post-ops" if seconds["post-ops"] <= seconds["epilogue"] * (1 + PROBE_MARGIN) else "epilogue"
        log.info("CPU GEMM %s %s of a %dx%dx%d product on %d thread(s): %s (post-ops %.3f ms, product then "
                 "activation %.3f ms)", dtype, unary.name + (f"/{unary.algorithm}" if unary.algorithm else ""),
                 *shape, threads, choice, seconds["post-ops"] * 1e3, seconds["epilogue"] * 1e3)
        return choice, seconds

    key = {**_layout_key("torch", packs=True), "dtype": dtype, "unary": [unary.name, *unary.scalars, unary.algorithm],
           "shape": list(shape), "threads": threads, "against": "product, then the activation"}
    return recorded_choice(POST_OP_KIND, key, POST_OP_CHOICES, measure, "the post-op choice") == "post-ops"


def packing(product: MatMul, linear: PackedLinear, weight: Callable[[], Any]) -> MatMul:
    """``product``, except while ``weight()`` gives the packed form of its right operand: then ``linear``
    multiplies, and its result is copied into ``out``."""
    def mm(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        packed = weight()
        if packed is None:
            product(a, b, out)
            return
        np.copyto(out, tensor_bits(linear(a, packed)))

    return mm


def tensor_bits(t: Any) -> np.ndarray:
    """A tensor's storage as an array without a copy: fp32 as such, a 16-bit dtype's bits as ``uint16``."""
    import torch  # optional dependency

    return t.numpy() if t.dtype == torch.float32 else t.view(torch.uint16).numpy()


@functools.cache
def packing_error(dtype: str) -> str | None:
    """Why this torch cannot multiply ``dtype`` from packed weights (None: it can): a small product packed and
    compared with the fp32 one (torch builds without oneDNN, or CPUs it refuses the dtype on)."""
    import torch  # optional dependency

    try:
        rng = np.random.default_rng(0)
        a = rng.standard_normal((8, 32), dtype=np.float32)
        b = rng.standard_normal((32, 24), dtype=np.float32)
        kind = _torch_dtype(dtype)
        bits = [tensor_bits(torch.from_numpy(m).to(kind)) for m in (a, b)]
        got = packed_linear(dtype)(aligned_copy(bits[0]), pack_weight(bits[1], dtype)).float().numpy()
    except (RuntimeError, AttributeError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    want = a @ b
    # 16-bit: two roundings to 8 bits of mantissa, sums of 32 terms; fp32: summation order only
    rtol, atol = (1e-4, 1e-4) if dtype == "fp32" else (5e-2, 0.5)
    if not np.allclose(got, want, rtol=rtol, atol=atol):
        return f"oneDNN's packed {dtype} product differs from the fp32 one by {np.abs(got - want).max():.3g}"
    return None


def aligned_copy(x: np.ndarray) -> np.ndarray:
    out = aligned_empty(x.shape, x.dtype)
    out[...] = x
    return out


def weight_layout_16bit(dtype: str) -> str:
    """How 16-bit weights torch multiplies natively are held: ``packed`` or ``given`` (module docstring)."""
    value = env_choice(WEIGHTS_16BIT_ENV, ("auto", *WEIGHT_LAYOUTS_16BIT), "auto")
    if value == "given":
        return value
    error = packing_error(dtype)
    if value == "packed" and error is not None:
        raise BackendError(f"{WEIGHTS_16BIT_ENV}=packed, but torch cannot multiply {dtype} from packed weights "
                           f"here ({error})")
    if error is not None:
        return "given"
    return "packed" if value == "packed" else measured_16bit_layout(dtype)


def time_16bit_layouts(dtype: str) -> dict[str, list[float]]:
    """Seconds per 16-bit weight layout and shape of :data:`LAYOUT_SHAPES` (the fastest round), interleaved."""
    import torch  # optional dependency

    rng = np.random.default_rng(0)
    kind = _torch_dtype(dtype)
    best: dict[str, list[float]] = {layout: [] for layout in WEIGHT_LAYOUTS_16BIT}
    mm, linear = torch_mm(dtype), packed_linear(dtype)
    with torch_threads(1):
        for m, k, n in LAYOUT_SHAPES:
            a = aligned_copy(torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32)).to(kind)
                             .view(torch.uint16).numpy())
            weight = aligned_copy(torch.from_numpy(rng.standard_normal((n, k), dtype=np.float32)).to(kind)
                                  .view(torch.uint16).numpy())  # nn.Linear's (N, K)
            packed = pack_weight(weight.T, dtype)
            out = aligned_empty((m, n), np.uint16)
            fastest = fastest_of({"given": functools.partial(mm, a, weight.T, out),
                                  "packed": functools.partial(linear, a, packed)})
            for layout in WEIGHT_LAYOUTS_16BIT:
                best[layout].append(fastest[layout])
    return best


@functools.cache
def measured_16bit_layout(dtype: str) -> str:
    """``packed`` where it multiplies ``dtype`` faster than ``given`` here (the rule of
    :func:`shape_layout`), else ``given``; measured once per machine and versions, kept in the cache."""
    def measure() -> tuple[str, dict[str, list[float]]]:
        seconds = time_16bit_layouts(dtype)
        packed, given = seconds["packed"], seconds["given"]
        choice = "packed" if _beats(packed, given) else "given"
        log.info("CPU GEMM %s weights: %s (one thread: packed %.2f ms, given %.2f ms)", dtype, choice,
                 sum(packed) * 1e3, sum(given) * 1e3)
        return choice, seconds

    return _recorded(f"gemm-weights-{dtype}.json", _layout_key("torch"), WEIGHT_LAYOUTS_16BIT, measure)
