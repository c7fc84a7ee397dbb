"""Human-readable ledger tables."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import TypeVar

from planner.core.kinds import KernelKind
from planner.core.ops import OPS
from planner.core.plans import Kernel, Plan
from planner.core.regions import Region

#: what a table row names at most: parts of a chain partition
TABLE_PARTS = 24

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


T = TypeVar("T")

#: a person's name for a row kernel's usual op sets: (name, ops it holds, ops it must not hold), matched as a
#: multiset of the kernel's ops (a layernorm split across kernels is no rmsnorm: it subtracts a row statistic)
MOTIFS: tuple[tuple[str, tuple[str, ...], frozenset[str]], ...] = (
    ("softmax", ("RowMax", "SubRow", "Exp", "RowSum", "DivRow"), frozenset()),
    ("layernorm", ("RowMean", "SubRow", "Square", "RowMean", "Affine", "Rsqrt", "MulRow"), frozenset()),
    ("rmsnorm", ("Square", "RowMean", "Affine", "Rsqrt", "MulRow"), frozenset({"SubRow"})),
)
#: what a table shows at most by default (``--all``: everything)
TABLE_ROWS, TABLE_WIDTH = 40, 120


def op_words(ops: Sequence[str]) -> list[str]:
    """Ops (producers first, an Opaque op as ``Opaque:impl``) as a person names them: a motif's ops as its one
    name (at its first op's place), the rest by their op-table label, an Opaque op by its implementation's last
    name."""
    ops = list(ops)
    words: list[str | None] = [
        op.split(":", 1)[1].rsplit(".", 1)[-1] if op.startswith("Opaque:") else OPS[op].short for op in ops
    ]
    for motif, members, excluded in MOTIFS:
        if excluded & set(ops):
            continue
        spots: list[int] = []
        for member in members:
            spot = next((i for i, op in enumerate(ops) if op == member and i not in spots and words[i] is not None), None)
            if spot is None:
                break
            spots.append(spot)
        else:
            for i in spots:
                words[i] = None
            words[min(spots)] = motif
    return [w for w in words if w is not None]


def kernel_name(k: Kernel) -> str:
    """A kernel as a table shows it: ``gemm+bias+gelu``, ``layernorm+scale+bias``, ``attention``; a cuBLASLt
    call as ``lt:gemm+bias``."""
    name = "+".join(op_words(k.ops))
    return f"lt:{name}" if k.kind == KernelKind.CUBLASLT else name


def kernels_text(p: Plan, width: int | None = None) -> str:
    """The kernels column of a ledger row: each kernel's :func:`kernel_name`, a run of equal ones as
    ``heads x3``; within ``width`` characters (None: all), then how many kernels more."""
    runs: list[tuple[str, int]] = []
    for k in p.kernels:
        name = kernel_name(k)
        if runs and runs[-1][0] == name:
            runs[-1] = (name, runs[-1][1] + 1)
        else:
            runs.append((name, 1))
    parts = [name if n == 1 else f"{name} x{n}" for name, n in runs]
    text = " | ".join(parts)
    if width is None or len(text) <= width:
        return text
    shown: list[str] = []
    kernels = 0
    for part, (_, n) in zip(parts, runs, strict=True):
        more = len(p.kernels) - kernels - n
        tail = f" | ...{more} more" if more else ""
        if len(" | ".join([*shown, part]) + tail) > width:
            if shown:
                break
            part = _shorten(part, width - len(tail))  # one kernel of many ops: its first ops, then how many more
        shown.append(part)
        kernels += n
    more = len(p.kernels) - kernels
    return " | ".join(shown) + (f" | ...{more} more" if more else "")


def _shorten(name: str, width: int) -> str:
    """A kernel's name within ``width`` characters: its first ops, then how many ops more."""
    words = name.split("+")
    for keep in range(len(words) - 1, 0, -1):
        short = "+".join(words[:keep]) + f"+...{len(words) - keep} ops more"
        if len(short) <= width:
            return short
    return f"{words[0]}+...{len(words) - 1} ops more" if len(words) > 1 else name


def region_title(region: Region) -> str:
    """A region as a person reads it: its first op (a motif's name where its ops begin one), that op's first
    operand's shape, the head of its structural hash (two regions may start alike): ``layernorm 64x256 #ae45bd``."""
    first = region.graph.ops[0]
    operand = region.graph[first.inputs[0]].type.shape if first.inputs else first.type.shape
    ops = [n.op if n.op != "Opaque" else f"Opaque:{n.attr_dict.get('impl', '')}" for n in region.graph.ops]
    return f"{op_words(ops)[0]} {'x'.join(map(str, operand))} #{region.key[:6]}"


def plan_title(p: Plan, width: int = 80) -> str:
    """A plan in one line: its chain partition (``[5,7]``) or kernel count (``#13k``), then its kernels by
    :func:`kernels_text` within ``width`` characters."""
    notation = p.notation(TABLE_PARTS) if p.partition is not None else f"#{len(p.kernels)}k"
    return f"{notation} {kernels_text(p, width)}"


def pareto_front(items: Sequence[T], ledgers: Callable[[T], tuple[int, int, int]]) -> list[int]:
    """The indices of the items that no other matches or beats on all three ledgers (bytes, launches, register
    peak; one of equals), in the order of their ledgers."""
    front: list[tuple[int, int, int]] = []
    kept: list[int] = []
    for i in sorted(range(len(items)), key=lambda i: ledgers(items[i])):
        point = ledgers(items[i])
        if not any(all(a <= b for a, b in zip(q, point, strict=True)) for q in front):
            front.append(point)
            kept.append(i)
    return kept


def table_rows(plans: Sequence[Plan], best_key: str, limit: int = TABLE_ROWS) -> list[Plan]:
    """The rows a table shows by default, in the given order: every plan when there are at most ``limit``;
    else the chosen one, the unfused one (the most kernels), the Pareto front of bytes, launches and register
    peak, then the leading runners-up, up to ``limit``."""
    if len(plans) <= limit:
        return list(plans)
    keep: set[int] = {i for i, p in enumerate(plans) if p.key == best_key}
    keep.add(max(range(len(plans)), key=lambda i: len(plans[i].kernels)))
    for i in pareto_front(plans, lambda p: (p.bytes, p.launches, p.reg_peak)):
        if len(keep) < limit:
            keep.add(i)
    for i in range(len(plans)):
        if len(keep) >= limit:
            break
        keep.add(i)
    return [plans[i] for i in sorted(keep)]


def ledger_table(
    plans: Sequence[Plan],
    best_key: str,
    extra: Sequence[tuple[str, Callable[[Plan], str]]] = (),
    *,
    full: bool = False,
) -> str:
    """One row per plan: notation, bytes, launches, register peak, estimate, ``extra`` columns, kernels. Unless
    ``full``, at most :data:`TABLE_ROWS` rows (:func:`table_rows`, the rest counted below) within
    :data:`TABLE_WIDTH` characters."""
    shown = list(plans) if full else table_rows(plans, best_key)
    header = ["", "plan", "bytes", "launches", "reg_peak", "est_us", *(h for h, _ in extra)]
    rows = [header]
    for p in shown:
        rows.append(
            [
                "*" if p.key == best_key else "",
                p.notation(TABLE_PARTS) if p.partition is not None else f"#{len(p.kernels)}k",
                f"{p.bytes:,}",
                str(p.launches),
                str(p.reg_peak),
                f"{p.est_us:,.2f}",
                *(fn(p) for _, fn in extra),
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    room = None if full else max(24, TABLE_WIDTH - sum(w + 2 for w in widths))
    lines = []
    for r, kernels in zip(rows, ["kernels", *(kernels_text(p, room) for p in shown)], strict=True):
        cells = [c.rjust(w) if i in (2, 3, 4, 5) else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        lines.append("  ".join(cells) + "  " + kernels)
    if len(shown) < len(plans):
        lines.append(f"({len(plans) - len(shown):,} more rows: --all, or table(all=True), lists every one)")
    return "\n".join(lines)
