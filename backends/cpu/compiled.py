"""A plan the CPU backend compiled: its buffers, its steps, and running and timing them on the worker pools."""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from backends.cpu import gemm, parallel
from backends.cpu.buffers import (
    aligned_empty,
)
from backends.cpu.codegen import rows_cols, widen_source
from backends.cpu.memory import (
    BLAS_IMPLS,
    Memory,
    Step,
    bindable,
    from_storage,
    gemm_b_only,
    limit_blas_threads,
    to_storage,
)
from backends.cpu.steps import StepsBase
from planner.backend import (
    BackendError,
    CompiledPlan,
    Timing,
    collect_samples,
)
from planner.core.dtypes import numpy_dtype
from planner.core.kinds import KernelKind
from planner.core.opaque import torch_backed
from planner.core.plans import Plan

log = logging.getLogger(__name__)
#: the pools of a plan that needs no thread setting (reused: no context object a call)
_NOTHING = contextlib.nullcontext()


class CpuCompiledPlan(CompiledPlan):
    def __init__(
        self,
        plan: Plan,
        steps: list[Step],
        memory: Memory,
        inputs: list[str],
        compile_s: float,
        backend: StepsBase,
        padded: frozenset[str] = frozenset(),
    ):
        super().__init__(plan, [dict(s.facts, bytes_moved=s.bytes_moved) for s in steps], compile_s)
        self.steps = steps
        self.memory = memory
        self.buffers = memory.own
        self.input_names = inputs
        #: weights stored with padded rows: a read-only array bound to one (a parameter) is read from the
        #: backend's padded copy of it, made once for every plan the backend compiles
        self.padded = padded
        self.held = backend.held
        self._transposed_ok = gemm_b_only(plan, frozenset({"fp32", *(d for d in gemm.DTYPES_16BIT if backend.native(d))}))
        self.threads = backend.threads
        self.blas_threads = backend.blas_threads
        self.controller = backend.controller
        # torch's pool at the plan's thread count for the whole run (one switch, not one per kernel) where any
        # kernel calls torch: an Opaque one, or a product, attention or batched product of torch's (Winograd's too)
        self.uses_torch = any(s.kernel.kind == KernelKind.OPAQUE or str(s.facts.get("impl", "")).startswith(("torch", "onednn", "winograd"))
                              for s in steps)
        # numpy's BLAS runs in numpy's GEMMs and batched products, in the reference's numpy form of a kernel and
        # in numpy Opaque implementations; generated loops, torch's products and torch-backed Opaque calls never
        # call it, and threadpoolctl's limit costs 15 µs a call, 50-70 with cold caches after a plan's kernels (it
        # walks the loaded libraries)
        self.uses_blas = any((s.kernel.kind == KernelKind.OPAQUE and not all(
                                 torch_backed(e) for e in s.kernel.body.walk() if e.op == "Opaque"))
                             or str(s.facts.get("impl", "")).startswith(BLAS_IMPLS) for s in steps)
        written = {k.out for k in plan.kernels}
        self._fresh_outputs = [o for o in dict.fromkeys(plan.outputs) if o in written and plan.tensors[o].dtype == "fp32"]
        self._fresh_stored = [o for o in dict.fromkeys(plan.outputs) if o in written]  # 16-bit ones too (run_stored)
        #: every output is a fresh array of its own, known before the kernels run (``run_handed``)
        self._outputs_known = len(self._fresh_stored) == len(plan.outputs)
        # 16-bit outputs are handed out widened to fp32 by a generated loop (ml_dtypes' conversion is ~10x slower)
        self._widen_out = {d: backend.compiler.function(widen_source(d), 2)
                           for d in {plan.tensors[o].dtype for o in plan.outputs} if d != "fp32"}
        #: per input, the array of the last call that needs nothing on the next: read in place, or read-only
        #: and already copied (a writable array that was copied may have changed, so it is copied again)
        self._kept: dict[str, Any] = {}
        self.loads = 0  # inputs copied into buffers so far (tests count them)
        self.packs = 0  # weights packed by oneDNN for this plan's calls (tests count them)
        self.binds = 0  # inputs the kernels read in place, without a copy
        #: the output array each output got last, the array owning its memory, and its address
        self._handed_out: dict[str, tuple[np.ndarray, np.ndarray, int]] = {}
        self.reused = 0  # output arrays reused because their caller had dropped them

    def _load_inputs(self, inputs: Mapping[str, np.ndarray]) -> None:
        kept = self._kept
        for name in self.input_names:
            if name not in inputs:
                raise BackendError(f"missing input {name!r}")
            given = inputs[name]
            if kept.get(name) is given:  # the array of the last call, read in place or held unchanged: as it was
                self.binds += 1
                continue
            kept.pop(name, None)
            arr = self._load(name, given)
            if name in self.memory.packable:
                self._pack(name, arr)

    def _load(self, name: str, given: Any) -> np.ndarray:
        """Bind input ``name`` to ``given`` (read in place, or its held copy) or copy it into its buffer."""
        kept = self._kept
        ttype = self.plan.tensors[name]
        arr = np.asarray(given)
        if tuple(arr.shape) != tuple(ttype.shape):
            raise BackendError(f"input {name!r} has shape {list(arr.shape)}, expected {list(ttype.shape)}")
        own = self.memory.own[name]
        # a 16-bit array of the tensor's own dtype: its bits are the storage
        bits = arr.view(np.uint16) if own.dtype == np.uint16 and arr.dtype == numpy_dtype(ttype.dtype) else None
        stored = arr if bits is None else bits
        if name in self.padded and not arr.flags.writeable:  # a parameter: multiplied from its padded copy
            copy, made = self.held.padded(arr)
            self.memory.bind(name, copy)
            self.loads += made
            kept[name] = given
            return arr
        if bindable(stored, own, name in self._transposed_ok):  # read in place
            self.memory.bind(name, stored)
            self.binds += 1
            kept[name] = given
            return arr
        self.memory.restore(name)
        if bits is None:
            to_storage(arr, ttype.dtype, own)
        else:
            np.copyto(own, bits)
        self.loads += 1
        if not arr.flags.writeable:  # read-only (a bound parameter): its copy stays valid
            kept[name] = given
        return arr

    def _pack(self, name: str, arr: np.ndarray) -> None:
        """A read-only weight of a packed dtype (a bound parameter) is multiplied from oneDNN's packed form of it,
        made once for every plan of the backend; a writable one may change before the next call and is read as
        bound."""
        packed = self.memory.packed
        if arr.flags.writeable:
            packed.pop(name, None)
            return
        stored, dtype = self.memory.arrays[name], self.plan.tensors[name].dtype
        packed[name], made = self.held.form(arr, f"packed-{dtype}", lambda: gemm.pack_weight(stored, dtype))
        self.packs += made

    def _output_array(self, name: str) -> np.ndarray:
        """An array for output ``name`` no one else can see: the one handed out last time if the caller has
        dropped every reference to it (and to every view of it), else a new one.  Reusing it spares
        the page faults of fresh memory, as torch's caching allocator does.  Each starts on a cache-line
        boundary, as the plan's own buffers do: a kernel's (streaming) stores to an output numpy placed 16 bytes
        off one ran the same plan 1.1-1.9x slower, depending on where each call's array fell."""
        spare = self._spare(name)
        if spare is not None:
            self.reused += 1
            return spare
        fresh = aligned_empty(self.memory.own[name].shape, self.memory.own[name].dtype)
        base = fresh.base
        assert isinstance(base, np.ndarray) and base.base is None  # numpy points every view at the memory's owner
        self._handed_out[name] = (fresh, base, fresh.ctypes.data)
        return fresh

    def _spare(self, name: str) -> np.ndarray | None:
        """The array last handed out for output ``name`` if the caller has dropped every reference to it."""
        spare = self._handed_out.get(name)
        if spare is None:
            return None
        arr, owner, _ = spare
        # arr: the dict's tuple, ``arr`` and getrefcount's argument; a torch tensor of it adds one. A numpy
        # view of arr refers to the owner of its memory, ``owner``: arr's base, the tuple, ``owner`` and the
        # argument, and one more for each view
        return arr if sys.getrefcount(arr) <= 3 and sys.getrefcount(owner) <= 4 else None

    def _widened(self, stored: np.ndarray, dtype: str) -> np.ndarray:
        """A fresh fp32 array of a stored output's values."""
        if stored.dtype == np.float32 or not stored.flags.c_contiguous:  # fp32 already, or a strided input
            return np.array(from_storage(stored, dtype))
        out = aligned_empty(stored.shape, np.float32)
        self._widen_out[dtype](stored.ctypes.data, out.ctypes.data, 0, *rows_cols(stored.shape))
        return out

    def _own_outputs(self) -> None:
        for name in self._fresh_stored:
            self.memory.restore(name)

    def _execute(self) -> None:
        for s in self.steps:
            s.call()

    def execute(self) -> None:
        """Run the kernels once on the inputs bound by the last ``run`` or ``time``: the plan's bare kernel time,
        without binding inputs or handing outputs out.  An output goes where the last call handed it out if the
        caller has dropped it (so the bare kernels and the calls write the same memory), else into the plan's own
        buffer."""
        self._own_outputs()  # the arrays an early hand-out left bound
        for name in self._fresh_stored:
            spare = self._spare(name)
            if spare is None:
                self.memory.restore(name)
            else:
                self.memory.bind(name, spare, self._handed_out[name][2])
        try:
            with self._pools():
                self._execute()
        finally:
            self._own_outputs()

    def _pools(self) -> contextlib.AbstractContextManager[Any]:
        """BLAS at its pinned count and torch's pool at the plan's thread count while the plan runs."""
        if not (self.uses_blas or self.uses_torch):
            return _NOTHING
        stack = contextlib.ExitStack()
        if self.uses_blas:
            stack.enter_context(limit_blas_threads(self.blas_threads, self.controller))
        if self.uses_torch:
            stack.enter_context(parallel.torch_threads(self.threads))
        return stack

    def run(self, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Execute once.  fp32 outputs are fresh arrays the last kernel wrote (never shared with another
        call), 16-bit ones fresh fp32 arrays widened from them; inputs stored as the kernels read them are read
        in place, never written."""
        return self._run(inputs, self._fresh_outputs, widen=True)

    def run_stored(self, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Execute once; every output a fresh array the last kernel wrote as it is stored (fp32, or a 16-bit
        dtype's bits as ``uint16``): no widening pass, for a caller that hands out 16-bit tensors."""
        return self._run(inputs, self._fresh_stored, widen=False)

    def run_handed(self, inputs: Mapping[str, np.ndarray], hand_out: Callable[[list[np.ndarray]], Any],
                   early: bool = False) -> Any:
        """:meth:`run_stored`, ``hand_out`` given the outputs; ``early`` where every output is a fresh array of its
        own: before the kernels run, and the plan's memory lets go of the arrays at the start of the next run (a
        torch face's ``from_numpy`` cost 20-40 µs just after the kernels evicted the caches, 10-15 before)."""
        if not (early and self._outputs_known):
            return hand_out(self.run_stored(inputs))
        self._own_outputs()
        self._load_inputs(inputs)
        arrays = []
        for name in self.plan.outputs:
            arrays.append(self._output_array(name))
            self.memory.bind(name, arrays[-1], self._handed_out[name][2])
        handed = hand_out(arrays)
        if self.uses_blas or self.uses_torch:
            with self._pools():
                self._execute()
        else:  # no pool to set: no context manager's two calls just after the last call's kernels
            self._execute()
        return handed

    def _run(self, inputs: Mapping[str, np.ndarray], fresh_names: list[str], widen: bool) -> list[np.ndarray]:
        self._own_outputs()  # the arrays an early hand-out left bound
        self._load_inputs(inputs)
        fresh = {}
        for name in fresh_names:
            fresh[name] = self._output_array(name)
            self.memory.bind(name, fresh[name], self._handed_out[name][2])
        try:
            with self._pools():
                self._execute()
        finally:
            self._own_outputs()  # the memory keeps no reference to what is handed out
        outs: list[np.ndarray] = []
        for o in self.plan.outputs:
            arr = fresh.pop(o, None)  # each fresh array handed out once; a repeated output gets a copy
            if arr is None:
                written = next((a for name, a in zip(self.plan.outputs, outs, strict=False) if name == o),
                               self.memory.arrays[o])
                arr = self._widened(written, self.plan.tensors[o].dtype) if widen else np.array(written)
            outs.append(arr)
        return outs

    def time(
        self,
        inputs: Mapping[str, np.ndarray],
        *,
        warmup: int = 2,
        repeats: int = 7,
        stop_if: Callable[[float], bool] | None = None,
    ) -> Timing:
        self._load_inputs(inputs)
        self._own_outputs()
        steps = self.steps
        fastest = [math.inf] * len(steps)  # ns, each step's fastest run in place (two clock reads a step)

        def measure_us() -> float:
            t0 = last = time.perf_counter_ns()
            for i, s in enumerate(steps):
                s.call()
                now = time.perf_counter_ns()
                fastest[i] = min(fastest[i], now - last)
                last = now
            return (last - t0) / 1e3

        with self._pools():
            timing = collect_samples(measure_us, warmup=warmup, repeats=repeats, stop_if=stop_if)
        timing.kernel_min_us = [ns / 1e3 for ns in fastest]
        return timing
