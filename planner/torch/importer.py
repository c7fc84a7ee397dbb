"""Import a torch ``nn.Module`` (or a torch.compile graph) into the planner's IR.

Tracing: ``torch.fx`` symbolic tracing first, ``torch.export`` where fx fails
(shape-dependent Python control flow, modules fx cannot trace).  The traced
graph is run once on the example inputs so every node has a concrete value;
shapes, dtypes and constants come from those values.

Mapping (everything else becomes an ``Opaque`` node executed by torch, see
:mod:`planner.torch.ops`):

* ``nn.Linear`` / ``F.linear``  -> ``MatMul`` with the weight bound transposed as a
  ``(K, N)`` input, then ``BiasAdd``;
* GELU by its ``approximate`` argument -> ``GeluTanh`` / ``GeluErf``; relu -> ``Relu``;
  silu -> ``Silu``;
* tensor + tensor -> ``Add`` (``BiasAdd`` for a 1-D row vector), tensor - tensor -> ``Sub``,
  tensor * tensor -> ``Mul``, tensor / tensor -> ``Div``, ``torch.maximum`` / ``torch.minimum`` ->
  ``Maximum`` / ``Minimum`` (operands of one shape); ``-x`` -> ``Neg``;
* exp, tanh, sigmoid, sqrt, rsqrt, square of one tensor -> the op-table op whose ``torch_names`` name
  the call; ``x ** p`` for p = 2, 3, 0.5, -0.5 -> ``Square`` (and ``Mul``), ``Sqrt``, ``Rsqrt``;
* a tensor with a Python scalar (``x*a``, ``x+b``, ``x-b``, ``b-x``, ``x/a``) -> ``Affine``;
* mean / sum / amax over the last dimension with ``keepdim=True`` -> ``RowMean`` / ``RowSum`` /
  ``RowMax``; a tensor with one value per row (``[..., 1]``) -> ``AddRow`` .. ``DivRow``; a tensor times a
  row vector -> ``BiasMul``; LayerNorm, RMSNorm and softmax over the last dimension -> those primitives;
* views that keep the flattened shape, eval-mode dropout, contiguous/clone -> no node.

IR tensors are stored flattened: leading dims fold into one row dim, so a
``(B, S, D)`` activation is a ``(B*S, D)`` IR tensor and Linear is a plain 2-D
GEMM (:func:`planner.core.opaque.flat_shape`).  Parameters and buffers become
graph inputs bound from the module at call time; constant tensors computed
from them at import are captured.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from planner.core.graph import Graph, GraphError
from planner.torch.binding import (
    INDEX_DTYPES,
    TORCH_DTYPES,
    Binding,
    BoundInputs,
    ImportedModule,
    graph_inputs_from_module,
    ir_dtype,
)
from planner.torch.errors import TorchImportError
from planner.torch.lowerings import LOWERINGS, lower_module
from planner.torch.projections import pack_projections
from planner.torch.tracing import Recorder, first_line, trace
from planner.torch.walk import Importer

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- entry points


def _check_example_inputs(module: Any, args: tuple[Any, ...]) -> None:
    flat, _ = pytree.tree_flatten(args)
    if not flat:
        raise TorchImportError("no example inputs: pass the tensors the model is called with")
    for i, t in enumerate(flat):
        if not isinstance(t, torch.Tensor):
            raise TorchImportError(f"example input {i} is a {type(t).__name__}; only tensors are supported")
        if t.dtype not in INDEX_DTYPES:
            ir_dtype(t.dtype, f"example input {i}")
    if isinstance(module, nn.Module):
        try:
            inspect.signature(module.forward).bind(*args)
        except TypeError as exc:
            raise TorchImportError(
                f"example inputs do not match {type(module).__name__}.forward{inspect.signature(module.forward)}: {exc}"
            ) from None
        for name, p in [*module.named_parameters(), *module.named_buffers()]:
            if p.is_floating_point():
                ir_dtype(p.dtype, f"parameter {name!r}")


def import_module(module: nn.Module | torch.export.ExportedProgram, example_inputs: Any, *, strategy: str = "auto") -> ImportedModule:
    """Trace ``module`` on ``example_inputs`` and map it to the IR (see the module docstring)."""
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    _check_example_inputs(module, args)
    state = _state_versions(module)
    try:
        gm, ph_values, tracer, sources, out_spec = trace(module, args, strategy)
        _refuse_state_writes(module, state)
        if sources is None:
            sources = [("arg", i) for i in range(len(ph_values))]
        name = type(module).__name__ if isinstance(module, nn.Module) else "exported"
        return _import_graph(gm, ph_values, sources, tracer, name, out_spec)
    except TorchImportError:
        _check_inputs_fit(module, args, state)  # the module itself failing on them is the error to report
        raise


StateVersions = dict[str, tuple[torch.Tensor, int, torch.Tensor | None]]


def _state_versions(module: Any) -> StateVersions:
    """Each parameter's and buffer's version counter, and a copy of each buffer to restore: a forward that writes
    a buffer through the module (``self.count.add_(1)``) does it while fx traces, with no node in the graph."""
    if not isinstance(module, nn.Module):
        return {}
    out: StateVersions = {n: (p, p._version, None) for n, p in module.named_parameters()}
    out.update((n, (b, b._version, b.detach().clone())) for n, b in module.named_buffers())
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (a NaN equals itself)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.detach().contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _restore_state(before: StateVersions) -> list[str]:
    """Put every buffer written since ``before`` back as it was; the names of the parameters and buffers
    written. A kernel may write a buffer without bumping its version (batch_norm's running statistics), so a
    buffer's values are compared too."""
    written = [name for name, (t, version, copy) in before.items()
               if t._version != version or (copy is not None and not _same_bits(t, copy))]
    with torch.no_grad():
        for name in written:
            t, _, copy = before[name]
            if copy is not None:
                t.copy_(copy)
    return written


def _refuse_state_writes(module: Any, before: StateVersions) -> None:
    """Refuse a module whose forward wrote one of its parameters or buffers while it was traced (a plan writes
    only its outputs: the write would be lost), after putting a written buffer back as it was."""
    written = _restore_state(before)
    if not written:
        return
    raise TorchImportError(
        f"{type(module).__name__}.forward writes the module's parameter or buffer {written[0]!r} in place; a plan "
        "writes only its outputs, so that write would be lost: return the new value instead, or run the module "
        "eagerly")


def _check_inputs_fit(module: nn.Module | torch.export.ExportedProgram, args: tuple[Any, ...],
                      state: StateVersions) -> None:
    """Run the module eagerly (only once an import failed: the recorder has already run it once), on copies of
    the caller's tensors and with any buffer it writes put back: planning never changes what it was given."""
    if not isinstance(module, nn.Module):
        return
    copies = pytree.tree_map(lambda a: a.clone() if isinstance(a, torch.Tensor) else a, args)
    try:
        with torch.no_grad():
            module(*copies)
    except Exception as exc:
        raise TorchImportError(f"example inputs do not fit {type(module).__name__}: {first_line(exc)}") from None
    finally:
        _restore_state(state)


def _import_graph(gm: fx.GraphModule, ph_values: Sequence[Any], sources: list[tuple[str, Any]], tracer: str, name: str,
                  out_spec: Any = None) -> ImportedModule:
    rec = Recorder(gm)
    try:
        with torch.no_grad():
            rec.run(*ph_values)
    except Exception as exc:
        raise TorchImportError(f"running the traced graph on the example inputs failed: {first_line(exc)}") from None
    imp = Importer(name, tracer, gm, rec.values, sources, LOWERINGS, lower_module)
    outs, specs, tree = imp.run()
    try:
        graph = imp.b.build(outs)
    except GraphError as exc:
        raise TorchImportError(f"{name}: {exc}") from None
    graph, bindings = _packed_projections(graph, imp)
    arg_specs = tuple((tuple(v.shape), v.dtype) for v, s in zip(ph_values, sources, strict=False) if s[0] == "arg")
    if imp.opaque_names:
        counts: dict[str, int] = {}
        for o in imp.opaque_names:
            counts[o] = counts.get(o, 0) + 1
        log.info("%s: %d op(s) stayed opaque (executed by torch, in %d Opaque kernel(s)): %s", name,
                 len(imp.opaque_names), imp.opaque_kernels, ", ".join(f"{k} x{v}" for k, v in counts.items()))
    return ImportedModule(
        graph=graph,
        bindings=bindings,
        constants={n: _read_only(a) for n, a in imp.constants.items()},
        arg_specs=arg_specs,
        outputs=tuple(specs),
        out_tree=tree if out_spec is None else out_spec,
        opaque_ops=tuple(imp.opaque_names),
        tracer=tracer,
        folded_from=tuple(sorted(imp.folded_from)),
    )


def _read_only(a: np.ndarray) -> np.ndarray:
    """A constant, computed at import, never written: read-only, so the backend keeps what it derives from it once
    (oneDNN's reordered convolution weight, a packed GEMM weight) instead of deriving it again each call."""
    a.setflags(write=False)
    return a


def _packed_projections(graph: Graph, imp: Importer) -> tuple[Graph, tuple[Binding, ...]]:
    """The graph with projections of one input packed into one GEMM (torch.projections), and its bindings."""
    state = {b.name: b for b in imp.bindings.values() if b.source == "state"}

    def packable(name: str) -> bool:  # a Linear weight read as (K, N), or a bias
        b = state.get(name)
        return b is not None and (b.transpose or len(b.shape) == 1)

    graph, packs = pack_projections(graph, packable, imp.fresh)
    parts = {p for pack in packs for p in pack.parts}
    bindings = [b for b in imp.bindings.values() if b.name not in parts]
    for pack in packs:
        first = state[pack.parts[0]]
        bindings.append(Binding(pack.name, "packed", tuple(str(state[p].key) for p in pack.parts), first.transpose,
                                tuple(graph[pack.name].type.shape)))
    gemms = sum(1 for pack in packs if state[pack.parts[0]].transpose)
    if gemms:
        log.info("%s: %d set(s) of projections of one input packed into one GEMM each", imp.name, gemms)
    return graph, tuple(bindings)


def import_fx_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], name: str = "dynamo") -> ImportedModule:
    """Import a graph captured by torch.compile: every tensor placeholder is a call input; an integer one (a
    size of a graph captured with dynamic shapes) is a constant of the plan, which is made for its value."""
    sources: list[tuple[str, Any]] = []
    for v in example_inputs:
        sources.append(("arg", len([s for s in sources if s[0] == "arg"])) if isinstance(v, torch.Tensor)
                       else ("const", v))
    return _import_graph(gm, list(example_inputs), sources, "dynamo", name)


def factory_kwargs(pairs: Sequence[str]) -> dict[str, Any]:
    """``NAME=VALUE`` pairs (the CLI's ``--torch-arg``) as keyword arguments: a VALUE that reads as a JSON
    number, boolean or null is that, anything else is a string."""
    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or not name.isidentifier():
            raise TorchImportError(f"--torch-arg expects NAME=VALUE with NAME an identifier, got {pair!r}")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        out[name] = value if isinstance(value, (int, float, bool, type(None))) else raw
    return out


def load_factory(spec: str, kwargs: Mapping[str, Any] | None = None) -> tuple[Any, Any]:
    """Run ``path/file.py:factory(**kwargs)``; it must return ``(module, example_inputs)``."""
    path, sep, fname = spec.rpartition(":")
    if not sep or not path or not fname:
        raise TorchImportError(f"--torch expects FILE.py:FACTORY, got {spec!r}")
    p = Path(path)
    if not p.is_file():
        raise TorchImportError(f"torch model file not found: {p}")
    mod_spec = importlib.util.spec_from_file_location(f"_fusion_planner_model_{p.stem}", p)
    if mod_spec is None or mod_spec.loader is None:
        raise TorchImportError(f"cannot load {p} as a Python module")
    mod = importlib.util.module_from_spec(mod_spec)
    try:
        mod_spec.loader.exec_module(mod)
    except Exception as exc:  # the user's file: one line naming it (its traceback at -v)
        log.debug("loading %s failed", p, exc_info=True)
        raise TorchImportError(f"{p} failed to load: {type(exc).__name__}: {exc}") from exc
    factory = getattr(mod, fname, None)
    if not callable(factory):
        raise TorchImportError(f"{p} has no callable {fname!r}")
    kwargs = dict(kwargs or {})
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as exc:
        raise TorchImportError(f"{spec} does not take the arguments {sorted(kwargs)}: {exc}") from None
    try:
        out = factory(**kwargs)
    except Exception as exc:  # a wrong --torch-arg value, or the factory's own error: one line naming the call
        log.debug("%s(**%r) failed", spec, kwargs, exc_info=True)
        raise TorchImportError(f"{spec} called with {kwargs} raised {type(exc).__name__}: {exc}") from exc
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], nn.Module)):
        raise TorchImportError(f"{spec}: the factory must return (module, example_inputs)")
    return out


def graph_from_factory(spec: str, kwargs: Mapping[str, Any] | None = None) -> Graph:
    """The IR graph of ``FILE.py:FACTORY`` called with ``kwargs`` (the CLI's ``--torch``, ``--torch-arg``)."""
    module, inputs = load_factory(spec, kwargs)
    return import_module(module, inputs).graph


__all__ = [
    "INDEX_DTYPES", "TORCH_DTYPES", "Binding", "BoundInputs", "ImportedModule", "factory_kwargs", "graph_from_factory",
    "graph_inputs_from_module", "import_fx_graph", "import_module", "ir_dtype", "load_factory",
]
