"""The CPU backend: generated C kernels, BLAS GEMMs fused with their epilogues by row tiles.

Every stored tensor of a plan gets its own buffer, in its stored dtype (fp32 as
``float32``, fp16/bf16 as ``uint16`` bit patterns), allocated at compile time
and reused by every run.  Each kernel becomes one step:

* ``elementwise``: one generated C loop nest (``backends.cpu.codegen``);
* ``gemm_epilogue`` and ``cublaslt``: for each tile of rows, the GEMM library (numpy's BLAS or torch.mm) computes
  the fp32 GEMM tile into a scratch buffer sized to a quarter of the L2 cache,
  then the generated epilogue loop reads that tile while it is hot and stores
  the kernel's output.  The full GEMM result never exists in memory.  (A
  ``cublaslt`` kernel is the CPU's library-GEMM-with-epilogue: the same route.)
* ``standalone``: attention's head layouts (strided numpy copies), its batched products (the GEMM
  library's) and the fused attention kernel (generated C, ``backends.cpu.standalone``);
* ``opaque``: the registered numpy implementation (the reference's).

Each step knows the buffers it reads and writes; ``kernel_facts[i]["bytes_moved"]``
is their byte count, each tensor counted once per kernel, as the cost model's
byte ledger counts them.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from threadpoolctl import ThreadpoolController

from backends.codegen import find_matmul, is_row_kernel, loads
from backends.cpu import allocator, gemm, native_pool, parallel, standalone, winograd
from backends.cpu.buffers import (
    HeldWeights,
    aligned_empty,
    padded_matrix,
    shared_buffers,
    typed_view,
)
from backends.cpu.codegen import CodegenError, generate, narrow_source, widen_source
from backends.cpu.compiled import CpuCompiledPlan
from backends.cpu.compiler import Compiler, CompilerUnavailable
from backends.cpu.memory import (
    Memory,
    Step,
    blas_threads_from_env,
    cache_bytes,
    gemm_b_only,
    gemm_products,
    gemm_tile_rows,
    small_products,
    storage_dtype,
    stream_bytes_default,
    streams,
)
from backends.cpu.steps import CHANNEL_COPIES, GemmSteps, StandaloneSteps, channels_plane
from backends.cpu.stream_probe import machine_probe
from planner.backend import (
    Backend,
    BackendError,
    BackendUnavailable,
)
from planner.core.cost import DeviceSpec
from planner.core.dtypes import DTYPES
from planner.core.graph import TensorType
from planner.core.kinds import KernelKind
from planner.core.ops import GATHERS, POOLS, WINDOWED_PRODUCTS
from planner.core.plans import Expr, Kernel, Load, Plan

log = logging.getLogger(__name__)


@functools.cache
def kernels_fingerprint() -> str:
    """A digest of the code that generates and runs this backend's kernels (``backends/codegen.py`` and every
    module of ``backends/cpu``): a plan chosen by timing one version's kernels is re-searched after an upgrade."""
    here = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in [here.parent / "codegen.py", *sorted(here.glob("*.py"))]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


class CpuBackend(GemmSteps, StandaloneSteps, Backend):
    name = "cpu"
    measures = True

    def __init__(
        self,
        spec: DeviceSpec,
        compiler: Compiler | None = None,
        tile_bytes: int | None = None,
        blas_threads: int | None | str = "env",
        threads: int | None = None,
        stream_bytes: int | None = None,
        gemm_library: str | None = None,
        pack_min_macs: int = gemm.PACK_MIN_MACS,
    ) -> None:
        """``threads``: worker threads a plan runs on (None: ``FUSION_PLANNER_THREADS``, else every
        available core; see :mod:`backends.cpu.parallel`).  ``blas_threads``: threads
        BLAS may use inside one GEMM block (None: the library's default; "env":
        ``FUSION_PLANNER_BLAS_THREADS``, else :data:`DEFAULT_BLAS_THREADS`).  ``gemm_library``: numpy,
        torch or auto (None: ``FUSION_PLANNER_CPU_GEMM``; :mod:`backends.cpu.gemm`).  ``pack_min_macs``: the
        fewest multiply-adds of a product whose weight is packed (``gemm.PACK_MIN_MACS``)."""
        super().__init__(spec)
        allocator.keep_freed_memory()
        self.gemm_library = gemm.library_from_env(gemm_library)
        self.matmul = gemm.matmul(self.gemm_library)
        self.bmm = standalone.batch_matmul(self.gemm_library)
        self.threads = parallel.check_threads(threads)
        self.pool = parallel.WorkerPool(self.threads)
        self.blas_threads: int | None = (
            blas_threads_from_env() if isinstance(blas_threads, str) else blas_threads
        )
        #: how fp32 weights held between calls are stored: "packed" by oneDNN, "padded" rows or "given" for every
        #: product, or "per-shape": each in the layout timed fastest for its product's shape (gemm.weight_layout)
        self.weights = gemm.weight_layout()
        self.fp32_packs = self.weights in ("packed", gemm.PER_SHAPE) and gemm.fp32_packs()
        self.held = HeldWeights()
        self.pack_min_macs = pack_min_macs

        self.controller = ThreadpoolController()  # numpy's BLAS is loaded by now
        try:
            self.compiler = compiler or Compiler()
        except CompilerUnavailable as exc:
            raise BackendUnavailable(str(exc)) from None
        if self.threads > 1:  # the generated kernels' parts run on the process's pthreads
            self.pool.attach(native_pool.start_shared_pool(self.compiler, self.threads))
        if tile_bytes is None:
            size, origin = cache_bytes()
            tile_bytes = size // 4
            log.info("GEMM tiles up to %d bytes (a quarter of %d, from %s)", tile_bytes, size, origin)
        self.tile_bytes = tile_bytes
        #: a fixed threshold for streaming stores (:meth:`_streams`); None: measured on this machine
        self.stream_bytes = stream_bytes if stream_bytes is not None else stream_bytes_default()
        self._types_of: tuple[Mapping[str, TensorType], dict[str, tuple[tuple[int, ...], str]]] | None = None
        self._attention_kernels: dict[tuple[Any, ...], str] = {}
        self._convolution_kernels: dict[tuple[Any, ...], str] = {}

    # -- compile
    def compile(self, plan: Plan) -> CpuCompiledPlan:
        t0 = time.perf_counter()
        written = [k.out for k in plan.kernels]
        if len(set(written)) != len(written):
            raise BackendError("plan writes one tensor from two kernels")
        read = {r for k in plan.kernels for r in k.reads}
        inputs = sorted((read | set(plan.outputs)) - set(written))
        weights = self.weight_layouts(plan, frozenset(inputs))
        padded = frozenset(n for n, layout in weights.items() if layout == "padded")
        packed_dtypes = self.packed_dtypes({plan.tensors[n].dtype for n in inputs if n in plan.tensors}
                                           & set(gemm.DTYPES_16BIT))
        packable = frozenset(n for n, layout in weights.items() if layout == "packed") | (
            (gemm_b_only(plan, packed_dtypes) & set(inputs)) - small_products(plan, self.pack_min_macs)
            if packed_dtypes else frozenset())
        missing = [n for n in inputs + written if n not in plan.tensors]
        if missing:
            raise BackendError(f"plan has no type for tensor {missing[0]!r}")
        intermediates = set(written) - set(plan.outputs)
        laid = self._layout_views(plan)
        convolved = convolutions(plan, functools.partial(self._convolves, tensors=plan.tensors))
        # the Im2col's input is read where its patches were
        views = {**laid.views, **{t: body.args[0].tensor for t, body in convolved.items()}}  # type: ignore[union-attr]
        # a Heads view is read where its source is: the source lives until the view's last reader
        reads = [[*k.reads, *loads(k.body)] for k in plan.kernels]
        shared = shared_buffers(
            [(k.out, [*r, *(views[t] for t in r if t in views)]) for k, r in zip(plan.kernels, reads, strict=True)],
            {n: math.prod(plan.tensors[n].shape) * storage_dtype(plan.tensors[n].dtype).itemsize for n in intermediates})
        buffers: dict[str, np.ndarray] = {}
        for name in inputs + written:
            ttype = plan.tensors[name]
            dtype = storage_dtype(ttype.dtype)
            if name in padded:  # a writable call input is copied in; a parameter is read from self.held
                k_rows, n_cols = ttype.shape  # a GEMM's right operand is 2-D
                buffers[name] = padded_matrix(k_rows, n_cols, np.float32, zero=True)
            elif name in shared:
                buffers[name] = typed_view(shared[name], ttype.shape, dtype)
            else:
                buffers[name] = aligned_empty(ttype.shape, dtype, zero=True)
        memory = Memory(buffers, frozenset(plan.outputs), packable, views, laid.handed, convolved, laid.layouts)
        steps = []
        for i, k in enumerate(plan.kernels):
            try:
                steps.append(self._step(k, plan.tensors, memory))
            except (CodegenError, BackendError) as exc:
                raise BackendError(f"kernel {i} ({k.describe()}): {exc}") from exc
        return CpuCompiledPlan(plan, steps, memory, inputs, time.perf_counter() - t0, self, padded)

    def weight_layouts(self, plan: Plan, inputs: frozenset[str]) -> dict[str, str]:
        """Each fp32 weight's layout (an input only GEMM libraries read, as the right operand): the one forced,
        else the one timed fastest for its product's shape, the rows of one tile, on this backend's threads
        (``gemm.shape_layout``).  A
        product of fewer than ``pack_min_macs`` multiply-adds is never packed."""
        layouts = {}
        products = gemm_products(plan)
        for name in gemm_b_only(plan) & inputs:
            rows, kdim, cols = products[name]
            small = rows * kdim * cols < self.pack_min_macs
            if self.weights != gemm.PER_SHAPE:
                layouts[name] = "given" if small and self.weights == "packed" else self.weights
                continue
            tile = (min(rows, gemm_tile_rows(rows, cols, kdim, self.tile_bytes)), kdim, cols)
            layouts[name] = gemm.shape_layout(self.gemm_library, self.fp32_packs and not small, tile, self.pool)
        return layouts

    def _layout_views(self, plan: Plan) -> LayoutViews:
        return layout_views(plan, functools.partial(self._torch_attention, tensors=plan.tensors),
                            functools.partial(self._generated_attention, tensors=plan.tensors))

    def prepare(self, plans: Sequence[Plan]) -> None:
        """Compile every kernel of ``plans`` that is not in the kernel cache, in batched compiler runs per worker
        thread, all at once (a search's candidates share most of their kernels): first each kernel as it stands
        (an fp32 attention's contiguous form is what its measured choice times), then the fp32 attentions that
        read or write in place (their layouts follow from that choice), and the transforms of each convolution
        Winograd's may compute (what its measured choice times)."""
        sources: dict[str, None] = {}
        for plan in plans:  # a 16-bit output is handed out widened by a generated loop (CpuCompiledPlan)
            sources.update(dict.fromkeys(widen_source(d) for d in {plan.tensors[o].dtype for o in plan.outputs}
                                         if d != "fp32"))
            sources.update(dict.fromkeys(self._winograd_sources(plan)))
            for k in plan.kernels:
                try:
                    sources.update(dict.fromkeys(self._sources(k, plan.tensors)))
                except (CodegenError, BackendError, KeyError):
                    continue  # compile() reports it, for the candidate it belongs to
        if not self._build(sources, len(plans)):
            return
        in_place: dict[str, None] = {}
        for plan in plans:
            try:
                layouts = self._layout_views(plan).layouts
                in_place.update(dict.fromkeys(self._in_place_sources(plan, layouts)))
            except (CodegenError, BackendError, KeyError):
                continue
        self._build(in_place, len(plans))

    def _winograd_sources(self, plan: Plan) -> list[str]:
        """The input and output transforms and the epilogue of each convolution of ``plan`` Winograd's applies
        to."""
        out: list[str] = []
        if winograd.forced() == "onednn":
            return out
        convolved = convolutions(plan, functools.partial(self._convolves, tensors=plan.tensors))
        for k in plan.kernels:
            patches = find_matmul(k.body).args[0] if k.kind in (KernelKind.GEMM_EPILOGUE, KernelKind.CUBLASLT) else None
            im2col = convolved.get(patches.tensor) if isinstance(patches, Load) else None
            if im2col is None:
                continue
            window, x = im2col.attr_dict, plan.tensors[im2col.args[0].tensor]  # type: ignore[union-attr]
            (pixels, channels), outputs = x.shape, int(k.body.type.shape[-1])
            if winograd.applies(window, channels, outputs):
                images = winograd.images_of(window, pixels)
                block = winograd.block_for(window, images, channels, outputs, self.threads)
                out += winograd.sources(window, images, channels, outputs, x.dtype, block)
                out.append(self._winograd_epilogue(k, plan.tensors).source)  # over fp32 rows, a 16-bit one too
        return out

    def _build(self, sources: Mapping[str, None], plans: int) -> bool:
        try:
            built = self.compiler.build_many(list(sources), jobs=self.threads)
        except CodegenError as exc:  # a hanging or missing compiler: each candidate reports it when compiled
            log.warning("batched kernel build failed (%s); kernels are built one by one", exc)
            return False
        log.info("prepared %d kernels of %d plans: %d compiled, the rest cached", len(sources), plans, built)
        return True

    def _in_place_sources(self, plan: Plan, layouts: Mapping[str, standalone.GroupLayout]) -> list[str]:
        """The generated attentions of ``plan`` that read an operand or write their result in place."""
        shapes = {n: tuple(t.shape) for n, t in plan.tensors.items()}
        out = []
        for k in plan.kernels:
            laid = standalone.attention_layouts(k.body, k.out, layouts) if k.body.op in standalone.ATTENTION_OPS else {}
            if laid and self._generated_attention(k, plan.tensors):
                out.append(standalone.source_of(k.body, shapes, laid) or "")
        return [s for s in out if s]

    def _sources(self, k: Kernel, tensors: Mapping[str, TensorType]) -> list[str]:
        """The generated sources ``compile`` will load for kernel ``k`` (as :meth:`_step` generates them)."""
        types = self._types(tensors)
        if k.kind == KernelKind.ELEMENTWISE:
            return [generate(k.body, types, stream=self._streams(k, tensors)).source]
        if k.kind in (KernelKind.GEMM_EPILOGUE, KernelKind.CUBLASLT):
            mm = find_matmul(k.body)
            tile_dtype = self._tile_dtype(k, tensors)
            widen = [widen_source(tensors[a.tensor].dtype) for a in mm.args  # type: ignore[union-attr]
                     if DTYPES[tensors[a.tensor].dtype].bytes != 4 and tile_dtype == "fp32"]  # type: ignore[union-attr]
            return [generate(k.body, types, tile=mm, tile_dtype=tile_dtype).source, *widen]
        if k.kind == KernelKind.STANDALONE and k.body.op in GATHERS:
            ids, table = (a.tensor for a in k.body.args)  # type: ignore[union-attr]
            if tensors[ids].dtype != "fp32":
                return []
            rows, width = tensors[table].shape
            return [standalone.gather_source(rows, width * storage_dtype(tensors[table].dtype).itemsize)]
        if k.kind == KernelKind.STANDALONE and k.body.op in CHANNEL_COPIES:
            itemsize = storage_dtype(k.body.type.dtype).itemsize
            return [standalone.transpose_source(*channels_plane(k.body, tensors), itemsize)] if itemsize in (2, 4) else []
        if k.kind == KernelKind.STANDALONE:
            source = standalone.source_of(k.body, {n: t[0] for n, t in types.items()})
            dtype = k.body.type.dtype
            if k.body.op in WINDOWED_PRODUCTS and self.native(dtype):
                return []  # torch's convolution
            if source is None or dtype == "fp32" or k.body.op in POOLS | WINDOWED_PRODUCTS:  # of its own dtype
                return [] if source is None else [source]
            if self.native(dtype):
                return []  # torch's fused attention
            return [source, widen_source(dtype), narrow_source(dtype)]
        return []

    def _streams(self, k: Kernel, tensors: Mapping[str, TensorType]) -> bool:
        """Is an elementwise or row kernel's output written with streaming stores?  Where what it reads and
        writes together is at a size where streaming pays on this machine (``stream_probe``; else at least the
        fixed threshold) and its output is at least an eighth of that: a kernel whose arrays stay in a cache
        finds its output's lines there on the next call (or the next kernel finds them), which a streaming
        store would have sent to memory."""
        def nbytes(name: str) -> int:
            return math.prod(tensors[name].shape) * storage_dtype(tensors[name].dtype).itemsize

        out = nbytes(k.out)
        total = out + sum(nbytes(r) for r in k.reads)
        if self.stream_bytes is not None:
            return out * 8 >= self.stream_bytes and total >= self.stream_bytes
        probe = machine_probe(self.threads)
        kind = "row" if is_row_kernel(k.body, {t: tensors[t].shape for t in loads(k.body)}) else "flat"
        return out * 8 >= min(total, probe.ceiling) and probe.pays(total, kind, self.pool)

    @property
    def identity(self) -> str:
        """What the plan cache keys on besides the device: a choice timed on 1 thread may not be best on 8, nor
        one timed with the kernels of another version of this backend (:func:`kernels_fingerprint`), nor one timed
        with AVX-512 code on an AVX2-narrowed run (the compiler's target flags)."""
        packed = ",".join(sorted(d for d in ("fp32", *gemm.DTYPES_16BIT) if self._packs(d))) or "none"
        target = " ".join(self.compiler.target or ()) or "native"
        return (f"cpu threads={self.threads} gemm={self.gemm_library} weights={self.weights} packed={packed} "
                f"target={target} kernels={kernels_fingerprint()}")

    def _packs(self, dtype: str) -> bool:
        """Whether weights of ``dtype`` are packed, for the identity: a dtype this CPU cannot pack, where the
        environment asks for packing, counts as not packed here (a plan of that dtype is refused at compile)."""
        try:
            return bool(self.packed_dtypes((dtype,)))
        except BackendError:
            return False

    def packed_dtypes(self, dtypes: Iterable[str] = gemm.DTYPES_16BIT) -> frozenset[str]:
        """Those of ``dtypes`` whose weights this backend may multiply from oneDNN's packed form: fp32 where its
        weights are ``packed`` or chosen per shape and fp32 packs here (``gemm.weight_layout``), a 16-bit one
        where torch multiplies it natively here and packing is chosen (``gemm.weight_layout_16bit``)."""
        return frozenset(d for d in dtypes if (self.fp32_packs if d == "fp32" else
                                               self.native(d) and gemm.weight_layout_16bit(d) == "packed"))

    def _step(self, k: Kernel, tensors: Mapping[str, TensorType], memory: Memory) -> Step:
        # generated loops trust these shapes: a mismatch would write out of bounds
        out_t = tensors[k.out]
        if tuple(out_t.shape) != tuple(k.body.type.shape) or out_t.dtype != k.body.type.dtype:
            raise BackendError(
                f"body computes {list(k.body.type.shape)} {k.body.type.dtype} but tensor {k.out!r} "
                f"is {list(out_t.shape)} {out_t.dtype}"
            )
        if k.kind == KernelKind.ELEMENTWISE:
            return self._elementwise(k, tensors, memory)
        if k.kind in (KernelKind.GEMM_EPILOGUE, KernelKind.CUBLASLT):
            return self._gemm(k, tensors, memory)
        if k.kind == KernelKind.OPAQUE:
            return self._opaque(k, tensors, memory)
        if k.kind == KernelKind.STANDALONE:
            return self._standalone(k, tensors, memory)
        raise BackendError(f"unknown kernel kind {k.kind!r}")


    def _elementwise(self, k: Kernel, tensors: Mapping[str, TensorType], memory: Memory) -> Step:
        ck = generate(k.body, self._types(tensors), stream=self._streams(k, tensors))
        fn, params, reads = self._bind(ck, memory.own)
        names = [n for n in params if n is not None]
        out_name, addr, pool, rows, cols = k.out, memory.addr, self.pool, ck.rows, ck.cols
        flat = not ck.row_width and all(p.index == "full" for p in ck.params)  # a row kernel runs whole rows
        parts = parallel.loop_parts(self.threads, rows * max(cols, ck.row_width))
        threads = 1
        if parts == 1:
            if flat:  # one row of every element: the form a streaming kernel streams
                rows, cols = 1, rows * cols

            def call() -> None:
                fn(*[addr[n] for n in names], addr[out_name], 0, rows, cols)
        elif flat:  # every operand in the output's layout: any shape splits
            sizes = [storage_dtype(p.dtype).itemsize for p in ck.params]
            out_size = memory.own[k.out].itemsize
            ranges = parallel.split(rows * cols, parts, parallel.CHUNK_ALIGN)
            threads = len(ranges)

            def call() -> None:
                ptrs = [addr[n] for n in names]
                out = addr[out_name]
                pool.run_kernel(fn, len(ptrs) + 1, [[*(p + e0 * z for p, z in zip(ptrs, sizes, strict=True)),
                                                     out + e0 * out_size, 0, 1, e1 - e0] for e0, e1 in ranges])
        else:  # a row vector read by column: split the rows
            row_ranges = parallel.split(rows, parts)
            threads = len(row_ranges)

            def call() -> None:
                ptrs = [addr[n] for n in names]
                out = addr[out_name]
                pool.run_kernel(fn, len(ptrs) + 1, [[*ptrs, out, r0, r1, cols] for r0, r1 in row_ranges])

        return Step(k, call, reads, memory.own[k.out], {"impl": "c-loop", "threads": threads,
                                                        "streaming_stores": streams(ck.source),
                                                        "source_sha256": ck.digest[:16]})


def convolutions(plan: Plan, convolves: Callable[[Kernel, str, Mapping[str, Any]], bool]) -> dict[str, Expr]:
    """Im2col kernels of ``plan`` whose patches need not be stored: every reader is a GEMM kernel that takes them
    as its left operand and computes the product as a convolution (``convolves(gemm, patches, window)``); not
    for a plan output.  Patches name -> the Im2col body."""
    readers: dict[str, list[Kernel]] = {}
    for k in plan.kernels:
        for t in dict.fromkeys([*k.reads, *loads(k.body)]):
            readers.setdefault(t, []).append(k)
    out: dict[str, Expr] = {}
    for k in plan.kernels:
        body, users = k.body, readers.get(k.out, [])
        if (k.kind == KernelKind.STANDALONE and body.op == "Im2col" and isinstance(body.args[0], Load)
                and k.out not in plan.outputs and users and all(convolves(u, k.out, body.attr_dict) for u in users)):
            out[k.out] = body
    return out


@dataclass(frozen=True)
class LayoutViews:
    """The layout kernels of a plan that copy nothing (:func:`layout_views`)."""

    #: a view's result -> the tensor whose memory it reads (that buffer lives until the view's last reader)
    views: dict[str, str]
    #: torch attention results handed to their Merge readers as torch wrote them
    handed: frozenset[str]
    #: where generated attention kernels read a view, or write a result its Merge reads in place
    layouts: dict[str, standalone.GroupLayout]


def layout_views(plan: Plan, torch_attention: Callable[[Kernel], bool],
                 generated_attention: Callable[[Kernel], bool]) -> LayoutViews:
    """Layout kernels of ``plan`` that need copy nothing, around attentions that read strided operands: torch's
    (``torch_attention(kernel)``) and the generated fp32 kernel (``generated_attention(kernel)``).  A Heads
    read only by such attentions is a view of its source (for the generated kernel also through a GroupRepeat
    only such kernels read: grouped-query attention's keys); a GroupRepeat only generated kernels read, of a
    contiguous source or such a Heads, is a view of it (a mask repeated over the heads); torch's result read only
    by Merges is handed to them as torch wrote it; the generated kernel's result read only by Merges is written
    as their token rows, which they read in place.  Neither for a plan output, nor for a view of one (a view
    would keep the caller's array alive)."""
    readers: dict[str, list[Kernel]] = {}
    for k in plan.kernels:
        for t in dict.fromkeys([*k.reads, *loads(k.body)]):
            readers.setdefault(t, []).append(k)
    outputs = set(plan.outputs)

    def kept(k: Kernel) -> bool:  # a layout kernel over a loaded tensor, neither of them a plan output
        return (k.kind == KernelKind.STANDALONE and k.out not in outputs and bool(readers.get(k.out))
                and isinstance(k.body.args[0], Load) and k.body.args[0].tensor not in outputs)

    def repeat_in_place(k: Kernel) -> bool:
        return k.body.op == "GroupRepeat" and kept(k) and all(generated_attention(u) for u in readers[k.out])

    views: dict[str, str] = {}
    handed: set[str] = set()
    layouts: dict[str, standalone.GroupLayout] = {}
    for k in plan.kernels:
        body, users = k.body, readers.get(k.out, [])
        if k.out in outputs or not users:
            continue
        source = body.args[0].tensor if body.args and isinstance(body.args[0], Load) else ""
        if body.op == "Heads" and kept(k) and all(torch_attention(u) for u in users):
            views[k.out] = source
        elif body.op == "Heads" and kept(k) and source not in views and all(
                generated_attention(u) or repeat_in_place(u) for u in users):
            views[k.out] = source
            layouts[k.out] = standalone.heads_layout(body, plan.tensors[source].shape[-1])
        elif repeat_in_place(k) and (source in layouts or source not in views):
            shape = plan.tensors[source].shape
            base = layouts.get(source) or standalone.GroupLayout.contiguous(int(body.attr_dict["rows"]), shape[-1])
            if base.repeat == 1:
                views[k.out] = views.get(source, source)
                layouts[k.out] = base.repeated(int(body.attr_dict["heads"]))
        elif torch_attention(k) and all(u.kind == KernelKind.STANDALONE and u.body.op == "Merge"
                                        and isinstance(u.body.args[0], Load) for u in users):
            handed.add(k.out)
        elif generated_attention(k) and all(u.kind == KernelKind.STANDALONE and u.body.op == "Merge"
                                            and isinstance(u.body.args[0], Load) for u in users):
            groups, seq, width = plan.tensors[k.out].shape
            heads = {int(u.body.attr_dict["heads"]) for u in users}
            if len(heads) == 1:
                layouts[k.out] = standalone.merged_layout(heads.pop(), seq, width)
                views.update({u.out: k.out for u in users})
    return LayoutViews(views, frozenset(handed), layouts)

