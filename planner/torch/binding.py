"""A planned module's graph inputs: where each comes from at call time (:class:`Binding`), the imported module
(:class:`ImportedModule`: its graph, how to feed it and how to rebuild its outputs), and its parameters and buffers
converted once (:class:`BoundInputs`)."""

from __future__ import annotations

import collections
import ctypes
import functools
import logging
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils import _pytree as pytree

from planner.core.dtypes import DTYPES, numpy_dtype
from planner.core.graph import Graph
from planner.core.opaque import flat_shape
from planner.torch.errors import TorchImportError

log = logging.getLogger(__name__)

TORCH_DTYPES: dict[torch.dtype, str] = {getattr(torch, d.torch_name): d.name for d in DTYPES.values()}
#: the 16-bit dtypes, handed to backends as numpy arrays of their own dtype (float16, ml_dtypes' bfloat16)
BITS_16 = frozenset({torch.float16, torch.bfloat16})
#: integer call inputs (token ids) the importer accepts: bound as fp32 (exact below 2**24), converted back with
#: ``.long()`` right before the Opaque call that takes them, and never read by an op of the op table
INDEX_DTYPES = frozenset({torch.int64, torch.int32})
INDEX_LIMIT = 2**24


def ir_dtype(dtype: torch.dtype, what: str) -> str:
    try:
        return TORCH_DTYPES[dtype]
    except KeyError:
        raise TorchImportError(
            f"{what} has dtype {str(dtype).removeprefix('torch.')}; the planner supports float32, float16 and bfloat16 only"
        ) from None


# ---------------------------------------------------------------- the imported module


@dataclass(frozen=True)
class Binding:
    """Where the value of one graph input comes from at call time."""

    name: str  # IR input id
    #: "arg" (flattened call inputs) | "state" (module parameter/buffer) | "const" | "packed" (parameters side by
    #: side, ``key`` their names: attention's q, k and v weights as one, torch.projections)
    source: str
    key: int | str | tuple[str, ...]
    transpose: bool = False  # a Linear weight bound as (K, N)
    shape: tuple[int, ...] = ()  # torch shape of the source tensor


@dataclass(frozen=True)
class OutputSpec:
    index: int  # position in graph.outputs
    shape: tuple[int, ...]  # torch shape
    dtype: torch.dtype
    #: the flattened call input this output is (or a view of), as eager torch returns it: the very tensor
    arg: int | None = None
    #: the earlier output this one is a view of in eager torch (``y, y.view(-1)``)
    view_of: int | None = None


@dataclass(frozen=True)
class ImportedModule:
    """A module's IR graph plus how to feed it and how to rebuild its outputs."""

    graph: Graph
    bindings: tuple[Binding, ...]
    constants: Mapping[str, np.ndarray]
    arg_specs: tuple[tuple[tuple[int, ...], torch.dtype], ...]  # flattened call inputs
    outputs: tuple[OutputSpec, ...]
    out_tree: Any  # pytree spec of the module's return value
    opaque_ops: tuple[str, ...]
    tracer: str  # "fx" | "export" | "dynamo"
    #: parameters and buffers that values computed at import were computed from (T5's position bias from its
    #: embedding table): a plan holds those values, so a change of these is a change of the module
    folded_from: tuple[str, ...] = ()

    def check_args(self, args: Sequence[Any]) -> list[torch.Tensor]:
        # plain tensors (the common call) need no pytree walk, which cost about 10 µs a call
        flat = list(args) if all(type(a) is torch.Tensor for a in args) else pytree.tree_flatten(tuple(args))[0]
        if len(flat) != len(self.arg_specs):
            raise TorchImportError(f"expected {len(self.arg_specs)} input tensor(s) as at planning time, got {len(flat)}")
        for i, (t, (shape, dtype)) in enumerate(zip(flat, self.arg_specs, strict=False)):
            if not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != dtype or not t.is_cpu or t.requires_grad:
                _check_arg(i, t, shape, dtype)
        return flat

    def wraps_views(self, stored: Sequence[str]) -> bool:
        """Does :meth:`wrap_outputs` only view the arrays of outputs stored as ``stored`` (the graph outputs' IR
        dtypes: fp32, or a 16-bit dtype's bits), reading no value? An output of another torch dtype is converted,
        and a result that is not built of containers (a ``DynamicCache``, which copies the tensors it is given)
        may read them."""
        return self._containers_only and all(
            o.arg is not None or o.view_of is not None or TORCH_DTYPES.get(o.dtype) == stored[o.index]
            for o in self.outputs)

    @functools.cached_property
    def _containers_only(self) -> bool:
        """Is the module's return value a tensor, or tuples, lists, named tuples and dicts (a ``ModelOutput`` is
        one) of them, whose rebuild holds the tensors without reading them?"""
        return _holds_references(self.out_tree)

    def wrap_outputs(self, arrays: Sequence[np.ndarray], flat_args: Sequence[Any] = ()) -> Any:
        """The module's return value from the plan's output arrays: outputs that share memory in eager torch
        (``y`` and ``y.view(-1)``, or a call input returned as it is) share it here too."""
        leaves = []
        bases: dict[int, torch.Tensor] = {}
        for o in self.outputs:
            if o.arg is not None and o.arg < len(flat_args):  # the call input itself, or a view of it
                t = flat_args[o.arg]
                leaves.append(t if t.shape == o.shape else t.view(o.shape))
                continue
            if o.view_of is not None:  # a view of an earlier output
                t = leaves[o.view_of]
                leaves.append(t if t.shape == o.shape else t.view(o.shape))
                continue
            base = bases.get(o.index)
            if base is None:  # shaped in numpy: a torch view is the costlier call just after a kernel
                bases[o.index] = base = self._tensor(arrays[o.index], o.dtype, o.shape)
                leaves.append(base)
                continue
            leaves.append(base if base.shape == o.shape else base.view(o.shape))
        if self._returns_a_tensor:  # no pytree rebuild
            return leaves[0]
        return pytree.tree_unflatten(leaves, self.out_tree)

    @functools.cached_property
    def _returns_a_tensor(self) -> bool:
        """Is the module's return value one tensor (its outputs' one leaf)?"""
        return len(self.outputs) == 1 and self.out_tree.is_leaf()

    @staticmethod
    def _tensor(arr: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        arr = arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
        t = torch.from_numpy(arr if arr.shape == shape else arr.reshape(shape))
        if t.dtype == torch.uint16 and dtype in BITS_16:  # a 16-bit output handed out as its bits
            return t.view(dtype)
        return t if t.dtype == dtype else t.to(dtype)


def _holds_references(spec: Any) -> bool:
    node = spec.type
    container = node is None or node is collections.namedtuple or (
        isinstance(node, type) and issubclass(node, (tuple, list, dict)))
    return container and all(_holds_references(child) for child in spec.children())


def _check_arg(i: int, t: Any, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Raise the error that call input ``i`` deserves, if any (a tensor that needs grad is fine under no_grad)."""
    if not isinstance(t, torch.Tensor):
        raise TorchImportError(f"input {i} is a {type(t).__name__}, expected a tensor")
    if t.device.type != "cpu":
        raise TorchImportError(f"input {i} is on {t.device}; a plan takes host tensors: pass it with .cpu()")
    if t.requires_grad and torch.is_grad_enabled():
        raise TorchImportError(
            f"input {i} requires grad, but a plan computes no gradients: call it under torch.no_grad() or "
            "torch.inference_mode(), or pass the input detached"
        )
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise TorchImportError(
            f"input {i} is {describe_tensor(t)}, but the plan was made for "
            f"{list(shape)} {str(dtype).removeprefix('torch.')}; plan again for new shapes"
        )


def describe_tensor(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def graph_inputs_from_module(
    imported: ImportedModule, module: nn.Module | Mapping[str, torch.Tensor] | None, args: Sequence[Any]
) -> dict[str, np.ndarray]:
    """The graph's input arrays (flattened to IR shapes; float32, or the 16-bit dtype's own numpy dtype) for one
    call: call inputs, parameters,
    buffers (a planned module keeps a :class:`BoundInputs` instead, which converts parameters once)."""
    return BoundInputs(imported, module).feed(args)


@dataclass
class Held:
    """A parameter or buffer as it was when bound: the tensor, its version, its memory and a sample of its bytes."""

    tensor: torch.Tensor
    version: int
    ptr: int
    array: np.ndarray  # what the plan reads
    sample: Sampler

    def fresh(self, t: torch.Tensor) -> bool:
        return t is self.tensor and t._version == self.version and t.data_ptr() == self.ptr and self.sample.same(t)


class Sampler:
    """Bytes of a tensor at fixed offsets, spread over its memory (or all of them, ``exact``): a write through
    ``.data`` bypasses torch's version counter, and a derived copy of the weight (a converted, padded or packed
    form) would keep the old values; a write that changes the weight (``.data.copy_``, ``.mul_``, ``.zero_``)
    changes sampled bytes. A write to a few elements between the samples is seen only with ``exact``.

    The sample is :data:`RUNS` runs of :data:`RUN` bytes (whole values, each run within one cache line), from the
    first value to the last: a call compares every bound weight's sample just after a kernel evicted the caches,
    where each line read is a miss (64 single bytes were 64 lines: 275 µs a call for a small CNN's 25 weights)."""

    SAMPLES = 64
    RUN = 8
    RUNS = SAMPLES // RUN

    def __init__(self, t: torch.Tensor, exact: bool = False) -> None:
        self.exact = exact
        #: the view reads the tensor's own memory (else a contiguous copy of it, taken again by every ``same``)
        self.in_place = t.is_cpu and t.is_contiguous()
        self.view = self._bytes(t)
        n = self.view.size
        self.index = None if exact or n <= self.SAMPLES else self.runs(n)
        self.seen = self._take()

    @classmethod
    def runs(cls, n: int) -> np.ndarray:
        """The sampled offsets of ``n`` bytes: runs that start on a multiple of :data:`RUN`, the last one ending
        at (or just before) the last byte."""
        starts = np.linspace(0, (n - cls.RUN) // cls.RUN, cls.RUNS).astype(np.intp) * cls.RUN
        return (starts[:, None] + np.arange(cls.RUN)).reshape(-1)

    @staticmethod
    def _bytes(t: torch.Tensor) -> np.ndarray:
        d = t.detach()
        if not (d.is_cpu and d.is_contiguous()):
            d = d.cpu().contiguous()  # a copy: compared each call (such a parameter is rare)
        return d.reshape(-1).view(torch.uint8).numpy()

    def _take(self) -> bytes:
        return (self.view if self.index is None else self.view[self.index]).tobytes()

    def same(self, t: torch.Tensor) -> bool:
        if not (self.in_place and t.is_cpu and t.is_contiguous()):  # a copy: taken again, or in place once more
            self.in_place = t.is_cpu and t.is_contiguous()
            self.view = self._bytes(t)
        return self._take() == self.seen

    def offsets(self) -> np.ndarray:
        """The sampled bytes' addresses."""
        index = np.arange(self.view.size) if self.index is None else self.index
        return self.view.__array_interface__["data"][0] + index


class SampleSet:
    """The samples of several :class:`Sampler` s compared in one numpy gather instead of one each: just after a
    kernel evicted the caches each took about 2.3 µs, 57 µs a call for a small CNN's 25 folded weights (18 in
    one gather, most of it the sampled lines' own misses).

    The gather reads an array that spans the memory from the lowest sampled byte to the highest, at the sampled
    offsets only: each lies in a view of a tensor's memory that this set holds (not only its sampler, which takes
    a new view where the tensor turns strided), so every byte read is live; where a tensor was given other memory
    since, the bytes are its old ones (:class:`TensorWatch` compares the addresses first). A sampler of a copy (a
    strided tensor's bytes, taken again each time) or of every byte of a large tensor (``exact``) is compared on
    its own.
    """

    def __init__(self, samplers: Sequence[tuple[Sampler, torch.Tensor]]) -> None:
        gathered = [s for s, _ in samplers if s.in_place and (s.index is not None or s.view.size <= Sampler.SAMPLES)]
        self.apart = tuple((s, t) for s, t in samplers if s not in gathered)
        self.views = tuple(s.view for s in gathered)  # the memory the gather reads, kept alive
        self.span: np.ndarray | None = None
        self.at = np.zeros(0, np.intp)
        self.seen = b"".join(s.seen for s in gathered)
        if gathered:
            addresses = np.concatenate([s.offsets() for s in gathered])
            low, high = int(addresses.min()), int(addresses.max()) + 1
            self.span = np.frombuffer(memoryview((ctypes.c_uint8 * (high - low)).from_address(low)), np.uint8)
            self.at = addresses - low

    def same(self) -> bool:
        """Are all sampled bytes as they were?"""
        if self.span is not None and self.span[self.at].tobytes() != self.seen:
            return False
        return all(s.same(t) for s, t in self.apart)


_version_of = operator.attrgetter("_version")
_shape_of = operator.attrgetter("shape")
_dtype_of = operator.attrgetter("dtype")


def layout_facts(tensors: Sequence[torch.Tensor]) -> tuple[list[int], list[Any], list[Any]]:
    """Each tensor's address, shape and dtype, a list of each (torch's getters mapped over the tensors)."""
    return list(map(torch.Tensor.data_ptr, tensors)), list(map(_shape_of, tensors)), list(map(_dtype_of, tensors))


class TensorWatch:
    """Tensors as they were: each one's version, memory, shape, dtype and contiguity, and its sampled bytes
    (:class:`Sampler`), compared a list at a time (torch's getters mapped over the list, the samples in one
    :class:`SampleSet` gather): a call makes these checks just after a kernel evicted the caches, where a
    Python step per tensor cost several times its warm time. It holds the tensors."""

    def __init__(self, watched: Sequence[tuple[torch.Tensor, Sampler]]) -> None:
        self.tensors = tuple(t for t, _ in watched)
        self.facts = self._facts()
        self.samples = SampleSet([(s, t) for t, s in watched])

    def _facts(self) -> tuple[list[Any], ...]:
        t = self.tensors
        return list(map(_version_of, t)), *layout_facts(t), list(map(torch.Tensor.is_contiguous, t))

    def same(self) -> bool:
        """Is every tensor unwritten (its version, and the sampled bytes of a write through ``.data``), in the same
        memory and of the same layout?"""
        return not self.tensors or (self._facts() == self.facts and self.samples.same())


class StateWatch:
    """A module's bound parameters and buffers as the last call found them: each still the tensor its holder (the
    submodule's ``_parameters``, ``_buffers`` or ``__dict__``) holds under its name, the holder still the
    submodule's, and each tensor as it was (:class:`TensorWatch`). ``same()`` true: the arrays bound then are
    still the right ones. It holds what it compares by id, so no new object can take an old one's id."""

    def __init__(self, owners: Sequence[tuple[nn.Module, str]], held: Sequence[Held]) -> None:
        places = [_place(o, n) for o, n in owners]
        slotted = [(o.__dict__, slot) for (o, _), (_, slot) in zip(owners, places, strict=True) if slot]
        self.module_dicts = tuple(d for d, _ in slotted)
        self.slots = tuple(slot for _, slot in slotted)
        self.holders = tuple(h for h, _ in places)
        self.names = tuple(n for _, n in owners)
        self.found = tuple(map(dict.get, self.holders, self.names))
        self.ids = [id(x) for x in self.found]
        self.slot_ids = [id(d[slot]) for d, slot in slotted]
        self.tensors = TensorWatch([(h.tensor, h.sample) for h in held])

    def same(self) -> bool:
        return (list(map(id, map(dict.get, self.module_dicts, self.slots))) == self.slot_ids
                and list(map(id, map(dict.get, self.holders, self.names))) == self.ids
                and self.tensors.same())


def _place(owner: nn.Module, name: str) -> tuple[dict[str, Any], str]:
    """The dict of ``owner`` that holds its attribute ``name`` and its slot: ``_parameters``, ``_buffers``, or
    ``__dict__`` itself ('')."""
    for slot in ("_parameters", "_buffers"):
        holder = owner.__dict__.get(slot)
        if isinstance(holder, dict) and name in holder:
            return holder, slot
    return owner.__dict__, ""


class BoundInputs:
    """A planned module's graph inputs, its parameters and buffers converted once.

    Each call converts only the call inputs. A parameter or buffer that changed since it was converted is
    converted again: replaced by another tensor, updated in place (torch's version counter moved), given new
    memory (``param.data = ...``), or written through ``.data`` (which bypasses the version counter: a sample of
    its bytes changed; ``exact`` compares every byte). Bound arrays are read-only: views of the tensor's own
    memory where it is stored as the kernels read it (eager torch and the plan then share one copy of the
    weights in memory and in cache), converted copies otherwise.
    """

    def __init__(self, imported: ImportedModule, module: nn.Module | Mapping[str, torch.Tensor] | None,
                 exact: bool = False) -> None:
        self.imported = imported
        self.module = module
        self.exact = exact
        self._bound: dict[str, Held] = {}
        self._packed: dict[str, list[Held]] = {}
        self._owners: dict[str, tuple[Any, str]] = {}  # key -> (the submodule holding it, its attribute name)
        self.conversions = 0  # parameters and buffers converted so far (tests count them)
        #: the parameters', buffers' and constants' arrays of the last call, and what says they still hold
        self._state: dict[str, np.ndarray] = {}
        self._watch: StateWatch | None = None
        #: the call inputs' arrays of the last guarded call and the feed made of them
        self._fed_from: Sequence[np.ndarray] | None = None
        self._fed: dict[str, np.ndarray] = {}

    def rebind(self) -> None:
        """Forget every bound parameter and the submodules found for them: the next call finds and converts
        them all again."""
        self._bound.clear()
        self._packed.clear()
        self._owners.clear()
        self._watch = None

    def feed(self, args: Sequence[Any]) -> dict[str, np.ndarray]:
        return self.feed_checked(self.imported.check_args(args))

    def feed_checked(self, flat: Sequence[torch.Tensor], arrays: Sequence[np.ndarray] | None = None
                     ) -> dict[str, np.ndarray]:
        """:meth:`feed` of call inputs ``check_args`` passed (flattened); ``arrays``: fp32 or 16-bit host inputs as
        numpy arrays over their memory (``guards.call_layout``). The same ``arrays`` list again, the state
        unchanged: the same feed, its arrays the same objects (read only: the backend finds them bound)."""
        if arrays is not None and arrays is self._fed_from and self._watch is not None and self._watch.same():
            return self._fed
        out = self._state_feed()
        for b in self._args:
            i = int(b.key)  # type: ignore[arg-type]
            a = arrays[i] if arrays is not None else None
            out[b.name] = graph_array(a, b.transpose) if a is not None and a.flags.c_contiguous else to_numpy(
                flat[i], b.transpose)
        self._fed_from, self._fed = arrays, out
        return out

    @functools.cached_property
    def _args(self) -> tuple[Binding, ...]:
        return tuple(b for b in self.imported.bindings if b.source == "arg")

    def _state_feed(self) -> dict[str, np.ndarray]:
        """The graph inputs that are not call inputs: the arrays of the last call where the :class:`StateWatch`
        says they still hold, else each parameter and buffer found, checked and converted where it changed."""
        if self._watch is not None and self._watch.same():
            return dict(self._state)
        state: dict[str, np.ndarray] = {}
        for b in self.imported.bindings:
            if b.source == "const":
                state[b.name] = self.imported.constants[b.name]
            elif b.source == "packed":
                state[b.name] = self._packed_input(b)
            elif b.source == "state":
                state[b.name] = self._state_input(b)
        self._state = state
        self._watch = self._new_watch()
        return dict(state)

    def _new_watch(self) -> StateWatch | None:
        """A watch over every bound parameter and buffer as found just now (None for a state dict)."""
        if not isinstance(self.module, nn.Module):
            return None
        owners, held = [], []
        for b in self.imported.bindings:
            if b.source == "state":
                owners.append(self._owners[str(b.key)])
                held.append(self._bound[b.name])
            elif b.source == "packed":
                owners += [self._owners[str(k)] for k in b.key]  # type: ignore[union-attr]
                held += self._packed[b.name]
        return StateWatch(owners, held)

    def _state_tensor(self, key: str) -> torch.Tensor | None:
        """The parameter or buffer ``key``, read from its submodule on every call (a reassigned parameter is
        seen); the submodule itself is found once (``get_submodule`` walked the path for a few µs a binding)."""
        if not isinstance(self.module, nn.Module):  # a state dict (or nothing)
            return (self.module or {}).get(key)
        owner = self._owners.get(key)
        if owner is None:
            path, _, name = key.rpartition(".")
            try:
                owner = self._owners[key] = (self.module.get_submodule(path), name)
            except AttributeError:
                return None
        t = getattr(owner[0], owner[1], None)
        return t if isinstance(t, torch.Tensor) else None

    def _state_input(self, b: Binding) -> np.ndarray:
        t = self._state_tensor(str(b.key))
        if t is None:
            raise TorchImportError(f"module has no parameter or buffer {b.key!r} (graph input {b.name!r})")
        bound = self._bound.get(b.name)
        if bound is not None and bound.fresh(t):
            return bound.array
        arr = to_numpy(t, b.transpose)  # a view where the tensor's memory has the stored layout
        arr.setflags(write=False)
        self._bound[b.name] = Held(t, t._version, t.data_ptr(), arr, Sampler(t, self.exact))
        self.conversions += 1
        return arr


    def _packed_input(self, b: Binding) -> np.ndarray:
        """Parameters side by side (weights by columns, biases end to end), made again when one changed."""
        keys = [str(k) for k in b.key]  # type: ignore[union-attr]
        tensors = [self._state_tensor(k) for k in keys]
        if any(t is None for t in tensors):
            missing = keys[[t is None for t in tensors].index(True)]
            raise TorchImportError(f"module has no parameter or buffer {missing!r} (packed graph input {b.name!r})")
        ts: list[torch.Tensor] = tensors  # type: ignore[assignment]
        held = self._packed.get(b.name)
        if held is not None and len(held) == len(ts) and all(h.fresh(t) for h, t in zip(held, ts, strict=True)):
            return held[0].array
        with torch.no_grad():
            packed = torch.cat([t.detach() for t in ts], 0)  # (sum N_i, K): nn.Linear's layout, read transposed
        arr = to_numpy(packed, b.transpose)
        arr.setflags(write=False)
        self._packed[b.name] = [Held(t, t._version, t.data_ptr(), arr, Sampler(t, self.exact)) for t in ts]
        self.conversions += 1
        return arr


def _index_array(t: torch.Tensor, transpose: bool) -> np.ndarray:
    """Integer indices (token ids, an attention mask) as the fp32 a plan carries them in, exact below
    :data:`INDEX_LIMIT`: converted by numpy from the tensor's memory on the host (each torch call cost tens of µs
    just after a plan's kernels evicted the caches)."""
    host = t.detach().cpu()
    a = (host.t() if transpose else host).numpy().astype(np.float32, order="C")
    if a.size and float(np.abs(a).max()) >= INDEX_LIMIT:  # a float32 rounded from 2**24 or more is 2**24 or more
        raise TorchImportError(f"integer input {describe_tensor(t)} holds values of {INDEX_LIMIT} or more: a plan "
                               "carries indices as fp32, exact only below that")
    return a.reshape(flat_shape(a.shape))


def graph_array(a: np.ndarray, transpose: bool = False) -> np.ndarray:
    """A C-ordered array over a tensor's memory (fp32, or a 16-bit dtype's) as the graph input reads it: flattened
    to its IR shape, or a Linear weight (N, K) read as (K, N), its transpose (a view: the GEMM library takes either
    order)."""
    return a.T if transpose else a.reshape(flat_shape(a.shape))


def to_numpy(t: torch.Tensor, transpose: bool = False) -> np.ndarray:
    if t.dtype in INDEX_DTYPES:
        return _index_array(t, transpose)
    if t.dtype == torch.float32 and t.is_cpu and t.is_contiguous():
        # the tensor's own memory: no conversion on the way
        return graph_array((t.detach() if t.requires_grad else t).numpy(), transpose)
    t = t.detach()
    if t.dtype in BITS_16:  # 16-bit: an array of its own dtype over the tensor's bits (a view where contiguous)
        bits = t.cpu().contiguous().view(torch.int16).numpy().view(numpy_dtype(TORCH_DTYPES[t.dtype]))
        return bits.T if transpose else bits.reshape(flat_shape(bits.shape))
    if transpose:
        t = t.t()
    a = t.to(torch.float32).cpu().contiguous().numpy()
    return a.reshape(flat_shape(a.shape))
