"""``CupyBackend``: the search's view of the GPU executor (``backends.cupy:CupyBackend``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.cupy.bundle import BundleKernel, Candidate, cublas_call
from backends.cupy.codegen import CodegenError, generate
from planner.backend import (
    Backend,
    BackendError,
    BackendUnavailable,
    CompiledPlan,
    Timing,
    collect_samples,
)
from planner.core.kinds import KernelKind
from planner.core.plans import Plan


def plan_candidate(plan: Plan) -> Candidate:
    """A plan with each kernel's GPU form (generated CUDA or cuBLASLt call)."""
    kernels = []
    for k in plan.kernels:
        if k.kind == KernelKind.CUBLASLT:
            kernels.append(BundleKernel(k, None, cublas_call(k, plan.tensors)))
            continue
        try:
            kernels.append(BundleKernel(k, generate(k, plan.tensors), None))
        except CodegenError as exc:
            raise BackendError(str(exc)) from None
    return Candidate(plan, tuple(kernels), plan.est_us)


@dataclass
class CupyCompiledPlan(CompiledPlan):
    prepared: Any = None

    def _load(self, inputs: Mapping[str, np.ndarray]) -> None:
        from backends.cupy.gpu import to_device

        # on the plan's own (non-blocking) stream, so the copies are ordered before its kernels; on the
        # legacy default stream nothing ordered them (issue 15, finding 5)
        with self.prepared.stream:
            for name, buf in self.prepared.bufs.items():
                if name in inputs:
                    buf[...] = to_device(inputs[name], self.plan.tensors[name].dtype)

    def run(self, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        self._load(inputs)
        return self.prepared.run()

    def time(
        self,
        inputs: Mapping[str, np.ndarray],
        *,
        warmup: int = 2,
        repeats: int = 7,
        stop_if: Callable[[float], bool] | None = None,
    ) -> Timing:
        self._load(inputs)
        return collect_samples(lambda: self.prepared.time(0, 1)[0], warmup=warmup, repeats=repeats, stop_if=stop_if)


class CupyBackend(Backend):
    name = "cupy"
    measures = True

    def __init__(self, spec: Any) -> None:
        super().__init__(spec)
        self._executor: Any = None

    def executor(self) -> Any:
        if self._executor is None:
            try:
                from backends.cupy.gpu import CupyExecutor

                self._executor = CupyExecutor()
            except ImportError as exc:
                raise BackendUnavailable(f"the cupy backend needs cupy and a CUDA device: {exc}") from None
            except BackendUnavailable:
                raise
            except Exception as exc:  # cupy present but no usable device/driver
                raise BackendUnavailable(f"the cupy backend found no usable CUDA device: {exc}") from None
        return self._executor

    def compile(self, plan: Plan) -> CompiledPlan:
        ex = self.executor()
        t0 = time.perf_counter()
        cand = plan_candidate(plan)
        names = sorted({r for k in plan.kernels for r in k.reads} - {k.out for k in plan.kernels})
        zeros = {n: np.zeros(plan.tensors[n].shape, np.float32) for n in names}
        try:
            prepared = ex.prepare(cand, zeros)
        except Exception as exc:
            raise BackendError(f"cupy backend could not prepare {plan.notation()}: {exc}") from exc
        return CupyCompiledPlan(plan, list(prepared.kernel_facts), time.perf_counter() - t0, prepared)
