"""Tracing a module for import: ``torch.fx`` symbolic tracing first, ``torch.export`` where fx fails; the traced
graph is run once on the example inputs (:class:`Recorder`) so that every node has a concrete value."""

from __future__ import annotations

import logging
import operator
import os
import sys
import traceback
from typing import Any

import torch
from torch import fx, nn
from torch.export.graph_signature import InputKind
from torch.fx.operator_schemas import normalize_function
from torch.utils import _pytree as pytree

from planner.torch.errors import TorchImportError

log = logging.getLogger(__name__)

#: in-place operators and their out-of-place forms (a traced ``x += y`` is mapped as ``x + y``)
INPLACE_OPERATORS = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
                      operator.itruediv: operator.truediv}

#: batch norms, whose running statistics a training call updates in place (no schema says so)
BATCH_NORMS = frozenset({torch.nn.functional.batch_norm, torch.batch_norm, torch.ops.aten.batch_norm.default,
                         torch.ops.aten.native_batch_norm.default, torch.ops.aten._native_batch_norm_legit.default})

TORCH_DIR = os.path.dirname(torch.__file__)
PLANNER_DIR = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------- tracing


#: the modules the tracer keeps as leaves, and the kind of IMPORTER_TABLE each is lowered as
#: (``planner.torch.lowerings.modules.lower_module``)
LEAF_KINDS: dict[type[nn.Module], str] = {
    nn.Linear: "linear", nn.GELU: "gelu", nn.ReLU: "relu", nn.SiLU: "silu", nn.LayerNorm: "layer_norm",
    nn.Dropout: "dropout", nn.Identity: "same",
}


class _Tracer(fx.Tracer):
    """Keeps only the modules the importer maps as leaves; traces into all others. With the example inputs, a
    loop over a traced value of fixed length (``for t in x.split(d, -1)``, which fx cannot iterate) runs over
    its items, the length taken from the graph traced so far run on those inputs."""

    LEAVES = tuple(LEAF_KINDS)

    def __init__(self, example_args: tuple[Any, ...] | None = None) -> None:
        super().__init__()
        self.example_args = example_args

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        # a forward set on the instance is what a call runs, not the class's: traced into
        return type(m) in self.LEAVES and "forward" not in m.__dict__

    def iter(self, obj: fx.Proxy) -> Any:
        try:
            value = self._concrete(obj.node) if self.example_args is not None else None
        except Exception as exc:  # the model's own error on these inputs: torch.export reports it better
            log.debug("no concrete value to iterate over (%s)", first_line(exc))
            value = None
        if not isinstance(value, (tuple, list)):
            return super().iter(obj)
        return iter([obj[i] for i in range(len(value))])  # type: ignore[index]  # Proxy.__getitem__ is dynamic

    def _concrete(self, target: fx.Node) -> Any:
        """The value of ``target`` on the example inputs (None when the graph so far cannot say: an in-place
        op, which must not touch the caller's tensors, or more placeholders than inputs)."""
        assert self.example_args is not None
        values: dict[fx.Node, Any] = {}
        inputs = iter(self.example_args)
        with torch.no_grad():
            for n in self.graph.nodes:
                if mutated_input_of(self.root, n) is not None:
                    return None
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), values.__getitem__)
                if n.op == "placeholder":
                    values[n] = next(inputs, None)
                elif n.op == "get_attr":
                    values[n] = _attr(self.root, str(n.target))
                elif n.op == "call_function":
                    values[n] = n.target(*args, **kwargs)
                elif n.op == "call_method":
                    values[n] = getattr(args[0], str(n.target))(*args[1:], **kwargs)
                elif n.op == "call_module":
                    values[n] = self.root.get_submodule(str(n.target))(*args, **kwargs)
                if n is target:
                    return values[n]
        return None


def _attr(root: nn.Module, path: str) -> Any:
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _written_by_schema(node: fx.Node) -> list[fx.Node]:
    """The arguments an ATen operator's schema marks written (``Tensor(a!)``), as torch.export leaves them."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None:
        return []
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
            if isinstance(value, fx.Node):
                out.append(value)
    return out


def written_inputs(gm: nn.Module, node: fx.Node) -> list[fx.Node]:
    """Every node whose tensor ``node`` overwrites: its in-place input (:func:`mutated_input_of`), the arguments
    an ATen schema marks written, and a training batch norm's running statistics."""
    found = [m for m in (mutated_input_of(gm, node),) if m is not None] + _written_by_schema(node)
    if node.op == "call_function" and callable(node.target) and node.target in BATCH_NORMS:
        norm = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
        if norm is not None and norm.kwargs.get("training"):
            found += [v for k in ("running_mean", "running_var") if isinstance(v := norm.kwargs.get(k), fx.Node)]
    return list(dict.fromkeys(found))


def mutated_input_of(gm: nn.Module, node: fx.Node) -> fx.Node | None:
    """The node whose tensor an in-place call (``x.add_(y)``, ``x += y``, ``inplace=True``, an ATen ``add_``)
    overwrites."""
    first = node.args[0] if node.args else None
    if not isinstance(first, fx.Node):
        return None
    if first in _written_by_schema(node):
        return first
    if node.op == "call_method":
        name = str(node.target)
        inplace = name.endswith("_") and not name.startswith("_")
    elif node.op == "call_module":
        inplace = bool(getattr(gm.get_submodule(str(node.target)), "inplace", False))
    elif node.op == "call_function":
        inplace = node.target in INPLACE_OPERATORS or node.kwargs.get("inplace") is True
    else:
        return None
    return first if inplace else None


class Recorder(fx.Interpreter):
    """Runs a graph once and keeps every node's concrete value."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[fx.Node, Any] = {}
        # an in-place op later in the graph must not change a value recorded before it, nor the caller's tensors
        # (run() then takes copies of them); without one, no value is copied (a copy of every activation cost
        # as much as running the model again)
        self.copy = any(written_inputs(gm, n) for n in gm.graph.nodes)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        if self.copy:
            args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        return super().run(*args, **kwargs)

    def run_node(self, n: fx.Node) -> Any:
        v = super().run_node(n)
        self.values[n] = v.detach().clone() if self.copy and isinstance(v, torch.Tensor) and n.op.startswith("call_") else v
        return v


def _user_frame(exc: BaseException) -> str | None:
    """``file:line (`source`)`` of the innermost frame of user code in a traceback."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(TORCH_DIR)]
    frames = [f for f in frames if not f.filename.startswith("<") and f.line]  # generated code has no source
    frames = [f for f in frames if os.path.dirname(os.path.abspath(f.filename)) != PLANNER_DIR]
    if not frames:
        return None
    f = frames[-1]
    return f"{f.filename}:{f.lineno} (`{(f.line or '').strip()}`)"


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


#: a module's dicts of the hooks that run around its forward (``register_forward_hook``, ``..._pre_hook``)
FORWARD_HOOKS = ("_forward_pre_hooks", "_forward_hooks")
#: the same for every module (``nn.modules.module.register_module_forward_hook``, ``..._pre_hook``)
GLOBAL_FORWARD_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks")


def forward_hook_dicts(module: nn.Module) -> list[tuple[str, dict[Any, Any]]]:
    """(where, hook dict) of each forward hook dict of ``module``'s tree (where: the submodule's path, ``""`` the
    module itself), then the global ones (``"every module"``)."""
    out = [(path, d) for path, m in module.named_modules()
           for d in (getattr(m, name, None) for name in FORWARD_HOOKS) if isinstance(d, dict)]
    out += [("every module", d) for d in (getattr(nn.modules.module, name, None) for name in GLOBAL_FORWARD_HOOKS)
            if isinstance(d, dict)]
    return out


def hooked_modules(module: nn.Module) -> list[str]:
    """Where forward hooks would run in a call of ``module`` (:func:`forward_hook_dicts`' names), once each."""
    return list(dict.fromkeys(where for where, hooks in forward_hook_dicts(module) if hooks))


def trace(module: nn.Module | torch.export.ExportedProgram, args: tuple[Any, ...],
           strategy: str) -> tuple[fx.GraphModule, list[Any], str, Any, Any]:
    """Trace with fx, else torch.export; returns the graph module, its placeholder values, the tracer, the
    placeholders' sources and the pytree spec of the module's result (None: the graph's output node has it).
    A module with forward hooks goes to torch.export, which runs them (fx calls ``forward`` itself, past them)."""
    fx_error: BaseException | None = None
    hooked = hooked_modules(module) if isinstance(module, nn.Module) else []
    if hooked and strategy == "fx":
        raise TorchImportError(f"forward hooks on {_where(hooked)}: torch.fx traces past them (it calls forward "
                               "itself); trace with torch.export (strategy 'auto' or 'export') or remove them")
    if hooked:
        log.info("forward hooks on %s: traced with torch.export, which runs them", _where(hooked))
    elif strategy in ("auto", "fx"):
        try:
            tracer = _Tracer(args)
            graph = tracer.trace(module)
            gm = fx.GraphModule(tracer.root, graph)
            n_ph = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
            if n_ph != len(args):  # parameters left to their defaults (``forward(x, mask=None)`` given x): fx
                # makes each an input; torch.export calls forward as the module is called
                raise _InputCountError(f"forward takes {n_ph} input(s) after fx tracing, got {len(args)} example "
                                       "input(s)")
            return gm, list(args), "fx", None, None
        except TorchImportError:
            raise
        except Exception as exc:  # fx raises TraceError, TypeError, AttributeError ... on untraceable code
            fx_error = exc
            if strategy == "fx":
                raise _untraceable(exc, None) from exc
            log.info("torch.fx could not trace %s (%s); trying torch.export", type(module).__name__, first_line(exc))
    try:
        if not isinstance(module, torch.export.ExportedProgram):
            _export_transformers_caches()
        ep = module if isinstance(module, torch.export.ExportedProgram) else torch.export.export(module, args)
    except Exception as exc:
        raise _untraceable(fx_error, exc) from exc
    return _from_export(ep, args)


#: the libraries whose result types torch.export has been told about in this process
_REGISTERED: set[str] = set()


def _export_transformers_caches() -> None:
    """Where ``transformers`` is loaded, let torch.export take the ``DynamicCache`` its models return by default
    (``use_cache``): transformers' own registration of it as a pytree node (a model called as users call it,
    ``GPT2Model(ids)``, was untraceable). Once a process, once transformers is there."""
    if "transformers" in _REGISTERED or "transformers" not in sys.modules:
        return
    try:
        from transformers.integrations.executorch import register_dynamic_cache_export_support  # optional
    except ImportError:  # another transformers: its caches stay untraceable, and the error says so
        _REGISTERED.add("transformers")
        return
    register_dynamic_cache_export_support()
    _REGISTERED.add("transformers")


class _InputCountError(Exception):
    """fx's graph takes other inputs than the example inputs given."""


def _where(paths: list[str]) -> str:
    named = [p or "the module itself" for p in paths]
    return ", ".join(named[:4]) + (f" and {len(named) - 4} more" if len(named) > 4 else "")


def _from_export(ep: torch.export.ExportedProgram, args: tuple[Any, ...]) -> tuple[fx.GraphModule, list[Any], str, Any, Any]:
    _refuse_mutations(ep)
    state = {**ep.state_dict, **ep.constants}
    flat_args, _ = pytree.tree_flatten(args)
    values: list[Any] = []
    sources: list[tuple[str, Any]] = []
    user = 0
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            values.append(flat_args[user])
            sources.append(("arg", user))
            user += 1
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            values.append(state[spec.target])
            sources.append(("state", spec.target))
        else:
            raise TorchImportError(f"exported program input {spec.arg.name!r} has unsupported kind {spec.kind.name}")
    # the exported graph returns a flat tuple; the module's own result structure (one tensor, a dict) is this spec
    return ep.graph_module, values, "export", sources, ep.call_spec.out_spec


def _refuse_mutations(ep: torch.export.ExportedProgram) -> None:
    """torch.export turns a forward's in-place write of a buffer or an input (a training BatchNorm's running
    statistics and counter) into an extra output the caller is meant to copy back; a plan returns only the
    module's outputs, so the write would be lost without a word: refuse it, naming what is written."""
    sig = ep.graph_signature
    written = [*sig.buffers_to_mutate.values(), *(f"input {name}" for name in sig.user_inputs_to_mutate.values())]
    if written:
        hint = (" (a BatchNorm in training mode updates its running statistics: call module.eval() to plan "
                "inference)" if any("running_" in w or "num_batches_tracked" in w for w in written) else "")
        raise TorchImportError(f"the module's forward writes {', '.join(sorted(written)[:4])} in place; a plan writes "
                               f"only its outputs, so that write would be lost{hint}")


def _untraceable(fx_exc: BaseException | None, export_exc: BaseException | None) -> TorchImportError:
    where = _user_frame(fx_exc) if fx_exc is not None else None
    if where is None and export_exc is not None:
        where = _user_frame(export_exc)
    head = "the module cannot be traced" + (f" at {where}" if where else "")
    errors = [f"torch.fx: {first_line(e)}" for e in (fx_exc,) if e is not None]
    errors += [f"torch.export: {first_line(e)}" for e in (export_exc,) if e is not None]
    text = " ".join(errors)
    if "control flow" in text or "data-dependent" in text or "DataDependent" in text:
        hint = (
            "Data-dependent Python control flow (an `if`/`while` on tensor values) cannot be planned: "
            "rewrite it with torch.cond or torch.where so that torch.export.export(module, inputs) succeeds"
        )
    else:
        hint = "Run torch.export.export(module, inputs) to see the failing construct, then pass the ExportedProgram"
    return TorchImportError(f"{head}: {'; '.join(errors)}. {hint}.")
