"""What a plan of a module assumed, checked before each call, as torch.compile's guards do.

A plan is the module's computation traced once: Python attributes it read (``self.scale``, ``ln.eps``), the
``training`` flags, the submodules it called and the layouts of the parameters and buffers it reads are baked
into it. :class:`ModuleState` records them when the plan is made; :meth:`ModuleState.changed` names the first
that differs now (a replaced submodule, an attribute set, ``train()``, a parameter of another shape). The call
inputs' layouts are the plan's :class:`InputSignature`. Tensors replaced by others of the same layout, or written
in place, are :class:`planner.torch.binding.BoundInputs`' business: they are bound again, not re-planned.

Forward hooks are guarded too: one registered anywhere after planning (every registration takes a number from
``RemovableHandle.next_id``, read as one integer), or one the plan ran removed, is a change of the module; so is
any other object set on a module's instance (``m.forward = ...``, ``m.act = F.gelu``, ``m.config = ...``), a
plain value inside an object a module holds, up to :data:`HELD_DEPTH` objects deep (``m.config.scale = 2``,
``m.config.text_config.scale = 2``), and a list of plain values changed in place (``m.sizes.append(3)``).

So is the code the forward runs: each module class's methods and class attributes (``nn.Linear.forward = ...``,
``Block.scale = 2``), the global variables the methods of the tree's own classes (not torch's) name and the
functions they call name (``SCALE = 2``, ``ACT = torch.tanh``), and the variables they close over.
"""

from __future__ import annotations

import copy
import gc
import logging
import operator
import types
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn
from torch.utils import _pytree as pytree

from planner.core.dtypes import numpy_dtype
from planner.torch.binding import Sampler, TensorWatch, layout_facts
from planner.torch.errors import TorchImportError
from planner.torch.tracing import forward_hook_dicts

log = logging.getLogger(__name__)

_MISSING = object()
#: Python values an attribute guard compares (a tensor attribute is bound, not guarded)
_PLAIN = (bool, int, float, str, type(None))


def _plain(v: Any, depth: int = 0) -> bool:
    if isinstance(v, _PLAIN):
        return True
    return isinstance(v, (tuple, list)) and depth < 2 and len(v) <= 16 and all(_plain(x, depth + 1) for x in v)


def _mutable(v: Any) -> bool:
    """A plain value that can change in place: a list, or a tuple holding one."""
    return isinstance(v, list) or isinstance(v, tuple) and any(map(_mutable, v))


def _snapshot(v: Any) -> Any:
    """``v`` as it is now: a plain value that can change in place copied (it then differs from its copy)."""
    return copy.deepcopy(v) if _plain(v) and _mutable(v) else v


def _same(a: Any, b: Any) -> bool:
    """The same object, or an equal one of the same type (an object whose ``==`` answers no plain bool, a numpy
    array's elementwise answer, is the same only as itself)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    try:
        equal = a == b
    except Exception:  # an object whose comparison fails is not known to be the same
        return False
    return equal if isinstance(equal, bool) else False


def _guarded_attrs(m: nn.Module) -> dict[str, Any]:
    """The instance attributes of ``m`` a plan may have read: plain values, callables and other objects it holds
    (a config), each compared as the object it was or an equal one; not its submodules and tensors (held in its
    holders, and guarded or bound there)."""
    return _guarded_in(vars(m))


def _guarded_in(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if not k.startswith("_") and not isinstance(v, (nn.Module, torch.Tensor))}


def _plain_items(d: dict[Any, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if isinstance(k, str) and not k.startswith("__") and _plain(v)}


#: objects held this many levels below a module are guarded (``self.config.text_config.scale``: 2)
HELD_DEPTH = 3
#: at most this many held objects are guarded (a module holding a large object graph)
MAX_HELD = 64


def _held_dicts(module: nn.Module) -> list[tuple[str, dict[Any, Any]]]:
    """(where, its attributes) of each object other than a callable that a module of the tree holds (a config, a
    namespace, a dict), and the objects those hold, :data:`HELD_DEPTH` levels down: the plain values in them are
    what a forward reads (``self.config.scale``, ``self.config.text_config.scale``); once each, the nearest first,
    at most :data:`MAX_HELD`."""
    seen: set[int] = set()
    out: list[tuple[str, dict[Any, Any]]] = []
    queue = deque((_join(path, k), v, 1) for path, m in module.named_modules() for k, v in _guarded_attrs(m).items())
    while queue and len(out) < MAX_HELD:
        where, v, depth = queue.popleft()
        d = _attributes_of(v)
        if d is None or id(d) in seen:
            continue
        seen.add(id(d))
        out.append((where, d))
        if depth < HELD_DEPTH:
            queue.extend((_join(where, k), x, depth + 1) for k, x in d.items()
                         if isinstance(k, str) and not k.startswith("__") and not isinstance(x, (nn.Module, torch.Tensor)))
    return out


#: classes whose dicts are not guarded: every object's and every module's (patching those is patching Python or
#: torch itself)
_UNGUARDED_CLASSES = (object, nn.Module)


def _classes(module: nn.Module) -> list[type]:
    """The classes of the tree's modules and their bases, but :data:`_UNGUARDED_CLASSES`; once each."""
    return list(dict.fromkeys(c for m in module.modules() for c in type(m).__mro__ if c not in _UNGUARDED_CLASSES))


def _class_dict(cls: type) -> dict[str, Any]:
    """The dict behind ``cls.__dict__`` (a read-only proxy): the one whose version tag a change of the class moves."""
    return next(d for d in gc.get_referents(cls.__dict__) if isinstance(d, dict))


def _torchs(obj: Any) -> bool:
    """Is ``obj`` (a class or a function) torch's own code? (A function made by ``exec`` may have no module.)"""
    return (getattr(obj, "__module__", None) or "").split(".")[0] == "torch"


def _class_items(d: dict[str, Any]) -> dict[str, Any]:
    """A class's methods and class attributes a forward may use (not its dunders, which Python itself keeps)."""
    return {k: v for k, v in d.items() if not k.startswith("__") or k == "__call__"}


def _functions(classes: Sequence[type]) -> list[tuple[str, types.FunctionType]]:
    """(where, function) of each method of the classes that are not torch's own."""
    out = []
    for cls in classes:
        if _torchs(cls):
            continue
        for k, v in vars(cls).items():
            fn = v.__func__ if isinstance(v, (staticmethod, classmethod)) else v
            if isinstance(fn, types.FunctionType):
                out.append((f"{cls.__qualname__}.{k}", fn))
    return out


def _code_names(code: types.CodeType) -> set[str]:
    """The names ``code`` and the code nested in it (comprehensions, lambdas, inner functions) load."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _code_names(c)
    return names


def _code_reads(module: nn.Module, classes: Sequence[type]
                ) -> tuple[list[tuple[str, dict[str, Any], str]], list[tuple[str, types.CellType]]]:
    """The global variables the methods of the tree's own classes name, and the functions they name in turn (two
    calls deep): (the function, its globals, the name), modules left out (``torch``, ``F``); and the variables
    they close over: (the function, the cell)."""
    globals_read: list[tuple[str, dict[str, Any], str]] = []
    cells: list[tuple[str, types.CellType]] = []
    queue = deque((where, fn, 0) for where, fn in _functions(classes))
    seen: set[int] = set()
    while queue:
        where, fn, depth = queue.popleft()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        g = fn.__globals__
        for name in sorted(_code_names(fn.__code__)):
            v = g.get(name, _MISSING)
            if v is _MISSING or isinstance(v, types.ModuleType):
                continue
            globals_read.append((where, g, name))
            if isinstance(v, types.FunctionType) and depth < 2 and not _torchs(v):
                queue.append((v.__qualname__, v, depth + 1))
        for cell in fn.__closure__ or ():
            try:
                cell.cell_contents  # noqa: B018 - an empty cell (a name not bound yet) is not read
            except ValueError:
                continue
            cells.append((where, cell))
    return globals_read, cells


def _attributes_of(v: Any) -> dict[Any, Any] | None:
    """A held object's attributes: a dict itself, else its ``__dict__``; None for a plain value or a callable."""
    if isinstance(v, dict):
        return v
    if _plain(v) or callable(v):
        return None
    d = getattr(v, "__dict__", None)
    return d if isinstance(d, dict) else None


def _hook_count() -> int | None:
    """How many hooks torch has handed out handles for, anywhere (``RemovableHandle.next_id``; None where this
    torch keeps no such count: every hook dict is then compared)."""
    count = getattr(torch.utils.hooks.RemovableHandle, "next_id", None)
    return count if isinstance(count, int) else None


#: the dicts of a module that hold its submodules, parameters and buffers
_HOLDERS = ("_modules", "_parameters", "_buffers")
#: a dict's version tag (PEP 509: a new one at every change of the dict), as torch.compile's guards read it; None
#: where this torch or Python has none (the dicts are then compared by the ids of what they hold)
_dict_version: Callable[[dict[str, Any]], int] | None = getattr(
    getattr(getattr(torch._C, "_dynamo", None), "guards", None), "dict_version", None)


@dataclass(frozen=True, eq=False)
class QuickCheck:
    """:meth:`ModuleState.changed`'s first look, made for a call just after a kernel evicted the caches, where
    every Python call costs several times its warm time (a small CNN's guard took 140-210 µs a call, one object at
    a time). It compares, a module or a list at a time: each module's plain attributes and the dicts that hold its
    submodules, parameters and buffers, those dicts' keys and values, all as the very objects they were (it holds
    them, so no new object can take an old one's id); each state tensor's layout and memory; each derived tensor's
    version too, and their sampled bytes in one gather (:class:`TensorWatch`). ``same()`` true: nothing the state
    guards changed. False says only: look closer (an attribute set to an equal value, a bound tensor written in
    place). Where Python gives dicts version tags (PEP 509, read as torch.compile's guards read them), every dict is
    compared by its tag alone: unchanged tags mean unchanged dicts, and the ids are not looked at."""

    #: every dict compared, and its version tag when this was made (empty where there are none)
    dicts: tuple[dict[str, Any], ...]
    versions: list[int]
    #: per module: its ``__dict__``, the keys looked at (plain attributes and the holders), a default per key,
    #: the ids of the values
    attrs: tuple[tuple[dict[str, Any], tuple[str, ...], tuple[object, ...], list[int]], ...]
    holders: tuple[dict[str, Any], ...]
    sizes: list[int]
    key_ids: list[int]
    value_ids: list[int]
    #: the state tensors whose layout the plan assumed, and their addresses, shapes and dtypes (``layout_facts``)
    layouts: tuple[torch.Tensor, ...]
    layout_facts: tuple[list[int], list[Any], list[Any]]
    #: the tensors values at import were computed from
    derived: TensorWatch
    #: every object whose id is compared, held so that none can be freed and its id reused
    held: tuple[Any, ...]
    #: ``RemovableHandle.next_id`` then: any hook registered since moves it (None: the hook dicts are in ``dicts``)
    hook_count: int | None = None
    #: each module's ``__dict__`` and its size, compared where dicts have no version tags
    module_dicts: tuple[dict[str, Any], ...] = ()
    module_sizes: list[int] = field(default_factory=list)
    #: the global variables read, as ``attrs`` holds them, compared by the ids of their values at every call (a
    #: module's globals change as a script runs: their version tags would send every call to the closer look)
    globals_read: tuple[tuple[dict[str, Any], tuple[str, ...], tuple[object, ...], list[int]], ...] = ()
    #: the variables the methods close over, and the ids of their values
    cells: tuple[types.CellType, ...] = ()
    cell_ids: list[int] = field(default_factory=list)
    #: each plain value that can change in place (a list), and its copy
    mutables: tuple[tuple[Any, Any], ...] = ()

    @classmethod
    def of(cls, module: nn.Module, state: ModuleState) -> QuickCheck:
        modules = list(module.modules())
        attrs, kept = [], []
        held = tuple(d for _, d in _held_dicts(module))
        classes = tuple(d for _, d, _ in state.classes)
        watched = [(m.__dict__, {*_guarded_in(m.__dict__), *_HOLDERS}) for m in modules]
        watched += [(h, set(_plain_items(h))) for h in held] + [(d, set(_class_items(d))) for d in classes]
        for d, guarded in watched:
            keys = tuple(k for k in d if k in guarded)
            values = [d[k] for k in keys]
            kept += values
            attrs.append((d, keys, (_MISSING,) * len(keys), [id(v) for v in values]))
        globals_read = []
        for g, read in _by_dict((g, name) for _, g, name, _ in state.globals_read):
            values = [g.get(n, _MISSING) for n in read]
            kept += values
            globals_read.append((g, read, (_MISSING,) * len(read), [id(v) for v in values]))
        cells = tuple(c for _, c, _ in state.cells)
        kept += [c.cell_contents for c in cells]
        mutables = tuple((v, _snapshot(v)) for v in kept if _plain(v) and _mutable(v))
        holders = tuple(h for m in modules for h in (m._modules, m._parameters, m._buffers) if h)
        names = [k for h in holders for k in h]
        members = [v for h in holders for v in h.values()]
        layouts = tuple(t for t in (getattr(o, n, None) for o, _, n, *_ in state.tensors) if isinstance(t, torch.Tensor))
        hook_count = _hook_count()
        # a hook registered moves the count; one removed changes its dict, so the dicts that hold hooks are watched
        hooks = tuple(d for _, d in forward_hook_dicts(module) if d or hook_count is None)
        dicts = (tuple(d for m in modules for d in (m.__dict__, m._modules, m._parameters, m._buffers)) + held + hooks
                 + classes)
        module_dicts = tuple(m.__dict__ for m in modules) + held + hooks + classes
        return cls(
            dicts, list(map(_dict_version, dicts)) if _dict_version is not None else [],
            tuple(attrs), holders, [len(h) for h in holders], [id(k) for k in names], [id(v) for v in members],
            layouts, layout_facts(layouts),
            TensorWatch([(s.tensor, s.sample) for *_, s in state.derived]),
            (tuple(kept), tuple(names), tuple(members)), hook_count, module_dicts, list(map(len, module_dicts)),
            tuple(globals_read), cells, [id(c.cell_contents) for c in cells], mutables,
        )

    def same(self) -> bool:
        if self.hook_count is not None and _hook_count() != self.hook_count:
            return False
        if not self._dicts_same() or not self._code_same():
            return False
        return (not self.layouts or layout_facts(self.layouts) == self.layout_facts) and self.derived.same()

    def _code_same(self) -> bool:
        for d, keys, missing, ids in self.globals_read:
            if list(map(id, map(d.get, keys, missing))) != ids:
                return False
        if self.cells:
            try:
                if list(map(id, map(_CONTENTS, self.cells))) != self.cell_ids:
                    return False
            except ValueError:  # one is unbound now
                return False
        return all(v == copied for v, copied in self.mutables)

    def _dicts_same(self) -> bool:
        if _dict_version is not None and self.versions:
            return list(map(_dict_version, self.dicts)) == self.versions
        for d, keys, missing, ids in self.attrs:
            if list(map(id, map(d.get, keys, missing))) != ids:
                return False
        return (list(map(len, self.module_dicts)) == self.module_sizes
                and list(map(len, self.holders)) == self.sizes
                and list(map(id, chain.from_iterable(self.holders))) == self.key_ids
                and list(map(id, chain.from_iterable(map(dict.values, self.holders)))) == self.value_ids)


_CONTENTS = operator.attrgetter("cell_contents")


def _contents(cell: types.CellType) -> Any:
    """A closed-over variable's value; :data:`_MISSING` once it is unbound (``del`` in its scope)."""
    try:
        return cell.cell_contents
    except ValueError:
        return _MISSING


def _by_dict(pairs: Iterable[tuple[dict[str, Any], str]]) -> list[tuple[dict[str, Any], tuple[str, ...]]]:
    """(dict, name) pairs grouped by dict: (the dict, its names), each name once."""
    grouped: dict[int, tuple[dict[str, Any], dict[str, None]]] = {}
    for d, name in pairs:
        grouped.setdefault(id(d), (d, {}))[1][name] = None
    return [(d, tuple(names)) for d, names in grouped.values()]


@dataclass(eq=False)
class ModuleState:
    """A module tree as its plan assumed it: each submodule edge, each plain attribute, each state tensor's
    layout."""

    #: (parent, its path, child name, the child)
    edges: tuple[tuple[nn.Module, str, str, nn.Module], ...]
    #: (module, its path, attribute, value)
    attrs: tuple[tuple[nn.Module, str, str, Any], ...]
    #: (owner module, the tensor's path, attribute, shape, dtype, device)
    tensors: tuple[tuple[nn.Module, str, str, tuple[int, ...], torch.dtype, torch.device], ...]
    #: (owner module, the tensor's path, attribute, the tensor as it was) for the parameters and buffers that
    #: values the plan holds were computed from at import: any write to them is a change of the module
    derived: tuple[tuple[nn.Module, str, str, StateSnapshot], ...] = ()
    #: (where, hook dict, its keys) of each forward hook dict of the tree and the global ones
    hooks: tuple[tuple[str, dict[Any, Any], tuple[Any, ...]], ...] = ()
    #: (where, the attributes of an object a module holds, their plain values then) (:func:`_held_dicts`)
    held: tuple[tuple[str, dict[Any, Any], dict[str, Any]], ...] = ()
    #: (class, its dict, its methods and class attributes then) of each class of the tree's modules
    classes: tuple[tuple[type, dict[str, Any], dict[str, Any]], ...] = ()
    #: (the function reading it, its globals, the name, the value then) of each global variable read
    globals_read: tuple[tuple[str, dict[str, Any], str, Any], ...] = ()
    #: (the function, the cell, its value then) of each variable a method closes over
    cells: tuple[tuple[str, types.CellType, Any], ...] = ()
    #: the module, for :class:`QuickCheck` (None: every check looks closer)
    module: nn.Module | None = None
    quick: QuickCheck | None = field(default=None, repr=False)

    @classmethod
    def record(cls, module: nn.Module, state_keys: Sequence[str] = (), folded_from: Sequence[str] = ()) -> ModuleState:
        edges, attrs = [], []
        for path, m in module.named_modules(remove_duplicate=False):
            edges += [(m, path, name, child) for name, child in m._modules.items() if child is not None]
            attrs += [(m, path, k, _snapshot(v)) for k, v in _guarded_attrs(m).items()]
        tensors = [(owner, key, name, tuple(t.shape), t.dtype, t.device) for owner, key, name, t in _state(module, state_keys)]
        derived = [(owner, key, name, StateSnapshot.of(t)) for owner, key, name, t in _state(module, folded_from)]
        hooks = tuple((where or "the module itself", d, tuple(d)) for where, d in forward_hook_dicts(module))
        held = tuple((where, d, _snapshots(_plain_items(d))) for where, d in _held_dicts(module))
        classes = _classes(module)
        class_items = tuple((c, d, _snapshots(_class_items(d))) for c, d in ((c, _class_dict(c)) for c in classes))
        globals_read, cells = _code_reads(module, classes)
        state = cls(tuple(edges), tuple(attrs), tuple(tensors), tuple(derived), hooks, held, class_items,
                    tuple((where, g, name, _snapshot(g[name])) for where, g, name in globals_read),
                    tuple((where, c, _snapshot(c.cell_contents)) for where, c in cells), module)
        state.quick = QuickCheck.of(module, state)
        return state

    def changed(self) -> str | None:
        """What differs from when the plan was made (the first thing found), or None. The :class:`QuickCheck`
        answers most calls; where it cannot, every guarded fact is compared, and if none differs the quick check
        is made again from the module as it is now."""
        if self.quick is not None and self.quick.same():
            return None
        reason = self._compare()
        if reason is None and self.module is not None:
            self.quick = QuickCheck.of(self.module, self)
        return reason

    def _compare(self) -> str | None:
        for parent, path, name, child in self.edges:
            if parent._modules.get(name) is not child:
                return f"submodule {_join(path, name)} was replaced"
        for m, path, k, v in self.attrs:
            now = m.__dict__.get(k, _MISSING)
            if not _same(now, v):
                was = "removed" if now is _MISSING else f"set to {_short(now)}"
                return f"{_join(path, k)} was {_short(v)} when planned, is {was} now"
        added = self._attribute_added()
        if added is not None:
            return added
        for where, d, items in self.held:
            now = _plain_items(d)
            for k in {*items, *now}:
                if not _same(now.get(k, _MISSING), items.get(k, _MISSING)):
                    return f"{_join(where, k)} was {_then(items, k)} when planned, is {_now(now, k)} now"
        code = self._code_changed()
        if code is not None:
            return code
        for where, d, keys in self.hooks:
            if tuple(d) != keys:
                return f"a forward hook was registered on or removed from {where} after planning"
        for owner, key, name, shape, dtype, device in self.tensors:
            t = getattr(owner, name, None)
            if not isinstance(t, torch.Tensor):
                return f"parameter or buffer {key} is gone"
            # is_cpu before device: making a torch.device is among the costlier calls just after a kernel
            if t.shape != shape or t.dtype != dtype or not (t.is_cpu if device.type == "cpu" else t.device == device):
                return (f"parameter or buffer {key} is {list(t.shape)} {_dtype(t.dtype)} on {t.device}, planned for "
                        f"{list(shape)} {_dtype(dtype)} on {device}")
        for owner, key, name, snapshot in self.derived:
            if not snapshot.fresh(getattr(owner, name, None)):
                return f"parameter or buffer {key}, from which the plan computed a value at import, was written"
        return None

    def _code_changed(self) -> str | None:
        """A class's method or attribute, a global variable or a closed-over variable that differs, named."""
        for c, d, items in self.classes:
            now = _class_items(d)
            for k in {*items, *now}:
                if not _same(now.get(k, _MISSING), items.get(k, _MISSING)):
                    return f"{c.__qualname__}.{k} (of the class) was {_then(items, k)} when planned, is {_now(now, k)} now"
        for where, g, name, v in self.globals_read:
            if not _same(g.get(name, _MISSING), v):
                return f"global {name} (read by {where}) was {_short(v)} when planned, is {_now(g, name)} now"
        for where, cell, v in self.cells:
            now = _contents(cell)
            if not _same(now, v):
                is_now = "unbound" if now is _MISSING else f"set to {_short(now)}"
                return f"a variable {where} closes over was {_short(v)} when planned, is {is_now} now"
        return None

    def _attribute_added(self) -> str | None:
        """An attribute set on a module of the tree since planning (one :func:`_guarded_attrs` takes), named."""
        planned = {(id(m), k) for m, _, k, _ in self.attrs}
        tree = [("", self.module)] if self.module is not None else []
        tree += [(_join(path, name), child) for _, path, name, child in self.edges]
        for where, m in tree:
            for k, v in _guarded_attrs(m).items():
                if (id(m), k) not in planned:
                    return f"{_join(where, k)} was set to {_short(v)} after planning"
        return None


def _state(module: nn.Module, keys: Sequence[str]) -> list[tuple[nn.Module, str, str, torch.Tensor]]:
    """(owner module, key, attribute, tensor) of each parameter or buffer ``keys`` name that is a tensor now."""
    out = []
    for key in keys:
        path, _, name = key.rpartition(".")
        owner = module.get_submodule(path)
        t = getattr(owner, name, None)
        if isinstance(t, torch.Tensor):
            out.append((owner, key, name, t))
    return out


@dataclass(frozen=True, eq=False)
class StateSnapshot:
    """A tensor as a plan read it at import: the object, its version, its memory and a sample of its bytes (a
    write through ``.data`` bypasses the version counter)."""

    tensor: torch.Tensor
    version: int
    ptr: int
    sample: Sampler
    shape: torch.Size
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> StateSnapshot:
        return cls(t, t._version, t.data_ptr(), Sampler(t), t.shape, t.dtype)

    def fresh(self, t: Any) -> bool:
        """The same tensor, unwritten, of the same layout (``p.data = p.data.view(...)`` keeps memory and version)."""
        return (t is self.tensor and t._version == self.version and t.data_ptr() == self.ptr
                and t.shape == self.shape and t.dtype == self.dtype and self.sample.same(t))


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _snapshots(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _snapshot(v) for k, v in d.items()}


def _then(d: dict[str, Any], k: str) -> str:
    return _short(d[k]) if k in d else "not there"


def _now(d: dict[str, Any], k: str) -> str:
    return "removed" if k not in d else f"set to {_short(d[k])}"


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _dtype(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


#: the layout of one call input a plan is made for
ArgLayout = tuple[Any, ...]


def input_signature(args: Sequence[Any]) -> tuple[ArgLayout, ...]:
    """The call inputs' layouts a plan is made for: each tensor's shape, dtype, device and whether it is
    contiguous; another Python value as itself (it was baked into the plan)."""
    return call_layout(args)[0]


def call_layout(args: Sequence[Any]) -> tuple[tuple[ArgLayout, ...], list[np.ndarray] | None]:
    """:func:`input_signature`, and where every input is a plain host tensor of fp32 or a 16-bit dtype that needs no
    grad, each one as a numpy array over its memory (else None): fp32 and fp16 as numpy's, bf16 as ml_dtypes'
    bfloat16 over its bits. Such a call reads each tensor's layout from its array: one or two torch calls a
    tensor, where each distinct torch getter costs tens of µs just after a kernel evicted the caches."""
    plain = all(type(a) is torch.Tensor for a in args)
    found = _host_arrays(args) if plain else None
    if found is not None:
        views, dtypes = found
        return tuple((a.shape, d, "cpu", a.flags.c_contiguous) for a, d in zip(views, dtypes, strict=True)), views
    flat = list(args) if plain else pytree.tree_flatten(tuple(args))[0]
    out: list[ArgLayout] = []
    for a in flat:
        if isinstance(a, torch.Tensor):
            out.append((tuple(a.shape), a.dtype, a.device.type, a.is_contiguous()))
        else:
            out.append(("value", repr(a)[:200]))
    return tuple(out), None


#: the numpy dtype of a host tensor's array over its memory, by the torch dtypes a plan takes (bf16: its bits)
_HOST_DTYPES = {torch.float32: None, torch.float16: None, torch.bfloat16: numpy_dtype("bf16")}


def _host_arrays(args: Sequence[torch.Tensor]) -> tuple[list[np.ndarray], list[torch.dtype]] | None:
    arrays, dtypes = [], []
    for a in args:
        dtype = a.dtype
        if dtype not in _HOST_DTYPES:
            return None
        bits = _HOST_DTYPES[dtype]
        if bits is not None and a.requires_grad:  # its int16 view would need none
            return None
        try:  # numpy() refuses a tensor that needs grad, off the host, conjugated or negated
            arrays.append(a.numpy() if bits is None else a.view(torch.int16).numpy().view(bits))
        except (RuntimeError, TypeError):
            return None
        dtypes.append(dtype)
    return arrays, dtypes


def unplannable(args: Sequence[Any]) -> str | None:
    """Why no plan can take these call inputs, whatever their shapes (a plan runs on the host and computes no
    gradients), or None."""
    flat = list(args) if all(type(a) is torch.Tensor for a in args) else pytree.tree_flatten(tuple(args))[0]
    for i, a in enumerate(flat):
        if not isinstance(a, torch.Tensor):
            continue
        if not a.is_cpu:
            return f"input {i} is on {a.device}; a plan takes host tensors: pass it with .cpu()"
        if a.requires_grad and torch.is_grad_enabled():
            return (f"input {i} requires grad, but a plan computes no gradients: call it under torch.no_grad() or "
                    "torch.inference_mode(), or pass the input detached")
    return None


def describe_signature(sig: Sequence[ArgLayout]) -> str:
    parts = []
    for a in sig:
        if a and a[0] == "value":
            parts.append(str(a[1]))
        else:
            shape, dtype, device, contiguous = a
            parts.append(f"{list(shape)} {_dtype(dtype)}" + ("" if device == "cpu" else f" on {device}")
                         + ("" if contiguous else " (strided)"))
    return ", ".join(parts)


def _tensor_facts(t: torch.Tensor) -> tuple[Any, ...]:
    return t.data_ptr(), t.shape, t.dtype, t.is_contiguous(), t.requires_grad, t.is_cpu


@dataclass(frozen=True, eq=False)
class LastCall:
    """The host tensors of the last plannable call, their layout and their arrays (:func:`call_layout`). The same
    tensor objects found again at the same address, of the same shape, dtype and contiguity, on the host and
    needing no grad have the same arrays: six torch getters instead of ``numpy()``, the costliest step of a call
    just after a kernel evicted the caches (40-55 µs, the getters 10-15). The arrays stay the same objects, so
    the binding and the backend find them bound already. It holds the tensors, so none can be freed and its
    memory taken by another."""

    args: tuple[torch.Tensor, ...]
    sig: tuple[ArgLayout, ...]
    arrays: list[np.ndarray]
    facts: list[tuple[Any, ...]] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "facts", list(map(_tensor_facts, self.args)))

    def same(self, args: tuple[Any, ...]) -> bool:
        mine = self.args
        return (len(args) == len(mine) and all(map(operator.is_, args, mine))
                and list(map(_tensor_facts, mine)) == self.facts)


#: what a planned module does when it finds the module changed: plan again, run eagerly, or raise
ON_CHANGE = ("replan", "eager", "error")
#: plans one planned module keeps (one per input layout, for the module as it is) before it runs eagerly
MAX_PLANS = 8


class GuardError(RuntimeError):
    """The module, or the layout of a call's inputs, differs from what the plan was made for (on_change='error')."""


class Planned(Protocol):
    """A plan of the module for one input layout, callable without guards."""

    def call_plan(self, inputs: Sequence[Any], arrays: Sequence[np.ndarray] | None = None) -> Any: ...


@dataclass
class CallGuard:
    """Decides, before each call of a planned module, which plan runs it: the module is what its plans assumed
    (:class:`ModuleState`) and a plan was made for these inputs' layout: that plan; otherwise, by
    ``on_change``: plan again (``replan(args)``, through the plan cache; at most :data:`MAX_PLANS` plans), run
    eagerly, or raise :class:`GuardError`. Never a wrong answer: a plan that cannot be made means eager torch
    runs the call, and says why once."""

    module: nn.Module
    replan: Callable[[tuple[Any, ...]], Planned]
    on_change: str
    state: ModuleState
    state_keys: tuple[str, ...]
    folded_from: tuple[str, ...] = ()
    plans: dict[tuple[ArgLayout, ...], Planned | None] = field(default_factory=dict)
    #: what the guard decided, newest last: (reason, action)
    events: list[tuple[str, str]] = field(default_factory=list)
    eager_since: str | None = None  # the module is run eagerly from then on (on_change='eager', or a plan limit)
    _last: LastCall | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.on_change not in ON_CHANGE:
            raise ValueError(f"on_change must be one of {', '.join(ON_CHANGE)}, got {self.on_change!r}")

    def __call__(self, args: tuple[Any, ...]) -> Any:
        if self.eager_since is None:
            changed = self.state.changed()
            if changed is not None:
                self._module_changed(changed)
        if self.eager_since is not None:
            return self._eager(args)
        sig, arrays = self._layout(args)
        if arrays is None:  # else: fp32 host tensors that need no grad, plannable
            refusal = unplannable(args)
            if refusal is not None:
                raise TorchImportError(refusal)
        plans = self.plans
        chosen = plans[sig] if sig in plans else self._new_layout(sig, args)
        return self._eager(args) if chosen is None else chosen.call_plan(args, arrays)

    def _layout(self, args: tuple[Any, ...]) -> tuple[tuple[ArgLayout, ...], list[np.ndarray] | None]:
        """:func:`call_layout`, answered from the last call's where the same tensors come again as they were."""
        last = self._last
        if last is not None and last.same(args):
            return last.sig, last.arrays
        sig, arrays = call_layout(args)
        self._last = LastCall(args, sig, arrays) if arrays is not None else None
        return sig, arrays

    def _module_changed(self, reason: str) -> None:
        if self.on_change == "error":
            raise GuardError(f"the module changed since it was planned: {reason}; plan it again, or plan with "
                             "on_change='replan'")
        if self.on_change == "eager":
            self._note(reason, "runs eagerly from now on")
            self.eager_since = reason
            return
        self._note(reason, "plans again", logging.INFO)
        self.plans.clear()
        self.state = ModuleState.record(self.module, self.state_keys, self.folded_from)

    def _new_layout(self, sig: tuple[ArgLayout, ...], args: tuple[Any, ...]) -> Planned | None:
        """The plan for a layout not seen before (None: eager torch runs these calls), kept for the next."""
        why = f"inputs {describe_signature(sig)}"
        if self.on_change == "error":
            raise GuardError(f"the plan was made for other inputs than {why}; plan again for them, or plan with "
                             "on_change='replan'")
        chosen: Planned | None = None
        if len(self.plans) >= MAX_PLANS:
            self._note(why, f"runs eagerly: {MAX_PLANS} plans are kept already")
        elif self.on_change == "eager":
            self._note(why, "runs eagerly (on_change='eager')")
        else:
            try:
                chosen = self.replan(args)
                self._note(why, "planned for them", logging.INFO)
            except Exception as exc:  # a plan that cannot be made: eager torch runs these calls, never a wrong answer
                self._note(why, f"runs eagerly: planning failed ({type(exc).__name__}: {str(exc)[:200]})")
        self.plans[sig] = chosen
        return chosen

    def _eager(self, args: tuple[Any, ...]) -> Any:
        with torch.no_grad():
            return self.module(*args)

    def _note(self, reason: str, action: str, level: int = logging.WARNING) -> None:
        self.events.append((reason, action))
        log.log(level, "planned module: %s: %s", reason, action)


__all__ = ["CallGuard", "GuardError", "ModuleState", "describe_signature", "input_signature"]
