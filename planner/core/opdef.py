"""The record of one op kind (:class:`OpDef`) and its parts: attributes, a reduction's way through a row, and
the float literals code snippets use.  The op table itself is :mod:`planner.core.ops`."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from planner.core.errors import OpError
from planner.core.kinds import OpKind
from planner.core.shapes import Attrs, Shape, ShapeRule

# ---------------------------------------------------------------- attributes


@dataclass(frozen=True)
class AttrSpec:
    """One attribute of an op: its name, egglog sort and default."""

    name: str
    sort: str  # "f64" | "i64" | "String"
    default: Any = None
    minimum: float | None = None  # smallest valid value of a numeric attribute
    choices: tuple[str, ...] = ()  # the valid values of a String attribute (any string when empty)
    #: values an example of the op may take (the fuzzer draws them); empty: the default, else the choices
    examples: tuple[Any, ...] = ()

    def coerce(self, value: Any, op: str) -> Any:
        if value is None:
            if self.default is None:
                raise OpError(f"{op}: missing attribute {self.name!r}")
            value = self.default
        try:
            if self.sort == "f64":
                out = float(value)
                if not math.isfinite(out):
                    raise OpError(f"{op}: attribute {self.name!r} must be finite, got {value!r}")
                return self._at_least(out, op)
            if self.sort == "i64":
                if isinstance(value, bool) or int(value) != value or not -(2**63) <= int(value) < 2**63:
                    raise OpError(f"{op}: attribute {self.name!r} must be a 64-bit integer, got {value!r}")
                return self._at_least(int(value), op)
            if self.choices and str(value) not in self.choices:
                raise OpError(f"{op}: attribute {self.name!r} must be one of {list(self.choices)}, got {str(value)[:40]!r}")
            return str(value)
        except (TypeError, ValueError, OverflowError) as exc:
            if isinstance(exc, OpError):
                raise
            raise OpError(f"{op}: attribute {self.name!r} has bad value {str(value)[:40]!r}") from None

    def _at_least(self, value: Any, op: str) -> Any:
        if self.minimum is not None and value < self.minimum:
            raise OpError(f"{op}: attribute {self.name!r} must be at least {self.minimum:g}, got {value!r}")
        return value


    def example_values(self) -> tuple[Any, ...]:
        """Values an example of the op draws this attribute from (none: the op cannot be drawn)."""
        if self.examples:
            return self.examples
        if self.default is not None:
            return (self.default,)
        return self.choices


# ---------------------------------------------------------------- code snippets
# A snippet maps input variable names (and attributes) to one C expression in float arithmetic.  The CPU (C)
# and CUDA backends share these strings; each backend's prelude defines the helpers they call (fp_max, fp_min,
# fp_relu, fp_tanh, fp_erf, fp_round_bf16, fp_round_f16, and fp_bits_f32 for a literal given by its bits).


def float_literal(v: float) -> str:
    """A float constant as C and CUDA read it: a finite value as a float literal (the compiler rounds it to fp32,
    to nearest), an infinity or a NaN by its bits (``fp_bits_f32``), so that no spelling depends on a header."""
    x = float(v)
    if math.isfinite(x):
        return f"{x!r}f"
    (bits,) = struct.unpack("<I", struct.pack("<f", x))
    return f"fp_bits_f32(0x{bits:08x}u)"


CodeFn = Callable[[Sequence[str], Attrs], str]


@dataclass(frozen=True)
class Reduction:
    """How a row kernel computes a reduction over the last dimension: partial results start at ``identity``
    and merge with ``combine`` (a C expression over ``{a}`` and ``{b}``); ``finish`` turns the merged value
    ``{acc}`` into the result (``{width}``: the row's length); ``vector``, where given, is ``combine`` over two
    vectors of partials (``fp_va``, the C prelude's: 16 lanes, 8 on AVX2 without AVX-512), which lets the C
    generator keep its partials in one vector register.  A combine must be associative and commutative up to rounding: the partials merge in a tree.
    ``quiet``, where given, is ``vector`` that may lose a NaN operand (x86's max: one instruction on the
    loop-carried chain): the loop and the tree combine through it, the lanes that read a NaN are marked beside
    it, and a mark makes the result NaN, so it is what ``vector`` gives."""

    identity: float
    combine: str
    finish: str = "{acc}"
    vector: str | None = None
    quiet: str | None = None


@dataclass(frozen=True)
class OpDef:
    """Everything the planner knows about one op kind."""

    name: str
    kind: OpKind
    arity: int | None  # tensor inputs; None for variadic (Opaque)
    attrs: tuple[AttrSpec, ...] = ()
    shape_rule: Callable[[str, Sequence[Shape], Attrs], Shape] | None = None
    #: the result's dtype from the inputs' dtypes and the attributes, for an op whose result is not of its inputs'
    #: one dtype (Cast, Embedding); None: the inputs' one dtype
    dtype_rule: Callable[[Sequence[str], Attrs], str] | None = None
    numpy_fn: Callable[[Sequence[np.ndarray], Attrs], np.ndarray] | None = None
    flops_per_elem: Callable[[Attrs], float] | None = None  # elementwise ops
    regs: Callable[[Attrs], int] = field(default=lambda attrs: 0)
    code: CodeFn | None = None
    #: input positions that may be read from registers (fused) rather than memory; each one gets the
    #: generated register-read, GEMM-epilogue and subsume rules (planner/rules/rulegen.py)
    fusable_inputs: tuple[int, ...] = ()
    #: which fusable inputs may come from a GEMM in registers (the generated epilogue rule): all (True),
    #: none (False) or the listed positions
    gemm_epilogue: bool | tuple[int, ...] = True
    #: canonical names of the torch callables this op is (``torch.square``, ``torch.Tensor.square``):
    #: the torch importer maps a call of one of them on a single tensor, with no other argument,
    #: to this op (only for ops with one input and no attributes)
    torch_names: tuple[str, ...] = ()
    #: FLOPs of ops whose count is not per element (Opaque: its implementation's rule)
    flops_rule: Callable[[Shape, Sequence[Shape], Attrs], float] | None = None
    #: a further check of the coerced attributes (Opaque: the implementation name and its call description)
    attr_check: Callable[[dict[str, Any]], None] | None = None
    #: live temporaries a code generator must keep (the C-05 register-pressure probe)
    probe_temps: Callable[[Attrs], int] = field(default=lambda attrs: 0)
    #: inputs of which a kernel reads only the rows its result holds (a gather's table): the cost model counts
    #: the result's bytes for them, not the whole input's
    gathered: tuple[int, ...] = ()
    #: a reduction's start value and combine, as the row kernels compute it (kind ``reduction`` only)
    reduction: Reduction | None = None
    #: inputs whose values must be positive for the result to be finite (sqrt's, a divisor): an example of
    #: the op (``planner.core.examples.op_example``, the fuzzer) feeds them positive values
    positive_inputs: tuple[int, ...] = ()
    doc: str = ""
    #: the op's name in tables people read (``gemm``, ``bias``, ``gelu``); empty: the name in lower case
    label: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", OpKind(self.kind))  # a registered op may name its kind as a string
        if (self.kind == OpKind.REDUCTION) != (self.reduction is not None):
            raise OpError(f"{self.name}: an op of kind reduction, and only one, carries a Reduction "
                          "(its start value and combine)")

    @property
    def short(self) -> str:
        """The op's name as a table shows it: :attr:`label`, else the name in lower case."""
        return self.label or self.name.lower()

    def takes_gemm_input(self, i: int) -> bool:
        """May fusable input ``i`` come from a GEMM in registers (an epilogue rule)?"""
        return i in self.gemm_epilogue if isinstance(self.gemm_epilogue, tuple) else self.gemm_epilogue

    def check_attrs(self, attrs: Attrs) -> dict[str, Any]:
        known = {a.name for a in self.attrs}
        unknown = sorted(set(attrs) - known)
        if unknown and self.kind != OpKind.OPAQUE:
            raise OpError(f"{self.name}: unknown attribute(s) {unknown}")
        out = {a.name: a.coerce(attrs.get(a.name), self.name) for a in self.attrs}
        if self.kind == OpKind.OPAQUE:
            out.update({k: v for k, v in attrs.items() if k not in known})
        if self.attr_check is not None:
            self.attr_check(out)
        return out

    def out_shape(self, in_shapes: Sequence[Shape], attrs: Attrs) -> Shape:
        if self.arity is not None and len(in_shapes) != self.arity:
            raise OpError(f"{self.name}: expects {self.arity} input(s), got {len(in_shapes)}")
        assert self.shape_rule is not None
        return self.shape_rule(self.name, in_shapes, attrs)

    def out_dtype(self, in_dtypes: Sequence[str], attrs: Attrs) -> str | None:
        """The result's dtype: the ``dtype_rule``'s, else the inputs' (which must agree); None with no input."""
        if self.dtype_rule is not None:
            return self.dtype_rule(in_dtypes, attrs)
        if len(set(in_dtypes)) > 1:
            raise OpError(f"{self.name}: mixed input dtypes {sorted(set(in_dtypes))}")
        return in_dtypes[0] if in_dtypes else None

    def evaluate(self, inputs: Sequence[np.ndarray], attrs: Attrs) -> np.ndarray:
        assert self.numpy_fn is not None, self.name
        return self.numpy_fn(inputs, attrs)

    def flops(self, out_shape: Shape, in_shapes: Sequence[Shape], attrs: Attrs) -> float:
        if self.kind == OpKind.MATMUL:
            (m, k), (_, n) = in_shapes
            return 2.0 * m * n * k
        if self.flops_rule is not None:
            return self.flops_rule(out_shape, in_shapes, attrs)
        if self.flops_per_elem is None:
            return 0.0
        return self.flops_per_elem(attrs) * math.prod(out_shape)

    def live_regs(self, attrs: Attrs) -> int:
        return int(self.regs(attrs))

    def read_bytes(self, i: int, input_bytes: int, out_bytes: int) -> int:
        """The DRAM bytes a kernel of this op reads of its input ``i`` (stored in ``input_bytes``): all of them, or
        for a gathered input the rows of the result (``out_bytes``), at most the whole input."""
        return min(input_bytes, out_bytes) if i in self.gathered else input_bytes


def example_operands(op: OpDef, first: Shape) -> tuple[Shape, ...] | None:
    """Shapes of the further inputs of an example of ``op`` whose first input has shape ``first`` (None: its
    shape rule gives none; a rule of the shapes module does)."""
    rule = op.shape_rule
    if not isinstance(rule, ShapeRule) or op.arity is None:
        return None
    shapes = rule.operands(first)
    if shapes is None or len(shapes) < op.arity - 1:
        return None
    return tuple(shapes[: op.arity - 1])


__all__ = ["AttrSpec", "CodeFn", "OpDef", "OpError", "Reduction", "example_operands", "float_literal"]
