"""Human-readable ledger tables."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fusion_planner.core.plans import Plan


def _kernels(p: Plan) -> str:
    return " | ".join(k.describe() for k in p.kernels)


def ledger_table(
    plans: Sequence[Plan],
    best_key: str,
    extra: Sequence[tuple[str, Callable[[Plan], str]]] = (),
) -> str:
    """One row per plan: notation, kernels, bytes, launches, register peak, estimate."""
    header = ["", "plan", "bytes", "launches", "reg_peak", "est_us", *(h for h, _ in extra), "kernels"]
    rows = [header]
    for p in plans:
        rows.append(
            [
                "*" if p.key == best_key else "",
                p.notation() if p.partition is not None else f"#{len(p.kernels)}k",
                f"{p.bytes:,}",
                str(p.launches),
                str(p.reg_peak),
                f"{p.est_us:,.2f}",
                *(fn(p) for _, fn in extra),
                _kernels(p),
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    lines = []
    for r in rows:
        cells = [c.rjust(w) if i in (2, 3, 4, 5) else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=False))]
        lines.append("  ".join(cells) + "  " + r[-1])
    return "\n".join(lines)
