"""Mutation operators on a plan choice (stored e-class -> kernel option).

A plan is a set of *stored* tensors (kernel boundaries: every tensor a kernel
writes) plus, for each one, the kernel that computes it.  The operators:

* ``remove-boundary x``: stop storing intermediate ``x``; its producer and
  consumer kernels become one kernel.
* ``add-boundary y``: store a value ``y`` computed in registers inside a
  kernel; that kernel splits in two at ``y``.
* ``move-boundary x->y``: store ``y`` instead of ``x``, where ``y`` is a graph
  neighbour (producer or consumer) of ``x``: the boundary shifts by one op.
* ``swap-impl t``: compute stored tensor ``t`` with the same inputs by another
  implementation: a custom generated kernel instead of a cuBLASLt call or back.

Boundary operators name the target set of stored tensors and *realize* it:
each stored tensor gets a kernel whose body reads only stored tensors and
recomputes none of them, preferring the parent's kernel, then its kind, then
the cheapest estimate.  A target no option can realize (an opaque op cannot
fuse, say) yields no mutant.  Every mutant is a valid plan of the e-graph and
differs from its parent (distinct plan keys).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from planner.core.kinds import KernelKind
from planner.egraph.extract import Extractor, Option

OPERATORS = ("remove-boundary", "add-boundary", "move-boundary", "swap-impl")

Choice = dict[str, Option]


@dataclass(frozen=True)
class Mutant:
    operator: str  # one of OPERATORS
    detail: str  # the tensors involved, e.g. "relu0" or "mm: cublaslt -> gemm_epilogue"
    key: str
    choice: Choice = field(compare=False, hash=False)

    @property
    def label(self) -> str:
        return f"{self.operator} {self.detail}"


class Mutator:
    """Applies the mutation operators to choices of one extractor."""

    def __init__(self, ex: Extractor) -> None:
        self.ex = ex
        v = ex.view
        self.class_of: dict[str, str] = {t: c for c, t in v.tensor.items() if c in ex.options}
        self.input_tensors = {v.tensor[c] for c in v.inputs}
        self.outputs = {v.tensor[r] for r in v.roots}
        self.consumers = ex.graph.consumers()
        self._interior: dict[tuple[str, str], frozenset[str]] = {}

    # -- plan structure
    def stored(self, choice: Choice) -> frozenset[str]:
        """Tensors the plan writes (one per kernel)."""
        return frozenset(self.ex.view.tensor[c] for c in self.ex.required(choice))

    def interior(self, o: Option) -> frozenset[str]:
        """Graph nodes a kernel computes in registers: reached backwards from its
        output, stopping at the tensors it reads."""
        key = (o.root, o.sig)
        got = self._interior.get(key)
        if got is None:
            v = self.ex.view
            leaves = {v.tensor[x] for x in o.leaves}
            root = v.tensor[o.root]
            seen: set[str] = set()
            stack = list(self.ex.graph[root].inputs)
            while stack:
                n = stack.pop()
                if n in seen or n in leaves or n in self.input_tensors:
                    continue
                seen.add(n)
                stack.extend(self.ex.graph[n].inputs)
            got = frozenset(seen)
            self._interior[key] = got
        return got

    def realize(self, stored: frozenset[str], prefer: Choice) -> Choice | None:
        """A choice whose stored tensors are exactly ``stored``, or None."""
        ex, v = self.ex, self.ex.view
        if not self.outputs <= stored or not stored <= set(self.class_of):
            return None
        allowed = stored | self.input_tensors

        def fits(o: Option) -> bool:
            return all(v.tensor[x] in allowed for x in o.leaves) and self.interior(o).isdisjoint(stored)

        choice: Choice = {}
        for t in stored:
            c = self.class_of[t]
            own = prefer.get(c)
            if own is not None and fits(own):  # the parent's kernel still fits: it is the preferred one
                choice[c] = own
                continue
            fitting = [o for o in ex.options[c] if fits(o)]
            if not fitting:
                return None
            choice[c] = min(fitting, key=_preference(own))
        return choice if self.stored(choice) == stored else None

    # -- operators: each lists its targets cheaply, then realizes one target (None: no plan has it)
    def _targets(self, operator: str, choice: Choice) -> list[Any]:
        s = self.stored(choice)
        if operator == "remove-boundary":
            return sorted(s - self.outputs)
        if operator == "add-boundary":
            inner = set().union(*(self.interior(choice[c]) for c in self.ex.required(choice)))
            return sorted(inner & set(self.class_of))
        if operator == "move-boundary":
            moves = []
            for x in sorted(s - self.outputs):
                near = set(self.ex.graph[x].inputs) | set(self.consumers.get(x, []))
                moves += [(x, y) for y in sorted(near - s - self.input_tensors) if y in self.class_of]
            return moves
        v = self.ex.view
        swaps = []
        for c in sorted(self.ex.required(choice), key=v.order.__getitem__):
            o = choice[c]
            alts: dict[str, Option] = {}
            for o2 in self.ex.options[c]:  # sorted by estimate: keep the cheapest per kind
                if set(o2.leaves) == set(o.leaves) and o2.kind != o.kind and KernelKind.CUBLASLT in (o.kind, o2.kind):
                    alts.setdefault(o2.kind, o2)
            swaps += [(c, o2) for o2 in alts.values()]
        return swaps

    def _apply(self, operator: str, target: Any, choice: Choice) -> Mutant | None:
        s = self.stored(choice)
        if operator == "remove-boundary":
            m, detail = self.realize(s - {target}, choice), target
        elif operator == "add-boundary":
            m, detail = self.realize(s | {target}, choice), target
        elif operator == "move-boundary":
            x, y = target
            m, detail = self.realize((s - {x}) | {y}, choice), f"{x}->{y}"
        else:
            c, o2 = target
            m = dict(choice)
            m[c] = o2
            detail = f"{self.ex.view.tensor[c]}: {_impl(choice[c])} -> {_impl(o2)}"
        return None if m is None else self._mutant(operator, detail, m)

    def _results(self, operator: str, choice: Choice) -> list[Mutant]:
        out = []
        for t in self._targets(operator, choice):
            m = self._apply(operator, t, choice)
            if m is not None:
                out.append(m)
        return out

    def mutants(self, choice: Choice) -> list[Mutant]:
        """Every one-step mutant, deduplicated, none equal to the parent."""
        parent = self.ex.key(choice)
        seen = {parent}
        out = []
        for op in OPERATORS:
            for m in self._results(op, choice):
                if m.key not in seen:
                    seen.add(m.key)
                    out.append(m)
        return out

    def random_mutant(self, choice: Choice, rng: random.Random, exclude: set[str] | frozenset[str] = frozenset()) -> Mutant | None:
        """A uniformly chosen operator among those with a result, then a uniformly chosen result of it,
        avoiding ``exclude`` and the parent.  Targets are tried in a random order until one realizes: a
        long segment has a thousand boundaries to add, and realizing all of them to keep one was most
        of a search's time."""
        parent = self.ex.key(choice)
        for op in rng.sample(OPERATORS, len(OPERATORS)):
            targets = self._targets(op, choice)
            for t in rng.sample(targets, len(targets)):
                m = self._apply(op, t, choice)
                if m is not None and m.key != parent and m.key not in exclude:
                    return m
        return None

    def _mutant(self, operator: str, detail: str, choice: Choice) -> Mutant:
        return Mutant(operator, detail, self.ex.key(choice), choice)


def _preference(cur: Option | None) -> Callable[[Option], tuple[bool, bool, float, str]]:
    """Sort key: the parent's own option, then its kind, then the cheapest estimate."""

    def key(o: Option) -> tuple[bool, bool, float, str]:
        return (cur is None or o.sig != cur.sig, cur is None or o.kind != cur.kind, o.cost.est_us, o.sig)

    return key


def _impl(o: Option) -> str:
    return f"cublaslt({o.epilogue})" if o.kind == KernelKind.CUBLASLT else o.kind
