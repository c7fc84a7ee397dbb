"""Our extractor: serialized e-graph -> candidate plans.

egglog's built-in extraction sums tree costs; the seed's kernel cost is not
additive (a max of memory and compute time, register sums with a spill cliff,
shared producers stored once), so plans are extracted here.

Vocabulary: a *stored* e-class holds a ``K`` node (and maybe ``CublasLt``
nodes) or an ``In`` node; a *value* e-class holds op nodes.  A kernel option
for a stored class is either a cuBLASLt node or a *body*: a choice of one op
node per value class, reached from the stored value through register children,
down to stored leaves.  A plan picks one option per stored class it needs,
starting from the graph outputs; a stored tensor read by several kernels is
written once, a register value used by several kernels is in each body and so
recomputed (and costed) in each.
"""

from __future__ import annotations

import bisect
import decimal
import itertools
import logging
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from planner.core.kinds import KernelKind
from planner.core.plans import Kernel, Plan
from planner.core.report import Count
from planner.egraph.kernels import KernelOptions, Option, cheapest_first, kernel_sig
from planner.egraph.view import ExtractionError, view_egraph

log = logging.getLogger(__name__)

#: plan counts: exact below 10^34, then rounded to 34 digits. A graph of a few hundred ops has 10^1000
#: plans and more; exact integers of that size made their products the extractor's largest cost
#: (a 6-layer transformer: 40 s of 47)
_COUNTS = decimal.Context(prec=34, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN)
_EXACT = Decimal(10) ** 34


@dataclass
class Extractor(KernelOptions):
    """Plans over the kernel options: the unfused plan, enumeration, the cost model's best (tree DP refined by local
    search), seeded samples weighted by the plans below each option, and a plan's neighbours."""

    neighbourhood: int = 8  # options per class tried by local search and mutation
    _rank: dict[str, list[Option]] | None = None
    _counts: dict[str, Decimal] | None = None
    _space: Count | None = None
    _by_sig: dict[str, Option] | None = None
    _weights: dict[str, list[Decimal]] | None = None  # per class: running sums of the plans below each option
    _unfused: dict[str, Option] | None = None
    _chain: bool | None = None

    def required(self, choice: dict[str, Option]) -> list[str]:
        """Stored classes a choice needs, outputs first, as reached from the roots."""
        need: list[str] = []
        seen: set[str] = set()
        stack = [r for r in self.view.roots if r not in self.view.inputs]
        while stack:
            c = stack.pop()
            if c in seen:
                continue
            seen.add(c)
            need.append(c)
            stack.extend(x for x in choice[c].leaves if x not in self.view.inputs)
        return need

    def plan_of(self, choice: dict[str, Option]) -> Plan:
        used = sorted(self.required(choice), key=self.view.order.__getitem__)
        kernels = tuple(self._kernel(choice[c]) for c in used)
        if self._chain is None:
            self._chain = self.graph.is_chain()
        partition = tuple(choice[c].n_ops for c in used) if self._chain else None
        key = ";".join(choice[c].sig for c in used)
        tensors = {n.id: n.type for n in self.graph.nodes}
        outs = tuple(self.view.tensor[r] for r in self.view.roots)
        return Plan(self.graph.name, kernels, outs, tensors, key, partition)

    def unfused(self) -> dict[str, Option]:
        """One kernel per op of the graph: every value read from memory, no library calls; each class computed
        by its graph node's own op where the class has it (a rule may have made another single op equal to it:
        ``x * sigmoid(x)`` is ``Silu(x)``, which would skip the node of the sigmoid)."""
        if self._unfused is None:
            choice: dict[str, Option] = {}
            for c, opts in self.options.items():
                singles = [o for o in opts if o.kind != KernelKind.CUBLASLT and o.n_ops == 1]
                if not singles:
                    raise ExtractionError(f"no single-op kernel for {self.view.tensor[c]!r}")
                own = self.graph[self.view.tensor[c]].op
                choice[c] = next((o for o in singles if self._root_op(o) == own), singles[0])
            self._unfused = choice
        return dict(self._unfused)

    def _root_op(self, o: Option) -> str:
        """The op of a one-op kernel's e-node."""
        ((cls, i),) = o.assign.items()
        return self.view.classes[cls][i].op

    def enumerate(self, cap: int) -> tuple[list[dict[str, Option]], bool]:
        """All plans if there are at most ``cap``; returns (plans, complete).  Depth-first over the stored
        classes a choice needs, latest first, with an explicit stack (a segment of 1,000 graph outputs is
        1,000 levels deep)."""
        out: list[dict[str, Option]] = []
        order, inputs = self.view.order, self.view.inputs
        chosen: dict[str, Option] = {}
        frames: list[list[Any]] = []  # [class, classes still pending after it, next option to try]

        def descend(pending: list[str]) -> bool:
            """A plan when nothing is pending (False once there are more than ``cap``), else a new level."""
            if not pending:
                out.append(dict(chosen))
                return len(out) <= cap
            pending = sorted(pending, key=order.__getitem__)
            frames.append([pending.pop(), pending, 0])
            return True

        complete = descend([r for r in dict.fromkeys(self.view.roots) if r not in inputs])
        while frames and complete:
            frame = frames[-1]
            r, pending, i = frame
            chosen.pop(r, None)
            if i == len(self.options[r]):
                frames.pop()
                continue
            o = self.options[r][i]
            frame[2] = i + 1
            new = [x for x in o.leaves if x not in inputs and x not in chosen and x not in pending]
            chosen[r] = o
            complete = descend(pending + new)
        if not complete:
            out.pop()
        return out, complete

    def _shared(self) -> set[str]:
        """Stored classes read by two or more graph ops: their choice is counted once."""
        uses: dict[str, int] = {}
        for node in self.graph.nodes:
            for i in set(node.inputs):
                uses[i] = uses.get(i, 0) + 1
        return {c for c in self.options if uses.get(self.view.tensor[c], 0) > 1}

    def _local_counts(self) -> dict[str, Decimal]:
        if self._counts is not None:
            return self._counts
        shared = self._shared()
        count: dict[str, Decimal] = {}
        for c in sorted(self.options, key=self.view.order.__getitem__):
            count[c] = _total(
                _prod(count[x] for x in o.leaves if x in count and x not in shared) for o in self.options[c]
            )
        self._counts = count
        return count

    def space_size(self) -> Count:
        """Number of plans: exact for chains and trees up to 10^34 (then to 34 digits); with shared
        producers an estimate that counts each shared producer's choice once."""
        if self._space is None:
            count = self._local_counts()
            roots = {r for r in self.view.roots if r not in self.view.inputs} | self._shared()
            total = _prod(count[r] for r in roots)
            self._space = _as_int(total) if total < _EXACT else total
        return self._space

    def cost(self, choice: dict[str, Option]) -> float:
        return sum(choice[c].cost.est_us for c in self.required(choice))

    def _ranked(self) -> dict[str, list[Option]]:
        """Each class's options by tree-DP value: own time plus the best times of its inputs
        (shared producers counted per use)."""
        if self._rank is None:
            best: dict[str, float] = {}
            ranked: dict[str, list[Option]] = {}
            for c in sorted(self.options, key=self.view.order.__getitem__):
                value = {o: o.cost.est_us + sum(best[x] for x in o.leaves if x in best) for o in self.options[c]}
                ranked[c] = cheapest_first(self.options[c], value.__getitem__)
                best[c] = value[ranked[c][0]]
            self._rank = ranked
        return self._rank

    def dp_best(self) -> dict[str, Option]:
        """Tree DP on estimated time, then exact local search."""
        choice = {c: opts[0] for c, opts in self._ranked().items()}
        return self.improve(choice)

    def improve(self, choice: dict[str, Option], max_passes: int = 4) -> dict[str, Option]:
        """Greedy local search with exact plan costs: swap one kernel while it helps,
        trying each class's ``neighbourhood`` best options by DP value."""
        current = dict(choice)
        cur_cost = self.cost(current)
        for _ in range(max_passes):
            changed = False
            for trial in list(self.neighbours(current)):
                t_cost = self.cost(trial)
                if t_cost < cur_cost - 1e-9:
                    current, cur_cost, changed = trial, t_cost, True
            if not changed:
                break
        return current

    def sample(self, n: int, seed: int) -> list[dict[str, Option]]:
        """Seeded, deduplicated samples; uniform over plans when they form trees."""
        rng = random.Random(seed)
        if self._weights is None:
            count = self._local_counts()
            shared = self._shared()
            self._weights = {
                c: list(itertools.accumulate((_prod(count[x] for x in o.leaves if x in count and x not in shared)
                                              for o in opts), _COUNTS.add))
                for c, opts in self.options.items()
            }
        weights = self._weights
        seen: set[str] = set()
        out: list[dict[str, Option]] = []
        attempts = 0
        total = self.space_size()
        base = self.unfused()
        while len(out) < min(n, total) and attempts < 20 * n:
            attempts += 1
            choice = dict(base)
            pending = [r for r in dict.fromkeys(self.view.roots) if r not in self.view.inputs]
            done: set[str] = set()
            while pending:
                pending.sort(key=self.view.order.__getitem__)
                r = pending.pop()
                if r in done:
                    continue
                done.add(r)
                o = self.options[r][_weighted_index(rng, weights[r])]
                choice[r] = o
                pending.extend(x for x in o.leaves if x not in self.view.inputs and x not in done)
            key = self.key(choice)
            if key not in seen:
                seen.add(key)
                out.append(choice)
        return out

    def key(self, choice: dict[str, Option]) -> str:
        used = sorted(self.required(choice), key=self.view.order.__getitem__)
        return ";".join(choice[c].sig for c in used)

    def choice_from_kernels(self, kernels: Sequence[Kernel]) -> dict[str, Option] | None:
        """The choice whose kernels are these (by signature), completed with unfused
        kernels; None when some kernel has no matching option in this e-graph."""
        if self._by_sig is None:
            self._by_sig = {o.sig: o for opts in self.options.values() for o in opts}
        choice = dict(self.unfused())
        for k in kernels:
            o = self._by_sig.get(kernel_sig(k))
            if o is None:
                log.debug("no option matches kernel %s", k.describe())
                return None
            choice[o.root] = o
        return choice

    def neighbours(self, choice: dict[str, Option]) -> Iterator[dict[str, Option]]:
        """Plans that differ in one kernel, among each class's best options by DP value."""
        ranked = self._ranked()
        for c in sorted(self.required(choice), key=self.view.order.__getitem__):
            for o in ranked[c][: self.neighbourhood]:
                if o is not choice[c]:
                    trial = dict(choice)
                    trial[c] = o
                    yield trial


def _prod(xs: Iterator[Decimal] | Sequence[Decimal] | Any) -> Decimal:
    out = Decimal(1)
    for x in xs:
        out = _COUNTS.multiply(out, x)
    return out


def _as_int(count: Decimal) -> int:
    """``int(count)`` of an exact count (Decimal's own conversion took 3.5 s for one of 10^288,000)."""
    _, digits, exponent = count.as_tuple()
    assert isinstance(exponent, int)  # a count is finite
    value = int("".join(map(str, digits)))
    return value * 10**exponent if exponent >= 0 else value // 10**-exponent


def _total(xs: Iterator[Decimal] | Any) -> Decimal:
    out = Decimal(0)
    for x in xs:
        out = _COUNTS.add(out, x)
    return out


def _weighted_index(rng: random.Random, cumulative: list[Decimal]) -> int:
    """An index drawn with probability proportional to its weight, from the running sums of the weights:
    exactly while the counts are exact, else from a uniform float."""
    total = cumulative[-1]
    draw = Decimal(rng.randrange(_as_int(total))) if total < _EXACT else _COUNTS.multiply(total, Decimal(rng.random()))
    return min(bisect.bisect_right(cumulative, draw), len(cumulative) - 1)


__all__ = ["ExtractionError", "Extractor", "Option", "kernel_sig", "view_egraph"]
