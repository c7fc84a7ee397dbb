"""How each kernel of a plan becomes a step of the CPU backend: the GEMM steps (a library product by row tiles
with a generated epilogue, or oneDNN post-ops on packed weights) and the standalone ones (attention's layouts and
products, the fused attention kernel, torch-backed Opaque kernels). ``CpuBackend`` is built from these."""

from __future__ import annotations

import functools
import logging
import math
import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from backends.codegen import find_matmul
from backends.cpu import gemm, parallel, standalone, winograd
from backends.cpu.buffers import (
    HeldWeights,
    aligned_empty,
)
from backends.cpu.codegen import CKernel, CodegenError, generate, narrow_source, rows_cols, widen_source
from backends.cpu.compiler import Compiler
from backends.cpu.memory import Memory, Step, from_storage, gemm_tile_rows, storage_dtype, to_storage, weights_fact
from planner.backend import (
    BackendError,
)
from planner.core.cost import DeviceSpec
from planner.core.graph import TensorType
from planner.core.kinds import KernelKind
from planner.core.opaque import opaque_writer
from planner.core.ops import GATHERS, LAYOUT_COPIES, POOLS, WINDOWED_PRODUCTS
from planner.core.plans import Expr, Kernel, Load
from planner.core.reference import eval_expr
from planner.core.shapes import WINDOW, window_out

#: layout copies a generated transpose makes (of 2- and 4-byte elements)
CHANNEL_COPIES = frozenset({"ChannelsLast", "ChannelsFirst"})

log = logging.getLogger(__name__)


def channels_plane(body: Expr, tensors: Mapping[str, TensorType]) -> tuple[int, int]:
    """The (rows, cols) of each image's plane a ChannelsLast ((C, pixels)) or ChannelsFirst ((pixels, C)) body
    transposes."""
    pixels = int(body.attr_dict["pixels"])
    if body.op == "ChannelsLast":
        return int(body.attr_dict["channels"]), pixels
    source = body.args[0]
    assert isinstance(source, Load)
    return pixels, int(tensors[source.tensor].shape[-1])


class StepsBase:
    """What the step builders read of the backend (``CpuBackend`` sets it), and the kernel binding they share."""

    spec: DeviceSpec
    threads: int
    pool: parallel.WorkerPool
    compiler: Compiler
    gemm_library: str
    matmul: gemm.MatMul
    bmm: standalone.BatchMatMul
    blas_threads: int | None
    tile_bytes: int
    held: HeldWeights
    controller: Any  # threadpoolctl's, for BLAS's thread count
    #: the plan's tensor types as the code generators take them, for the last tensors mapping seen
    _types_of: tuple[Mapping[str, TensorType], dict[str, tuple[tuple[int, ...], str]]] | None
    #: the kernel computing each fp32 attention shape: ``generated`` or ``torch`` (``_fp32_attention``)
    _attention_kernels: dict[tuple[Any, ...], str]
    #: the product computing each 3x3 convolution shape: ``onednn`` or ``winograd`` (``_convolution_kernel``)
    _convolution_kernels: dict[tuple[Any, ...], str]

    def _types(self, tensors: Mapping[str, TensorType]) -> dict[str, tuple[tuple[int, ...], str]]:
        """Shape and dtype by tensor, for codegen; one plan's kernels share its table (built once per plan:
        a 1,000-op plan's kernels built it 1,000 times)."""
        if self._types_of is None or self._types_of[0] is not tensors:
            self._types_of = (tensors, {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()})
        return self._types_of[1]

    def _bind(self, ck: CKernel, buffers: Mapping[str, np.ndarray]) -> tuple[Callable[..., None], list[str | None], list[np.ndarray]]:
        """The compiled function, the tensor of each pointer parameter (None: the GEMM tile), the buffers read."""
        fn = self.compiler.function(ck.source, len(ck.params) + 1)
        names, reads = [], []
        for p in ck.params:
            if p.tensor is not None and p.tensor not in buffers:
                raise BackendError(f"kernel loads {p.tensor!r}, which is neither an input nor written by a kernel")
            names.append(p.tensor)
            if p.tensor is not None:
                reads.append(buffers[p.tensor])
        return fn, names, reads

    def native(self, dtype: str) -> bool:
        """Does this backend multiply ``dtype`` (16-bit) in torch's native kernels rather than widening it?  Its
        own choice (``FUSION_PLANNER_CPU_GEMM_16BIT``), whichever library multiplies fp32, where torch is loaded."""
        return dtype != "fp32" and (self.gemm_library == "torch" or "torch" in sys.modules) and gemm.native_16bit(dtype)


class GemmSteps(StepsBase):
    """GEMM kernels: the product by row tiles with the generated epilogue, or oneDNN's post-ops."""

    def _widen(self, memory: Memory, name: str, dtype: str, max_rows: int) -> tuple[Callable[[int, int], np.ndarray], int]:
        """``widen(r0, r1)``: fp32 values of rows r0..r1 of a GEMM operand, and the scratch bytes used.

        fp32 operands are views of their array; 16-bit ones are converted into a scratch of
        ``max_rows`` rows by a generated kernel (numpy's fp16 conversion is about 10x slower),
        the analogue of BLAS packing.
        """
        buf = memory.own[name]
        arrays, addr = memory.arrays, memory.addr
        if buf.dtype == np.float32:
            return (lambda r0, r1: arrays[name][r0:r1]), 0
        cols = buf.shape[-1]
        wide = aligned_empty((max_rows, cols), np.float32)
        fn = self.compiler.function(widen_source(dtype), 2)
        dst, row_bytes = wide.ctypes.data, cols * buf.itemsize

        def widen(r0: int, r1: int) -> np.ndarray:
            fn(addr[name] + r0 * row_bytes, dst, 0, r1 - r0, cols)
            return wide[: r1 - r0]

        return widen, wide.nbytes

    def _tile_dtype(self, k: Kernel, tensors: Mapping[str, TensorType]) -> str:
        """How a GEMM kernel's product tile is stored: in the operands' 16-bit dtype where torch multiplies it
        natively (the product rounded to it, as eager torch rounds a Linear's output), else fp32."""
        mm = find_matmul(k.body)
        dtypes = {tensors[a.tensor].dtype for a in mm.args if isinstance(a, Load)}
        (dtype,) = dtypes if len(dtypes) == 1 else ("fp32",)
        return dtype if self.native(dtype) else "fp32"

    @staticmethod
    def _stored(memory: Memory, name: str) -> tuple[Callable[[int, int], np.ndarray], int]:
        """``rows(r0, r1)``: rows r0..r1 of a GEMM operand as stored (no scratch)."""
        arrays = memory.arrays
        return (lambda r0, r1: arrays[name][r0:r1]), 0

    def _gemm(self, k: Kernel, tensors: Mapping[str, TensorType], memory: Memory) -> Step:
        patches = find_matmul(k.body).args[0]
        im2col = memory.convolved.get(patches.tensor) if isinstance(patches, Load) else None
        if im2col is not None:
            return self._convolution(k, tensors, memory, im2col)
        step = self._library_gemm(k, tensors, memory)
        post = self._post_ops(k, tensors, memory)
        return step if post is None else self._with_post_ops(k, memory, step, *post)

    def _convolves(self, k: Kernel, im2col: str, window: Mapping[str, Any], tensors: Mapping[str, TensorType]) -> bool:
        """Can GEMM kernel ``k``, reading the Im2col patches ``im2col`` (of ``window``) as its left operand and
        nowhere else, compute its product as a convolution: torch's (patches, weight and product tile of one
        dtype torch multiplies: fp32, or a 16-bit one natively), or Winograd's (a 16-bit dtype torch would widen,
        where it applies)?"""
        if k.kind not in (KernelKind.GEMM_EPILOGUE, KernelKind.CUBLASLT) or not (
                self.gemm_library == "torch" or "torch" in sys.modules):
            return False
        mm = find_matmul(k.body)
        a, b = mm.args
        if not (isinstance(a, Load) and isinstance(b, Load) and a.tensor == im2col and b.tensor != im2col):
            return False
        if sum(1 for e in k.body.walk() for x in e.args if isinstance(x, Load) and x.tensor == im2col) != 1:
            return False  # the patches read by the product only
        dtype, stored = self._tile_dtype(k, tensors), tensors[a.tensor].dtype
        if stored != tensors[b.tensor].dtype:
            return False
        return stored == dtype or winograd.applies(window, tensors[a.tensor].shape[1] // 9, tensors[b.tensor].shape[1])

    def _convolution(self, k: Kernel, tensors: Mapping[str, TensorType], memory: Memory, im2col: Any) -> Step:
        """A GEMM kernel over Im2col patches as torch's convolution of the patches' source (no patches stored),
        the product handed to the generated epilogue as its tile (the bias, BatchNorm's shift, ReLU, a residual
        add run over it in cache-sized parts across the pool)."""
        mm = find_matmul(k.body)
        b_name = mm.args[1].tensor  # type: ignore[union-attr]
        x_name, dtype = im2col.args[0].tensor, self._tile_dtype(k, tensors)
        if self._convolution_kernel(im2col.attr_dict, memory.own[x_name].shape, k.body.type.shape[-1],
                                    tensors[x_name].dtype) == "winograd":
            return self._winograd(k, tensors, memory, im2col)
        conv = gemm.torch_conv(dtype, im2col.attr_dict)
        arrays, addr, out_name = memory.arrays, memory.addr, k.out
        rows, cols = rows_cols(tuple(k.body.type.shape))
        facts: dict[str, Any] = {"impl": f"torch-{dtype}-conv", "threads": self.threads, "patches": "not stored"}
        reads = [memory.own[x_name], memory.own[b_name]]
        post = conv_post_ops(k.body, mm)
        if post is not None and all(tensors[n].dtype == dtype for n in (*post[:2], out_name) if n is not None):
            bias, other, unary = post
            is_output, own = out_name in memory.outputs, memory.own[out_name]
            named = [n for n in (bias, other) if n is not None]

            def call_fused() -> None:  # on the plan's torch threads (CpuCompiledPlan._pools)
                result = conv(arrays[x_name], arrays[b_name], None if bias is None else arrays[bias],
                              None if other is None else arrays[other], unary)
                memory.hand_over(out_name, result.numpy() if dtype == "fp32" else gemm.tensor_bits(result), is_output)

            facts["impl"] = f"onednn-{dtype}-conv" + ("-post-ops" if k.body is not mm else "")
            return Step(k, call_fused, reads + [memory.own[n] for n in named], own, facts)
        ck = generate(k.body, self._types(tensors), tile=mm, tile_dtype=dtype)
        fn, params, epilogue_reads = self._bind(ck, memory.own)
        itemsize = storage_dtype(dtype).itemsize
        facts.update(impl=f"torch-{dtype}-conv+c-epilogue", source_sha256=ck.digest[:16])

        epilogue = self._tile_epilogue(fn, params, addr, out_name, rows, cols, itemsize)

        def call() -> None:
            result = conv(arrays[x_name], arrays[b_name])  # alive until the epilogue is done
            epilogue(result.data_ptr())

        return Step(k, call, reads + [b for b in epilogue_reads if all(b is not r for r in reads)],
                    memory.own[out_name], facts)

    def _convolution_kernel(self, window: Mapping[str, Any], x_shape: tuple[int, ...], outputs: int,
                            dtype: str) -> str:
        """``onednn`` or ``winograd`` for a convolution of ``dtype`` over channels-last rows of ``x_shape`` giving
        ``outputs`` channels: Winograd's where it applies and was measured faster (decided once per shape for this
        backend), or where torch does not multiply the 16-bit dtype natively (``_convolves``)."""
        pixels, channels = x_shape
        images = winograd.images_of(window, pixels)
        if not winograd.applies(window, channels, outputs):
            return "onednn"
        if dtype != "fp32" and not self.native(dtype):
            return "winograd"
        key = (*(int(window[a]) for a in WINDOW), images, channels, outputs, dtype)
        if key not in self._convolution_kernels:
            self._convolution_kernels[key] = winograd.measured_convolution(
                window, images, channels, outputs, dtype, self.threads,
                functools.partial(self._time_convolution, window, images, channels, outputs, dtype),
                code=self.compiler.target or ())
        return self._convolution_kernels[key]

    def _time_convolution(self, window: Mapping[str, Any], images: int, channels: int, outputs: int,
                          dtype: str = "fp32") -> dict[str, float]:
        """Seconds per product of oneDNN's convolution and Winograd's on random operands of this shape and
        ``dtype`` (a read-only weight, as a bound parameter is), on this backend's threads, interleaved
        (``gemm.fastest_of``)."""
        rng = np.random.default_rng(0)
        stored = storage_dtype(dtype)
        x = np.empty((images * int(window["height"]) * int(window["width"]), channels), stored)
        w = np.empty((9 * channels, outputs), stored)
        to_storage(np.asarray(rng.standard_normal(x.shape, dtype=np.float32)), dtype, x)
        to_storage(np.asarray(rng.standard_normal(w.shape, dtype=np.float32)), dtype, w)
        w.flags.writeable = False
        onednn = gemm.torch_conv(dtype, window)
        block = winograd.block_for(window, images, channels, outputs, self.threads)
        fast = winograd.winograd_conv(window, images, channels, outputs, self.compiler.function, self.pool,
                                      self.threads, dtype, block)
        with parallel.torch_threads(self.threads):
            return gemm.fastest_of({"onednn": lambda: onednn(x, w), "winograd": lambda: fast(x, w)})

    def _winograd_epilogue(self, k: Kernel, tensors: Mapping[str, TensorType]) -> CKernel:
        """The generated epilogue of a Winograd convolution kernel, over its fp32 product rows."""
        return generate(k.body, self._types(tensors), tile=find_matmul(k.body), tile_dtype="fp32")

    def _winograd(self, k: Kernel, tensors: Mapping[str, TensorType], memory: Memory, im2col: Expr) -> Step:
        """A GEMM kernel over Im2col patches as Winograd's F(4x4, 3x3) convolution of the patches' source, the
        fp32 product rows handed to the generated epilogue as its tile."""
        mm = find_matmul(k.body)
        x_name, b_name = im2col.args[0].tensor, mm.args[1].tensor  # type: ignore[union-attr]
        (pixels, channels), (rows, cols) = memory.own[x_name].shape, rows_cols(tuple(k.body.type.shape))
        window, dtype = im2col.attr_dict, tensors[x_name].dtype
        images = winograd.images_of(window, pixels)
        block = winograd.block_for(window, images, channels, cols, self.threads)
        work = memory.scratch(0, (winograd.scratch_floats(window, images, channels, cols, block),), np.float32)
        conv = winograd.winograd_conv(window, images, channels, cols, self.compiler.function, self.pool,
                                      self.threads, dtype, block, work)
        ck = self._winograd_epilogue(k, tensors)
        fn, params, epilogue_reads = self._bind(ck, memory.own)
        epilogue = self._tile_epilogue(fn, params, memory.addr, k.out, rows, cols, 4)
        arrays, reads = memory.arrays, [memory.own[x_name], memory.own[b_name]]
        facts = {"impl": f"winograd-f4x4-{dtype}-conv+c-epilogue", "threads": self.threads, "patches": "not stored",
                 "source_sha256": ck.digest[:16]}

        def call() -> None:  # the batched product on the plan's torch threads (CpuCompiledPlan._pools)
            epilogue(conv(arrays[x_name], arrays[b_name]).ctypes.data)

        return Step(k, call, reads + [b for b in epilogue_reads if all(b is not r for r in reads)],
                    memory.own[k.out], facts)

    def _post_ops(self, k: Kernel, tensors: Mapping[str, TensorType],
                  memory: Memory) -> tuple[str, str, str | None, gemm.PackedLinear] | None:
        """(a, b, bias, linear) where a GEMM kernel's body (a cuBLASLt epilogue, or a generated one) is
        ``[activation]([BiasAdd](product))``, which oneDNN applies to the packed product itself as post-ops
        (``gemm.LINEAR_UNARY``): its right operand a packable weight, every operand and the output of the product
        tile's dtype (fp32, or the 16-bit one torch multiplies natively); else None.  A residual add stays the
        generated epilogue's (oneDNN's binary post-op was no faster: bf16 256x3072x768, one core), and so does an
        activation whose post-op is slower than the epilogue here (:meth:`_post_op_pays`)."""
        if k.kind not in (KernelKind.CUBLASLT, KernelKind.GEMM_EPILOGUE):
            return None
        mm = find_matmul(k.body)
        post = post_ops(k.body, mm, gemm.LINEAR_UNARY)
        if post is None or post[1] is not None:
            return None
        bias, _, unary = post
        a_name, b_name = (a.tensor for a in mm.args)  # type: ignore[union-attr]
        dtype = self._tile_dtype(k, tensors)
        operands = [a_name, b_name, k.out, *([bias] if bias else [])]
        if b_name not in memory.packable or any(tensors[n].dtype != dtype for n in operands):
            return None
        if unary != gemm.NO_POST_OP and not self._post_op_pays(dtype, unary, memory, a_name, b_name):
            return None
        return a_name, b_name, bias, gemm.packed_linear(dtype, unary)

    def _post_op_pays(self, dtype: str, unary: gemm.UnaryPostOp, memory: Memory, a_name: str, b_name: str) -> bool:
        """Is oneDNN's activation as a post-op no slower than the generated epilogue here
        (``gemm.post_op_pays``, timed on the product's shape, the rows of one tile, on this backend's threads)?"""
        (rows, kdim), cols = memory.own[a_name].shape, memory.own[b_name].shape[1]
        tile = (min(rows, gemm_tile_rows(rows, cols, kdim, self.tile_bytes)), kdim, cols)
        return gemm.post_op_pays(dtype, unary, tile, self.threads)

    @staticmethod
    def _with_post_ops(k: Kernel, memory: Memory, step: Step, a_name: str, b_name: str, bias: str | None,
                       linear: gemm.PackedLinear) -> Step:
        """A cublaslt kernel as oneDNN's packed product with its epilogue as post-ops, while the weight is packed
        (``step``, the product and generated epilogue, otherwise).  The result is handed to the readers as oneDNN
        wrote it (a fresh contiguous tensor), copied only into a plan output."""
        arrays, packed, out_name, regular = memory.arrays, memory.packed, k.out, step.call
        is_output = out_name in memory.outputs

        def call() -> None:
            weight = packed.get(b_name)
            if weight is None:
                if not is_output:
                    memory.restore(out_name)
                regular()
                return
            memory.hand_over(out_name, gemm.tensor_bits(linear(arrays[a_name], weight,
                                                               None if bias is None else arrays[bias])), is_output)

        facts = dict(step.facts, impl=f"onednn-{k.body.type.dtype}-post-ops", weights="packed if read-only")
        return Step(k, call, step.reads, step.writes, facts)

    def _library_gemm(self, k: Kernel, tensors: Mapping[str, TensorType], memory: Memory) -> Step:
        mm = find_matmul(k.body)
        a_name, b_name = (a.tensor for a in mm.args)  # type: ignore[union-attr]
        buffers = memory.own
        for name in (a_name, b_name):
            if name not in buffers:
                raise BackendError(f"GEMM reads {name!r}, which is neither an input nor written by a kernel")
        a_buf, b_buf = buffers[a_name], buffers[b_name]
        rows, cols = rows_cols(tuple(k.body.type.shape))
        kdim = a_buf.shape[-1]
        if a_buf.shape != (rows, kdim) or b_buf.shape != (kdim, cols):
            raise BackendError(f"GEMM operands {list(a_buf.shape)} @ {list(b_buf.shape)} do not give {[rows, cols]}")
        a_dtype, b_dtype = tensors[a_name].dtype, tensors[b_name].dtype
        # torch multiplies some 16-bit dtypes natively (AMX): the operands are read as stored, never widened,
        # and the epilogue reads the product's 16-bit tile
        tile_dtype = self._tile_dtype(k, tensors)
        native = tile_dtype != "fp32"
        stored = native or a_dtype == b_dtype == "fp32"  # the library reads both operands as stored
        # a torch product keeps its operands' views while they stay the same arrays (not one handed out)
        keep = (a_name not in memory.outputs, b_name not in memory.outputs)
        # a weight of a packed dtype (fp32, or a native 16-bit one) is multiplied by oneDNN, on torch's threads
        linear = gemm.packed_linear(tile_dtype) if stored and b_name in memory.packable else None
        # numpy's BLAS: one row block per worker, BLAS on one thread inside each.  torch (oneDNN): one block,
        # torch.mm on every thread (MKL's own split of a GEMM beat ours by 1.2-1.3x on 2 cores here), and each
        # tile's epilogue split by rows across the workers.
        torch_gemm = self.gemm_library == "torch" or linear is not None
        blocks = [(0, rows)] if torch_gemm else parallel.split(rows, parallel.gemm_parts(self.threads, rows))
        # the workers share the last-level cache: each block's tiles get its share of the tile budget
        tile_rows = min(gemm_tile_rows(rows, cols, kdim, self.tile_bytes // len(blocks)), blocks[0][1] - blocks[0][0])
        if k.body is mm and stored and k.body.type.dtype == tile_dtype:
            product = self._own_product(native, tile_dtype, (*keep, False))
            step = self._product(k, memory, (a_name, b_name), self._packing(memory, b_name, product, linear), torch_gemm)
            step.facts["weights"] = "packed if read-only" if linear else step.facts["weights"]
            return step
        widen_b, b_scratch = self._stored(memory, b_name) if native else self._widen(memory, b_name, b_dtype, b_buf.shape[0])
        ck = generate(k.body, self._types(tensors), tile=mm, tile_dtype=tile_dtype)
        b_rows = b_buf.shape[0]
        scratch = b_scratch
        blockwork: list[tuple[Callable[..., None], list[str | None], np.ndarray, Callable[[int, int], np.ndarray],
                              list[tuple[int, int]]]] = []
        reads: list[np.ndarray] = []
        for slot, (r_start, r_end) in enumerate(blocks):
            tile = memory.scratch(slot, (tile_rows, cols), storage_dtype(tile_dtype))
            widen_a, a_scratch = self._stored(memory, a_name) if native else self._widen(memory, a_name, a_dtype,
                                                                                          tile_rows)
            fn, params, reads = self._bind(ck, buffers)
            scratch += tile.nbytes + a_scratch
            bounds = [(r, min(r_end, r + tile_rows)) for r in range(r_start, r_end, tile_rows)]
            blockwork.append((fn, params, tile, widen_a, bounds))
        pool, addr, out_name, threads = self.pool, memory.addr, k.out, self.threads
        facts = {
            "impl": f"torch-{a_dtype}-gemm+c-epilogue" if native else f"{self.gemm_library}-gemm+c-epilogue",
            "tile_rows": tile_rows,
            "tiles": sum(-(-(end - start) // tile_rows) for start, end in blocks),
            "threads": threads if torch_gemm else len(blocks),
            "scratch_bytes": scratch,
            "blas_threads": self.blas_threads or "default",
            "weights": "packed if read-only" if linear else weights_fact(b_buf),
            "source_sha256": ck.digest[:16],
        }
        step_reads = [a_buf, b_buf] + [b for b in reads if b is not a_buf and b is not b_buf]
        if torch_gemm and stored and tile_rows >= rows:  # one tile, operands as stored: the short route
            (fn, params, tile, _, _), = blockwork
            call_one = self._one_tile(memory, (a_name, b_name, out_name), self._own_product(native, tile_dtype, (*keep, True)),
                                      fn, params, tile, linear)
            return Step(k, call_one, step_reads, buffers[k.out], facts)
        product = self._packing(memory, b_name, gemm.torch_mm(a_dtype) if native else self.matmul, linear)

        def call() -> None:
            b32 = widen_b(0, b_rows)  # B as the product reads it (fp32: widened once), shared by the blocks
            out = addr[out_name]
            if torch_gemm:
                ((fn, params, tile, widen_a, bounds),) = blockwork
                epilogue = _split_epilogue(pool, threads, fn, [None if n is None else addr[n] for n in params],
                                           tile.ctypes.data, out, cols, tile.itemsize)
                _gemm_block(product, epilogue, tile, widen_a, b32, bounds)  # torch's threads: the plan's (_pools)
                return
            pool.run([functools.partial(_gemm_block, product, functools.partial(
                          fn, *[tile.ctypes.data if n is None else addr[n] for n in params], out), tile, widen_a, b32, bounds)
                      for fn, params, tile, widen_a, bounds in blockwork])

        return Step(k, call, step_reads, buffers[k.out], facts)

    def _one_tile(self, memory: Memory, names: tuple[str, str, str], product: gemm.MatMul, fn: Callable[..., None],
                  params: list[str | None], tile: np.ndarray, linear: gemm.PackedLinear | None) -> Callable[[], None]:
        """A torch GEMM + epilogue whose product is one tile, operands read as stored: the product of the
        operands as bound (or by ``linear`` from the right operand's packed form, when it has one: the epilogue
        reads oneDNN's result in place of the tile), then the epilogue over every row (on the calling thread, or
        split across the pool)."""
        a_name, b_name, out_name = names
        arrays, packed = memory.arrays, memory.packed
        rows, cols = tile.shape
        tile_ptr = tile.ctypes.data
        epilogue = self._tile_epilogue(fn, params, memory.addr, out_name, rows, cols, tile.itemsize)

        def call() -> None:
            weight = packed.get(b_name) if linear is not None else None
            if weight is None:
                product(arrays[a_name], arrays[b_name], tile)  # on the plan's torch threads (CpuCompiledPlan._pools)
                ptr = tile_ptr
            else:
                result = linear(arrays[a_name], weight)  # type: ignore[misc]  # alive until the epilogue is done
                ptr = result.data_ptr()
            epilogue(ptr)

        return call

    def _tile_epilogue(self, fn: Callable[..., None], params: list[str | None], addr: dict[str, int], out_name: str,
                       rows: int, cols: int, itemsize: int) -> Callable[[int], None]:
        """``run(tile_ptr)``: a generated epilogue over every row of a product tile (``tile_ptr`` its first
        element), on the calling thread or split across the pool."""
        pool, threads = self.pool, self.threads

        def run(ptr: int) -> None:
            if threads == 1:
                fn(*[ptr if n is None else addr[n] for n in params], addr[out_name], 0, rows, cols)
                return
            _split_epilogue(pool, threads, fn, [None if n is None else addr[n] for n in params], ptr,
                            addr[out_name], cols, itemsize)(0, rows, cols)

        return run

    def _own_product(self, native: bool, tile_dtype: str, keep: tuple[bool, bool, bool]) -> gemm.MatMul:
        """The backend's own library product (what multiplies a packable weight while it is not packed, a
        writable array): torch's where the dtype is native or torch is the library, keeping views per ``keep``."""
        return gemm.torch_mm(tile_dtype, keep) if native or self.gemm_library == "torch" else self.matmul

    @staticmethod
    def _packing(memory: Memory, b_name: str, product: gemm.MatMul, linear: gemm.PackedLinear | None) -> gemm.MatMul:
        """``product``, or, while the right operand has a packed form, ``linear``'s result copied into the output."""
        if linear is None:
            return product
        return gemm.packing(product, linear, functools.partial(memory.packed.get, b_name))

    def _product(self, k: Kernel, memory: Memory, names: tuple[str, str], product: gemm.MatMul,
                 torch_gemm: bool) -> Step:
        """A GEMM kernel that is its product alone: the library writes the output's rows, no tile, no epilogue
        (which would only copy the tile).  Row blocks as in :meth:`_gemm` (one on torch's threads where
        ``torch_gemm``)."""
        (a_name, b_name), arrays, out_name, threads, pool = names, memory.arrays, k.out, self.threads, self.pool
        a_buf, b_buf = memory.own[a_name], memory.own[b_name]
        rows = a_buf.shape[0]
        blocks = [(0, rows)] if torch_gemm else parallel.split(rows, parallel.gemm_parts(threads, rows))

        def call() -> None:
            a, b, out = arrays[a_name], arrays[b_name], arrays[out_name]
            if torch_gemm:  # on the plan's torch threads (CpuCompiledPlan._pools)
                product(a, b, out)
                return
            pool.run([functools.partial(product, a[r0:r1], b, out[r0:r1]) for r0, r1 in blocks])

        facts = {"impl": f"{self.gemm_library}-gemm", "threads": threads if torch_gemm else len(blocks),
                 "blas_threads": self.blas_threads or "default",
                 "weights": weights_fact(b_buf)}
        if k.body.type.dtype != "fp32":  # a 16-bit product torch multiplies natively
            facts["impl"] = f"torch-{k.body.type.dtype}-gemm"
        return Step(k, call, [a_buf, b_buf], memory.own[out_name], facts)


class StandaloneSteps(StepsBase):
    """Standalone kernels (attention's layouts and products, fused attention) and Opaque kernels."""

    def _standalone(self, k: Kernel, tensors: Mapping[str, TensorType], memory: Memory) -> Step:
        body = k.body
        order = [a.tensor for a in body.args if isinstance(a, Load)]
        if len(order) != len(body.args):
            return self._converted(k, tensors, memory)
        arrays, out_name, reads = memory.arrays, k.out, [memory.own[n] for n in dict.fromkeys(order)]
        if body.op == "Heads" and out_name in memory.views:
            return self._heads_view(k, memory, order[0], reads)
        if body.op == "GroupRepeat" and out_name in memory.views:
            return self._source_view(k, memory, order[0], reads)
        if body.op == "Merge" and out_name in memory.views:
            return self._merged_rows(k, memory, order[0], reads)
        if body.op == "Im2col" and out_name in memory.convolved:  # its reader convolves the source itself
            return Step(k, lambda: None, reads, memory.own[out_name], {"impl": "none: read as a convolution"})
        if body.op == "Merge" and order[0] in memory.handed:
            return self._merge_handed(k, memory, order[0], reads)
        if body.op in GATHERS:  # the table's stored bits at the ids (fp32): any dtype
            return self._gather(k, memory, order, reads)
        if body.op in POOLS:
            if tensors[order[0]].dtype != body.type.dtype:
                return self._converted(k, tensors, memory)  # the reference's numpy form
            return self._pool(k, memory, order[0], reads)
        if body.op in WINDOWED_PRODUCTS:
            if any(tensors[n].dtype != body.type.dtype for n in order):
                return self._converted(k, tensors, memory)
            return self._depthwise(k, memory, order, reads)
        if body.op in CHANNEL_COPIES and memory.own[out_name].itemsize in (2, 4) and (
                memory.own[order[0]].itemsize == memory.own[out_name].itemsize):
            return self._channels(k, tensors, memory, order[0], reads)
        if body.op in LAYOUT_COPIES:  # a copy of the stored bits: any dtype
            copy = standalone.layout_copy(body)

            def call_copy() -> None:
                copy(arrays[order[0]], arrays[out_name])

            return Step(k, call_copy, reads, memory.own[k.out], {"impl": "numpy-layout-copy"})
        dtype = body.type.dtype
        if any(tensors[n].dtype != dtype for n in order):
            return self._converted(k, tensors, memory)
        if body.op in standalone.ATTENTION_OPS:
            return self._attention(k, tensors, memory, order, reads)
        bmm, impl = self.bmm, f"{self.gemm_library}-batched-gemm"
        if dtype != "fp32":
            if not self.native(dtype):
                return self._converted(k, tensors, memory)  # 16-bit storage: the reference's numpy form
            bmm, impl = standalone.torch_bmm_16bit(dtype), f"torch-{dtype}-batched-gemm"
        write = standalone.scores_writer(body, bmm, dtype) if body.op == "BatchScores" else bmm

        def call_product() -> None:  # a torch product runs on the plan's torch threads (CpuCompiledPlan._pools)
            write(arrays[order[0]], arrays[order[1]], arrays[out_name])

        return Step(k, call_product, reads, memory.own[k.out], {"impl": impl})

    def _attention(self, k: Kernel, tensors: Mapping[str, TensorType], memory: Memory, order: list[str],
                   reads: list[np.ndarray]) -> Step:
        """The generated attention kernel, groups split across the pool.  16-bit q, k, v: torch's fused
        attention where torch multiplies the dtype natively (AMX: 0.22 ms against the generated kernel's 0.70
        for GPT-2's 12 heads of 128 tokens, bf16, one core here), else fp32 copies for the generated kernel
        and the result narrowed into its buffer (each a pass over a [groups, seq, head] tensor)."""
        body, out_name, addr = k.body, k.out, memory.addr
        groups, dtype = int(body.type.shape[0]), body.type.dtype
        facts = {"impl": "c-attention", "threads": min(self.threads, groups), "key_block": standalone.KEY_BLOCK}
        if self._torch_attention(k, tensors):
            attend, arrays, threads = standalone.torch_attention(body, dtype), memory.arrays, self.threads
            handed = out_name in memory.handed

            def call_torch() -> None:  # on the plan's torch threads (CpuCompiledPlan._pools)
                result = attend(*(arrays[n] for n in order))
                if handed:  # read by Merge steps only: as torch wrote it
                    memory.bind(out_name, gemm.tensor_bits(result))
                    return
                out = arrays[out_name]
                np.copyto(out.reshape(result.shape), gemm.tensor_bits(result))

            return Step(k, call_torch, reads, memory.own[out_name], {"impl": f"torch-sdpa-{dtype}", "threads": threads,
                                                                    "result": "handed" if handed else "copied"})
        if dtype == "fp32":
            layouts = standalone.attention_layouts(body, out_name, memory.layouts)
            source = standalone.source_of(body, {n: tuple(t.shape) for n, t in tensors.items()}, layouts)
            assert source is not None
            fn = self.compiler.function(source, len(order) + 1)
            if layouts:
                facts["in_place"] = ",".join(sorted(layouts))
            call = standalone.attention_call(fn, self.pool, self.threads, groups,
                                             lambda: [addr[n] for n in order] + [addr[out_name]])
            return Step(k, call, reads, memory.own[out_name], facts)
        source = standalone.source_of(body, {n: tuple(t.shape) for n, t in tensors.items()})
        assert source is not None
        fn = self.compiler.function(source, len(order) + 1)
        wide = {n: aligned_empty(memory.own[n].shape, np.float32) for n in dict.fromkeys(order)}
        result = aligned_empty(memory.own[out_name].shape, np.float32)
        widen = self.compiler.function(widen_source(dtype), 2)
        narrow = self.compiler.function(narrow_source(dtype), 2)
        run_kernel = standalone.attention_call(fn, self.pool, self.threads, groups,
                                               lambda: [wide[n].ctypes.data for n in order] + [result.ctypes.data])

        def call_widened() -> None:
            for n, w in wide.items():
                widen(addr[n], w.ctypes.data, 0, *rows_cols(w.shape))
            run_kernel()
            narrow(result.ctypes.data, addr[out_name], 0, *rows_cols(result.shape))

        scratch = result.nbytes + sum(w.nbytes for w in wide.values())
        return Step(k, call_widened, reads, memory.own[out_name], dict(facts, impl=f"c-attention-{dtype}-widened",
                                                                 scratch_bytes=scratch))

    def _channels(self, k: Kernel, tensors: Mapping[str, TensorType], memory: Memory, source: str,
                  reads: list[np.ndarray]) -> Step:
        """ChannelsLast / ChannelsFirst as the generated transpose of each image's (C, pixels) or (pixels, C)
        plane, its units split across the pool."""
        body, addr, out_name = k.body, memory.addr, k.out
        rows, cols = channels_plane(body, tensors)
        itemsize = memory.own[out_name].itemsize
        images = memory.own[out_name].size // (rows * cols)
        units = standalone.transpose_units(images, rows, itemsize)
        fn = self.compiler.function(standalone.transpose_source(rows, cols, itemsize), 2)
        call = standalone.rows_call(fn, self.pool, self.threads, units, lambda: [addr[source], addr[out_name]])
        return Step(k, call, reads, memory.own[out_name], {"impl": "c-transpose", "threads": min(self.threads, units)})

    def _pool(self, k: Kernel, memory: Memory, source: str, reads: list[np.ndarray]) -> Step:
        """The generated pooling of channels-last rows: max pooling by output rows (image by row), the spatial
        mean by images, split across the pool."""
        body, addr, out_name = k.body, memory.addr, k.out
        rows = math.prod(body.type.shape[:-1])  # images (the spatial mean), or images x output rows
        if body.op in ("MaxPool", "AvgPool"):
            rows //= window_out(body.attr_dict)[1]
        fn = self.compiler.function(standalone.pool_source(body), 2)
        impl = f"c-{body.op.lower()}"
        call = standalone.rows_call(fn, self.pool, self.threads, rows, lambda: [addr[source], addr[out_name]])
        return Step(k, call, reads, memory.own[out_name], {"impl": impl, "threads": min(self.threads, rows)})

    def _depthwise(self, k: Kernel, memory: Memory, order: list[str], reads: list[np.ndarray]) -> Step:
        """The generated depthwise convolution of channels-last rows, by output rows (image by row) split across
        the pool; of a 16-bit dtype torch multiplies natively, torch's (oneDNN's) convolution."""
        body, addr, out_name = k.body, memory.addr, k.out
        if self.native(body.type.dtype):
            return self._torch_depthwise(k, memory, order, reads)
        rows = math.prod(body.type.shape[:-1]) // window_out(body.attr_dict)[1]
        fn = self.compiler.function(standalone.depthwise_source(body), 3)
        x_name, w_name = order
        call = standalone.rows_call(fn, self.pool, self.threads, rows,
                                    lambda: [addr[x_name], addr[w_name], addr[out_name]])
        return Step(k, call, reads, memory.own[out_name], {"impl": "c-depthwise", "threads": min(self.threads, rows)})

    def _torch_depthwise(self, k: Kernel, memory: Memory, order: list[str], reads: list[np.ndarray]) -> Step:
        """A 16-bit depthwise convolution as torch's, its result handed to the readers as torch wrote it (copied
        into a plan output)."""
        conv = gemm.torch_depthwise(k.body.type.dtype, k.body.attr_dict)
        arrays, out_name, (x_name, w_name) = memory.arrays, k.out, order
        is_output = out_name in memory.outputs

        def call_depthwise() -> None:  # on the plan's torch threads (CpuCompiledPlan._pools)
            memory.hand_over(out_name, gemm.tensor_bits(conv(arrays[x_name], arrays[w_name])), is_output)

        return Step(k, call_depthwise, reads, memory.own[out_name],
                    {"impl": f"torch-{k.body.type.dtype}-depthwise", "threads": self.threads})

    def _generated_attention(self, k: Kernel, tensors: Mapping[str, TensorType]) -> bool:
        """Is kernel ``k`` an attention the generated kernel computes on its operands as stored (fp32), which it
        reads, and writes, in any :class:`standalone.GroupLayout`?"""
        return (self._attention_over_loads(k, tensors) and k.body.type.dtype == "fp32"
                and not self._torch_attention(k, tensors))

    def _torch_attention(self, k: Kernel, tensors: Mapping[str, TensorType]) -> bool:
        """Is kernel ``k`` an attention that torch's fused kernel computes: 16-bit, natively multiplied, or fp32
        where torch's measured faster on its shapes (``standalone.measured_attention``)?"""
        if not self._attention_over_loads(k, tensors):
            return False
        dtype = k.body.type.dtype
        if dtype != "fp32":
            return self.native(dtype)
        return "torch" in sys.modules and self._fp32_attention(k.body, tensors) == "torch"

    @staticmethod
    def _attention_over_loads(k: Kernel, tensors: Mapping[str, TensorType]) -> bool:
        body = k.body
        return (k.kind == KernelKind.STANDALONE and body.op in standalone.ATTENTION_OPS
                and all(isinstance(a, Load) and tensors[a.tensor].dtype == body.type.dtype for a in body.args))

    def _fp32_attention(self, body: Expr, tensors: Mapping[str, TensorType]) -> str:
        """``generated`` or ``torch`` for fp32 attention ``body``, decided once per shape for this backend."""
        shapes = {a.tensor: tuple(tensors[a.tensor].shape) for a in body.args if isinstance(a, Load)}
        key = (body.op, int(body.attr_dict.get("causal", 0)), *shapes.values())
        if key not in self._attention_kernels:
            try:
                source = standalone.source_of(body, shapes) or ""
            except CodegenError:  # no generated kernel (a non-positive scale): the step says why, as without torch
                return "generated"
            self._attention_kernels[key] = standalone.measured_attention(
                body, shapes, self.threads, functools.partial(self._time_attention, body, shapes, source),
                code=self.compiler.target or ())
        return self._attention_kernels[key]

    def _time_attention(self, body: Expr, shapes: Mapping[str, tuple[int, ...]], source: str) -> dict[str, float]:
        """Seconds per call of the generated kernel (``source``: on contiguous operands) and torch's on random
        operands of ``shapes``, on this backend's threads, interleaved (``gemm.fastest_of``)."""
        order = [a.tensor for a in body.args if isinstance(a, Load)]
        rng = np.random.default_rng(0)
        arrays = [rng.standard_normal(shapes[n], dtype=np.float32) for n in order]
        out = aligned_empty(tuple(body.type.shape), np.float32)
        fn = self.compiler.function(source, len(order) + 1)
        generated = standalone.attention_call(fn, self.pool, self.threads, int(body.type.shape[0]),
                                              lambda: [a.ctypes.data for a in arrays] + [out.ctypes.data])
        attend = standalone.torch_attention(body, "fp32")
        with parallel.torch_threads(self.threads):
            return gemm.fastest_of({"generated": generated, "torch": lambda: attend(*arrays)}, rounds=3)

    @staticmethod
    def _heads_view(k: Kernel, memory: Memory, source: str, reads: list[np.ndarray]) -> Step:
        """A Heads kernel only torch's attention reads: its result bound as a strided view of its source."""
        view, arrays, out_name = standalone.heads_view(k.body), memory.arrays, k.out
        last: list[np.ndarray] = []  # the source array and its view, kept while the source is the same array

        def call_view() -> None:
            x = arrays[source]
            if not last or last[0] is not x:
                last[:] = [x, view(x)]
            memory.bind(out_name, last[1])

        return Step(k, call_view, reads, memory.own[out_name], {"impl": "strided-view"})

    def _gather(self, k: Kernel, memory: Memory, order: list[str], reads: list[np.ndarray]) -> Step:
        """Embedding as a generated copy of each id's row (the ids split across the pool), or numpy's take where
        the ids are not stored as fp32; an id that names no row raises the op's error."""
        (ids, table), arrays, out_name = order, memory.arrays, k.out
        n_rows, width = memory.own[table].shape
        if memory.own[ids].dtype != np.float32:

            def call_take() -> None:
                standalone.gather_rows(arrays[ids], arrays[table], arrays[out_name])

            return Step(k, call_take, reads, memory.own[out_name], {"impl": "numpy-take"})
        fn = self.compiler.function(standalone.gather_source(n_rows, width * memory.own[table].itemsize), 4)
        bad = np.full(1, -1, np.int64)
        bad_ptr, addr = bad.ctypes.data, memory.addr
        run = standalone.rows_call(fn, self.pool, self.threads, memory.own[ids].size,
                                   lambda: [addr[ids], addr[table], bad_ptr, addr[out_name]])

        def call_gather() -> None:
            run()
            if bad[0] >= 0:
                bad[0] = -1
                standalone.gather_rows(arrays[ids], arrays[table], arrays[out_name])  # raises the op's error

        return Step(k, call_gather, reads, memory.own[out_name], {"impl": "c-gather"})

    @staticmethod
    def _source_view(k: Kernel, memory: Memory, source: str, reads: list[np.ndarray]) -> Step:
        """A GroupRepeat only generated attention kernels read: bound to its source, which they read in place
        (``memory.layouts``)."""
        arrays, out_name = memory.arrays, k.out

        def call_view() -> None:
            memory.bind(out_name, arrays[source], memory.addr[source])

        return Step(k, call_view, reads, memory.own[out_name], {"impl": "read in place"})

    @staticmethod
    def _merged_rows(k: Kernel, memory: Memory, source: str, reads: list[np.ndarray]) -> Step:
        """A Merge of a generated attention result written as its token rows (``memory.layouts``): bound to that
        buffer, or copied into it where it is a plan output."""
        out_name, shape = k.out, memory.own[k.out].shape
        rows = memory.own[source].reshape(shape)  # the attention writes its own buffer, always
        if out_name not in memory.outputs:
            return Step(k, functools.partial(memory.bind, out_name, rows, rows.ctypes.data), reads,
                        memory.own[out_name], {"impl": "written merged"})
        arrays = memory.arrays

        def call_copy() -> None:
            np.copyto(arrays[out_name], rows)

        return Step(k, call_copy, reads, memory.own[out_name], {"impl": "written merged, copied out"})

    @staticmethod
    def _merge_handed(k: Kernel, memory: Memory, source: str, reads: list[np.ndarray]) -> Step:
        """A Merge of torch's attention result (batch, heads, seq, e): where torch wrote it in (batch, seq, heads,
        e) order (given strided operands) and it is not a plan output, its token rows are a view of it; else
        copied into the output."""
        arrays, out_name, shape = memory.arrays, k.out, memory.own[k.out].shape
        is_output = out_name in memory.outputs

        def call_merge() -> None:
            rows = standalone.merged_rows(arrays[source])
            if not is_output and rows.flags.c_contiguous:
                memory.bind(out_name, rows.reshape(shape))
                return
            if not is_output:
                memory.restore(out_name)
            np.copyto(arrays[out_name].reshape(rows.shape), rows)

        return Step(k, call_merge, reads, memory.own[out_name], {"impl": "view-or-copy"})

    def _opaque(self, k: Kernel, tensors: Mapping[str, TensorType], memory: Memory) -> Step:
        own, arrays = memory.own, memory.arrays
        out_name = k.out
        reads = [own[n] for n in dict.fromkeys(k.reads)]
        direct = _direct_opaque(k, tensors)
        if direct is not None:  # fp32 in and out: the implementation reads the bound arrays and writes out
            write, order = direct

            def call() -> None:
                write([arrays[n] for n in order], arrays[out_name])

            return Step(k, call, reads, own[k.out], {"impl": "opaque-in-place"})
        return self._converted(k, tensors, memory)

    def _converted(self, k: Kernel, tensors: Mapping[str, TensorType], memory: Memory) -> Step:
        """A kernel computed by the reference's numpy form: its loads widened from storage, the result stored."""
        names = list(dict.fromkeys(k.reads))
        own, arrays = memory.own, memory.arrays
        out_name, dtype = k.out, k.body.type.dtype
        reads = [own[n] for n in names]

        def call_converted() -> None:
            mem = {n: from_storage(arrays[n], tensors[n].dtype) for n in names}
            value = eval_expr(k.body, mem, np.float32, {})
            out = arrays[out_name]
            if value.shape != out.shape:
                raise BackendError(f"{k.describe()} computed shape {list(value.shape)}, expected {list(out.shape)}")
            to_storage(value, dtype, out)

        return Step(k, call_converted, reads, own[k.out], {"impl": "numpy-reference"})


def _direct_opaque(k: Kernel, tensors: Mapping[str, TensorType]) -> tuple[Callable[..., None], list[str]] | None:
    """(writer, loaded tensors in argument order) for a kernel that is one Opaque node over loads with every
    tensor in fp32, whose implementation can write into a buffer; else None (the converting route)."""
    body = k.body
    if body.op != "Opaque" or not all(isinstance(a, Load) for a in body.args):
        return None
    order = [a.tensor for a in body.args]  # type: ignore[union-attr]
    if body.type.dtype != "fp32" or any(tensors[n].dtype != "fp32" for n in order):
        return None
    return opaque_writer(body.attr_dict), order


def _gemm_block(mm: gemm.MatMul, epilogue: Callable[[int, int, int], None], tile: np.ndarray,
                widen_a: Callable[[int, int], np.ndarray], b32: np.ndarray, bounds: list[tuple[int, int]]) -> None:
    """One block of a GEMM's rows: the GEMM library computes each tile of rows, the generated epilogue
    (``epilogue(r0, r1, cols)``) stores it."""
    cols = tile.shape[1]
    for r0, r1 in bounds:
        mm(widen_a(r0, r1), b32, tile[: r1 - r0])
        epilogue(r0, r1, cols)


def conv_post_ops(body: Expr, mm: Expr) -> tuple[str | None, str | None, gemm.UnaryPostOp] | None:
    """(bias, residual, unary) when a convolution kernel's body is oneDNN's post-ops over the product:
    ``[activation](([BiasAdd(mm, bias)]) [+ residual])``, each operand loaded, the activation one of
    ``gemm.CONV_UNARY`` (after a residual: ``gemm.CONV_BINARY_UNARY``); else None."""
    return post_ops(body, mm, gemm.CONV_UNARY)


def post_ops(body: Expr, mm: Expr, activations: Mapping[str, Callable[[Mapping[str, Any]], gemm.UnaryPostOp | None]]
             ) -> tuple[str | None, str | None, gemm.UnaryPostOp] | None:
    """(bias, residual, unary) when ``body`` is ``[activation](([BiasAdd(mm, bias)]) [+ residual])`` over the
    product ``mm``, each operand loaded, the activation one of ``activations`` (after a residual: one of
    ``gemm.CONV_BINARY_UNARY``); else None."""
    unary = gemm.NO_POST_OP
    if body.op in activations and body is not mm:
        found = activations[body.op](body.attr_dict)
        if found is None:
            return None
        unary, body = found, body.args[0]  # type: ignore[assignment]
    other = None
    if body.op == "Add" and body is not mm:
        if unary.name not in gemm.CONV_BINARY_UNARY:
            return None
        inner = [a for a in body.args if isinstance(a, Expr)]
        loaded = [a for a in body.args if isinstance(a, Load)]
        if len(inner) != 1 or len(loaded) != 1 or tuple(inner[0].type.shape) != tuple(body.type.shape):
            return None
        other, body = loaded[0].tensor, inner[0]
    bias = None
    if body.op == "BiasAdd" and body is not mm and isinstance(body.args[1], Load):
        bias, body = body.args[1].tensor, body.args[0]  # type: ignore[assignment]
    return (bias, other, unary) if body is mm else None


def _split_epilogue(pool: parallel.WorkerPool, threads: int, fn: Callable[..., None], ptrs: list[int | None],
                    tile_ptr: int, out: int, cols: int, itemsize: int) -> Callable[[int, int, int], None]:
    """A tile's epilogue with its rows split across the pool (the tile pointer offset to each part's rows)."""
    row_bytes = cols * itemsize

    def run(r0: int, r1: int, cols: int) -> None:
        parts = parallel.split(r1 - r0, parallel.loop_parts(threads, (r1 - r0) * cols))
        pool.run_kernel(fn, len(ptrs) + 1, [[*[tile_ptr + s * row_bytes if p is None else p for p in ptrs],
                                             out, r0 + s, r0 + e, cols] for s, e in parts])

    return run


