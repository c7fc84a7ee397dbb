"""The closed vocabularies: op kinds, kernel kinds and a candidate's verdict.

They are ``StrEnum``s, so they print, compare and serialise as the plain strings that plan,
bundle and results files hold.
"""

from __future__ import annotations

from enum import StrEnum


class OpKind(StrEnum):
    """What an op of the op table is."""

    INPUT = "input"
    MATMUL = "matmul"
    ELEMENTWISE = "elementwise"
    REDUCTION = "reduction"  # over the last dimension, kept as 1: computed in the row kernel of its consumers
    #: its own kernel, every input read from memory, never fused into another: the layout copies of attention
    #: heads, batched products and the fused attention kernel
    STANDALONE = "standalone"
    OPAQUE = "opaque"

    @property
    def fuses(self) -> bool:
        """Computed in registers inside a kernel (elementwise and row-reduction ops)."""
        return self in (OpKind.ELEMENTWISE, OpKind.REDUCTION)


class KernelKind(StrEnum):
    """How a kernel of a plan is implemented."""

    ELEMENTWISE = "elementwise"  # fused elementwise ops, one loop
    GEMM_EPILOGUE = "gemm_epilogue"  # a custom GEMM applying elementwise ops to its result
    CUBLASLT = "cublaslt"  # a library GEMM with one of cuBLASLt's epilogues
    STANDALONE = "standalone"  # one standalone op (a head layout, a batched product, attention) over loads
    OPAQUE = "opaque"  # one Opaque op, its registered implementation


#: the kernel kind of a body holding an op of this kind (a body holds at most one op that is not elementwise or a
#: reduction: the extractor's rules); elementwise otherwise
KERNEL_OF_OP: dict[str, KernelKind] = {OpKind.MATMUL: KernelKind.GEMM_EPILOGUE, OpKind.OPAQUE: KernelKind.OPAQUE,
                                       OpKind.STANDALONE: KernelKind.STANDALONE}


class Verdict(StrEnum):
    """What the search (or the remote runner) made of a candidate; a rejection carries its reason."""

    BEST = "best"
    TIMED = "timed"
    NOT_TIMED = "not timed"
    #: not run: kernels it shares with plans timed before take longer than the best allows (the search's bound)
    BOUNDED = "slower by its kernels"
    #: not run: the kernels it differs from the best in, timed in earlier plans, predict no win beyond a duel's
    #: margin, and the cost model does not prefer it (a duel could only keep the best)
    PREDICTED = "not faster by its kernels"
    REJECTED = "rejected"


def rejected(reason: str) -> str:
    """The verdict of a candidate rejected for ``reason``: ``"rejected: <reason>"``."""
    return f"{Verdict.REJECTED}: {reason}"


def is_rejected(verdict: str) -> bool:
    return verdict.startswith(Verdict.REJECTED)
