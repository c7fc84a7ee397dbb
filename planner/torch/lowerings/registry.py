"""The registry of lowerings: each kind of ``IMPORTER_TABLE`` (``planner.torch.ops``) and the function that emits
its op-table ops."""

from __future__ import annotations

from collections.abc import Callable

from planner.torch.walk import (
    Lowering,
)

#: the lowering of each kind of IMPORTER_TABLE
LOWERINGS: dict[str, Lowering] = {}
#: what each kind becomes: the op-table ops its lowering may emit, in words (the supported-ops list of docs/torch.md)
BECOMES: dict[str, str] = {}


def lowering(*kinds: str, becomes: str) -> Callable[[Lowering], Lowering]:
    """Register a function as the lowering of ``kinds``; ``becomes`` says what it emits."""

    def register(fn: Lowering) -> Lowering:
        for kind in kinds:
            if kind in LOWERINGS:
                raise ValueError(f"torch call kind {kind!r} has a lowering already ({LOWERINGS[kind].__name__})")
            LOWERINGS[kind] = fn
            BECOMES[kind] = becomes
        return fn

    return register
