"""Human-readable ledger tables."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from decimal import Decimal

from planner.core.plans import Plan, abbreviate

#: what a table row names at most: kernels of a plan, ops of a kernel, parts of a chain partition
TABLE_KERNELS, TABLE_OPS, TABLE_PARTS = 24, 32, 24

#: a number of plans: an exact int, or past 10^34 a Decimal to 34 digits (a 12-layer transformer's
#: space has over ten million digits, too many to make an int of)
Count = int | Decimal


def count_text(n: Count) -> str:
    """A count as a person reads it: ``1,234`` or, past fifteen digits, ``~7.1e44``."""
    if n < 10**15:
        return f"{n:,}"
    log10 = log10_count(n)
    exp = math.floor(log10)
    return f"~{10 ** (log10 - exp):.1f}e{exp}"


def count_json(n: Count) -> int | str:
    """A count in JSON: exact below 10^15 (every JSON reader holds it), else :func:`count_text`'s
    ``~7.1e44`` (a plan space can have more than the 4,300 digits Python will print)."""
    return int(n) if n < 10**15 else count_text(n)


def log10_count(n: Count) -> float:
    """log10 of a positive count of any size (0.0 for 0)."""
    if n <= 0:
        return 0.0
    if isinstance(n, Decimal):  # its leading digits and their exponent (no context's exponent limit applies)
        lead = n.as_tuple().digits[:17]
        return n.adjusted() + math.log10(int("".join(map(str, lead)))) - (len(lead) - 1)
    shift = max(0, n.bit_length() - 60)
    return math.log10(n >> shift) + shift * math.log10(2)


def kernels_text(p: Plan) -> str:
    """The kernels column of a ledger row (at most ``TABLE_KERNELS`` kernels of ``TABLE_OPS`` ops named)."""
    return abbreviate([k.describe(TABLE_OPS) for k in p.kernels], " | ", TABLE_KERNELS)


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
                p.notation(TABLE_PARTS) if p.partition is not None else f"#{len(p.kernels)}k",
                f"{p.bytes:,}",
                str(p.launches),
                str(p.reg_peak),
                f"{p.est_us:,.2f}",
                *(fn(p) for _, fn in extra),
                kernels_text(p),
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    lines = []
    for r in rows:
        cells = [c.rjust(w) if i in (2, 3, 4, 5) else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=False))]
        lines.append("  ".join(cells) + "  " + r[-1])
    return "\n".join(lines)
