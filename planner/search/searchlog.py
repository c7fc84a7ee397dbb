"""SEARCH_LOG: one line per search event, on stderr when enabled.

Enabled by ``SEARCH_LOG=1`` in the environment or ``--search-log``; with
``SEARCH_OP_NAMES=1`` every plan also shows its kernel composition.  The lines
are always kept in :attr:`SearchLog.lines` (and so in ``SearchResult.log_lines``)
whether or not they are printed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from planner.core.plans import Plan
from planner.core.report import Count, count_text

_TRUE = ("1", "true", "yes", "on")


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def fmt_us(us: float) -> str:
    return f"{us:,.2f}µs" if us < 1e5 else f"{us / 1e3:,.1f}ms"


def fmt_duration(s: float) -> str:
    return f"{s:.2f}s" if s < 120 else f"{int(s // 60)}m{s % 60:04.1f}s"


def _origin(origin: str) -> str:
    return f" | {origin}" if origin else ""


class SearchLog:
    """Formats search events; prints them when enabled."""

    def __init__(
        self,
        enabled: bool | None = None,
        op_names: bool | None = None,
        write: Callable[[str], None] | None = None,
    ) -> None:
        self.enabled = env_flag("SEARCH_LOG") if enabled is None else enabled
        self.op_names = env_flag("SEARCH_OP_NAMES") if op_names is None else op_names
        self.write = write or (lambda line: print(line, file=sys.stderr, flush=True))
        self.lines: list[str] = []
        #: the backend's figures are the cost model's estimates (``model``): no line says "meas" or "re-measurement"
        self.estimated = False

    def emit(self, line: str) -> None:
        self.lines.append(line)
        if self.enabled:
            self.write(line)

    def label(self, plan: Plan) -> str:
        text = plan.notation()
        if self.op_names:
            text += f" [Kernels: {plan.composition()}]"
        return text

    # -- events
    def header(self, graph: str, space: Count, enumerated: bool, backend: str, device: str, measures: bool = True) -> None:
        self.estimated = not measures
        scope = "enumerated" if enumerated else "sampled"
        self.emit(f"Search {graph} | space {count_text(space)} plans ({scope}) | backend {backend} | device {device}")

    # ``origin`` names where a candidate came from when it is not the cost-model list
    # (e.g. "mutant: swap-impl mm: ..." or "sample"); it ends the line
    def start(self, plan: Plan, est_us: float, meas_us: float, origin: str = "") -> None:
        self.emit(f"Start {self.label(plan)} | est {fmt_us(est_us)}{self._meas(meas_us)}{_origin(origin)}")

    def noise_floor(self, spread: float, samples: int, band: float) -> None:
        self.emit(f"Noise floor ±{100 * spread / 2:.1f}% (interquartile range of the first plan's {samples} timings): "
                  f"a candidate within {100 * band:.1f}% of the best is compared with it in interleaved rounds")

    def faster(self, plan: Plan, est_us: float, meas_us: float, gain: float, origin: str = "", evidence: str = "") -> None:
        tail = f" | {evidence}" if evidence else ""
        self.emit(
            f"Faster {self.label(plan)} | est {fmt_us(est_us)}{self._meas(meas_us)} | x{gain:.2f} better{tail}"
            f"{_origin(origin)}"
        )

    def slower(
        self, plan: Plan, ratio: float, est_us: float, meas_us: float, stopped_after: int | None, origin: str = "",
        evidence: str = "",
    ) -> None:
        tail = f" | stopped early after {stopped_after} runs" if stopped_after is not None else ""
        tail += f" | {evidence}" if evidence else ""
        self.emit(
            f"Slower x{ratio:.2f} {self.label(plan)} | est {fmt_us(est_us)}{self._meas(meas_us)}{tail}{_origin(origin)}"
        )

    def tie(self, plan: Plan, evidence: str, kept: Plan, origin: str = "") -> None:
        self.emit(f"Tie {self.label(plan)} | {evidence} | kept {self.label(kept)}, the cost model's choice (fewer "
                  f"bytes, launches){_origin(origin)}")

    def bounded(self, plan: Plan, ratio: float, est_us: float, bound_us: float, origin: str = "") -> None:
        self.emit(f"Bounded x{ratio:.2f} {self.label(plan)} | est {fmt_us(est_us)} | its timed kernels "
                  f"{fmt_us(bound_us)} | not run{_origin(origin)}")

    def predicted(self, plan: Plan, ratio: float, own_us: float, other_us: float, origin: str = "") -> None:
        self.emit(f"Predicted x{ratio:.3f} {self.label(plan)} | the kernels it differs in, timed in earlier plans, "
                  f"{fmt_us(own_us)} against the best's {fmt_us(other_us)} | not run{_origin(origin)}")

    def rejected(self, reason: str, plan: Plan, origin: str = "") -> None:
        self.emit(f"Rejected {reason} {self.label(plan)}{_origin(origin)}")

    def final_round(self, finalists: list[tuple[Plan, float]], winner: Plan, evidence: str = "") -> None:
        rows = ", ".join(f"{self.label(p)} {fmt_us(us)}" for p, us in finalists)
        tail = f" ({evidence})" if evidence else ""
        self.emit(f"Final round (interleaved re-measurement): {rows} | best {self.label(winner)}{tail}")

    def footer(
        self,
        seconds: float,
        best: Plan,
        speedup: float | None,
        timed: int,
        rejected: int,
        spearman: float | None,
        stop: str,
        bounded: int = 0,
        predicted: int = 0,
    ) -> None:
        estimated = self.estimated and timed > 0  # a verify-only backend estimates nothing either
        how = "estimated" if estimated else "interleaved re-measurement"
        sp = f"{speedup:.2f}x vs unfused ({how})" if speedup is not None else "no speedup measured"
        rho = "" if estimated else f" | spearman rho {spearman:.2f}" if spearman is not None else " | spearman rho n/a"
        skipped = (f", {bounded} slower by their kernels" if bounded else "") + (
            f", {predicted} not faster by their kernels" if predicted else "")
        self.emit(
            f"Searched in {fmt_duration(seconds)}: best {self.label(best)} | {sp} | "
            f"{timed} {'costed' if estimated else 'timed'}, {rejected} rejected{skipped}{rho} | stopped: {stop}"
        )

    def _meas(self, meas_us: float) -> str:
        return "" if self.estimated else f" | meas {fmt_us(meas_us)}"
