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

from fusion_planner.core.kinds import KernelKind
from fusion_planner.egraph.extract import Extractor, Option

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
        choice: Choice = {}
        for t in stored:
            c = self.class_of[t]
            fits = [
                o
                for o in ex.options[c]
                if {v.tensor[x] for x in o.leaves} <= allowed and not (self.interior(o) & stored)
            ]
            if not fits:
                return None
            choice[c] = min(fits, key=_preference(prefer.get(c)))
        return choice if self.stored(choice) == stored else None

    # -- operators
    def remove_boundary(self, choice: Choice) -> list[Mutant]:
        s = self.stored(choice)
        out = []
        for x in sorted(s - self.outputs):
            m = self.realize(s - {x}, choice)
            if m is not None:
                out.append(self._mutant("remove-boundary", x, m))
        return out

    def add_boundary(self, choice: Choice) -> list[Mutant]:
        s = self.stored(choice)
        inner = set().union(*(self.interior(choice[c]) for c in self.ex.required(choice)))
        out = []
        for y in sorted(inner & set(self.class_of)):
            m = self.realize(s | {y}, choice)
            if m is not None:
                out.append(self._mutant("add-boundary", y, m))
        return out

    def move_boundary(self, choice: Choice) -> list[Mutant]:
        s = self.stored(choice)
        out = []
        for x in sorted(s - self.outputs):
            near = set(self.ex.graph[x].inputs) | set(self.consumers.get(x, []))
            for y in sorted(near - s - self.input_tensors):
                if y not in self.class_of:
                    continue
                m = self.realize((s - {x}) | {y}, choice)
                if m is not None:
                    out.append(self._mutant("move-boundary", f"{x}->{y}", m))
        return out

    def swap_impl(self, choice: Choice) -> list[Mutant]:
        v = self.ex.view
        out = []
        for c in sorted(self.ex.required(choice), key=v.order.__getitem__):
            o = choice[c]
            alts: dict[str, Option] = {}
            for o2 in self.ex.options[c]:  # sorted by estimate: keep the cheapest per kind
                if set(o2.leaves) == set(o.leaves) and o2.kind != o.kind and KernelKind.CUBLASLT in (o.kind, o2.kind):
                    alts.setdefault(o2.kind, o2)
            for o2 in alts.values():
                m = dict(choice)
                m[c] = o2
                out.append(self._mutant("swap-impl", f"{v.tensor[c]}: {_impl(o)} -> {_impl(o2)}", m))
        return out

    def mutants(self, choice: Choice) -> list[Mutant]:
        """Every one-step mutant, deduplicated, none equal to the parent."""
        parent = self.ex.key(choice)
        seen = {parent}
        out = []
        for op in (self.remove_boundary, self.add_boundary, self.move_boundary, self.swap_impl):
            for m in op(choice):
                if m.key not in seen:
                    seen.add(m.key)
                    out.append(m)
        return out

    def random_mutant(self, choice: Choice, rng: random.Random, exclude: set[str] | frozenset[str] = frozenset()) -> Mutant | None:
        """A uniformly chosen operator, then a uniformly chosen result of it, avoiding ``exclude``."""
        by_op: dict[str, list[Mutant]] = {}
        for m in self.mutants(choice):
            if m.key not in exclude:
                by_op.setdefault(m.operator, []).append(m)
        if not by_op:
            return None
        op = rng.choice(sorted(by_op))
        return rng.choice(by_op[op])

    def _mutant(self, operator: str, detail: str, choice: Choice) -> Mutant:
        return Mutant(operator, detail, self.ex.key(choice), choice)


def _preference(cur: Option | None) -> Callable[[Option], tuple[bool, bool, float, str]]:
    """Sort key: the parent's own option, then its kind, then the cheapest estimate."""

    def key(o: Option) -> tuple[bool, bool, float, str]:
        return (cur is None or o.sig != cur.sig, cur is None or o.kind != cur.kind, o.cost.est_us, o.sig)

    return key


def _impl(o: Option) -> str:
    return f"cublaslt({o.epilogue})" if o.kind == KernelKind.CUBLASLT else o.kind
