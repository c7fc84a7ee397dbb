"""A test backend that really times the numpy reference executor (no other branch needed)."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping

import numpy as np

from planner.backend import Backend, CompiledPlan, Timing
from planner.core.plans import Kernel, Plan
from planner.core.reference import execute_plan


class TimedReference(CompiledPlan):
    def run(self, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        return execute_plan(self.plan, inputs, "device")

    def time(
        self,
        inputs: Mapping[str, np.ndarray],
        *,
        warmup: int = 2,
        repeats: int = 7,
        stop_if: Callable[[float], bool] | None = None,
    ) -> Timing:
        for _ in range(warmup):
            self.run(inputs)
        samples: list[float] = []
        for _ in range(repeats):
            t = time.perf_counter()
            self.run(inputs)
            samples.append((time.perf_counter() - t) * 1e6)
            if stop_if is not None and stop_if(float(np.median(samples))):
                return Timing(samples, warmup, stopped_early=True)
        return Timing(samples, warmup)


class TimedReferenceBackend(Backend):
    name = "timed-reference"

    def compile(self, plan: Plan) -> CompiledPlan:
        return TimedReference(plan, kernel_facts=[{"kernel": i} for i in range(len(plan.kernels))])


class CorruptingBackend(TimedReferenceBackend):
    """Breaks one chosen candidate: ``mode`` 'wrong' perturbs its output, 'nan' poisons it,
    'crash' raises in run."""

    name = "corrupting"

    def __init__(self, spec, victim: Callable[[Plan], bool], mode: str = "wrong") -> None:
        super().__init__(spec)
        self.victim = victim
        self.mode = mode
        self.victims: list[str] = []

    def compile(self, plan: Plan) -> CompiledPlan:
        if not self.victim(plan):
            return super().compile(plan)
        self.victims.append(plan.key)
        mode = self.mode

        class Broken(TimedReference):
            def run(self, inputs):
                if mode == "crash":
                    raise ZeroDivisionError("injected crash")
                outs = super().run(inputs)
                bad = outs[0].copy()
                bad.flat[0] = np.nan if mode == "nan" else bad.flat[0] + 1.0
                return [bad, *outs[1:]]

        return Broken(plan)


class EstimateTimed(TimedReference):
    """Deterministic 'timing': every sample is the cost-model estimate."""

    def time(self, inputs, *, warmup=2, repeats=7, stop_if=None) -> Timing:  # type: ignore[no-untyped-def]
        samples: list[float] = []
        for _ in range(repeats):
            samples.append(self.plan.est_us)
            if stop_if is not None and stop_if(float(np.median(samples))):
                return Timing(samples, warmup, stopped_early=True)
        return Timing(samples, warmup)


class EstimateBackend(Backend):
    name = "estimate"

    def compile(self, plan: Plan) -> CompiledPlan:
        return EstimateTimed(plan)


class KernelEstimateTimed(EstimateTimed):
    """Like EstimateTimed, and each kernel's 'time' its own estimate, as a backend that times kernels reports."""

    def time(self, inputs, *, warmup=2, repeats=7, stop_if=None) -> Timing:  # type: ignore[no-untyped-def]
        timing = super().time(inputs, warmup=warmup, repeats=repeats, stop_if=stop_if)
        timing.kernel_min_us = [k.cost.est_us for k in self.plan.kernels]
        return timing


class KernelEstimateBackend(Backend):
    """Deterministic plan and kernel times (the cost model's estimates); counts the plans it compiles."""

    name = "kernel-estimate"

    def __init__(self, spec) -> None:  # type: ignore[no-untyped-def]
        super().__init__(spec)
        self.compiled: list[str] = []

    def compile(self, plan: Plan) -> CompiledPlan:
        self.compiled.append(plan.key)
        return KernelEstimateTimed(plan)


class VerifyOnlyBackend(Backend):
    """Like the reference backend: runs plans, cannot time them."""

    name = "verify-only"
    measures = False

    def compile(self, plan: Plan) -> CompiledPlan:
        class Untimed(CompiledPlan):
            def run(self, inputs):
                return execute_plan(self.plan, inputs, "device")

        return Untimed(plan)


class NoisyTimed(TimedReference):
    """Timings of a shared machine: each run takes the plan's true time (``truth``) times lognormal noise, and
    now and then a spike (another process took the core)."""

    def __init__(self, plan: Plan, truth_us: float, rng: random.Random, sigma: float, spikes: float,
                 kernel_us: Callable[[Kernel], float] | None = None) -> None:
        super().__init__(plan)
        self.truth_us, self.rng, self.sigma, self.spikes = truth_us, rng, sigma, spikes
        self.kernel_us = kernel_us

    def sample(self) -> float:
        spike = self.rng.uniform(1.5, 3.0) if self.rng.random() < self.spikes else 1.0
        return self.truth_us * math.exp(self.rng.gauss(0.0, self.sigma)) * spike

    def time(self, inputs, *, warmup=2, repeats=7, stop_if=None) -> Timing:  # type: ignore[no-untyped-def]
        samples: list[float] = []
        stopped = False
        for _ in range(repeats):
            samples.append(self.sample())
            if stop_if is not None and stop_if(float(np.median(samples))):
                stopped = True
                break
        timing = Timing(samples, warmup, stopped_early=stopped)
        if self.kernel_us is not None:  # as the CPU backend reports each kernel's fastest run, stopped early too
            timing.kernel_min_us = [self.kernel_us(k) for k in self.plan.kernels]
        return timing


class NoisyBackend(Backend):
    """Runs plans with the reference executor and 'times' them as :class:`NoisyTimed`, seeded: ``truth`` gives
    each plan's true time (µs)."""

    name = "noisy"

    def __init__(self, spec, truth: Callable[[Plan], float], *, seed: int = 0, sigma: float = 0.1,  # type: ignore[no-untyped-def]
                 spikes: float = 0.05, kernel_us: Callable[[Kernel], float] | None = None) -> None:
        super().__init__(spec)
        self.truth, self.sigma, self.spikes, self.kernel_us = truth, sigma, spikes, kernel_us
        self.rng = random.Random(seed)

    def compile(self, plan: Plan) -> CompiledPlan:
        return NoisyTimed(plan, self.truth(plan), self.rng, self.sigma, self.spikes, self.kernel_us)
