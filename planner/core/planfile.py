"""plan.json: a chosen plan, saved so that ``fusion-planner run`` can re-execute it.

The file holds the graph (graph JSON), the device spec the plan was costed on,
and the plan: each kernel's kind, output, reads, cuBLASLt epilogue, ledgers and
body as expression JSON over the op table.  Loading parses JSON only (no pickle,
no eval, no code): op names are looked up in the op table, attributes coerced by
it, and the body checked against the graph.  A SHA-256 over the canonical JSON
of everything else detects edits; a plan that does not fit its graph (or the
graph the user names) is refused with :class:`PlanFileError`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from planner.core.cost import DeviceSpec, DeviceSpecError, KernelCost, device_from_json
from planner.core.files import read_json
from planner.core.graph import Graph, GraphError, TensorType, graph_from_json, torch_names
from planner.core.kinds import KernelKind, OpKind
from planner.core.ops import CUBLASLT_EPILOGUES, OPS, OpError, op_def
from planner.core.plans import Expr, Kernel, Load, Plan, expr_from_json, expr_to_json
from planner.core.schema import check_document
from planner.core.torch_allowlist import loading_file

PLAN_FORMAT = "fusion-planner-plan"
PLAN_VERSION = 1


class PlanFileError(ValueError):
    """A plan file is unreadable, tampered with, or does not fit its graph."""


def content_hash(doc: dict[str, Any]) -> str:
    body = {k: v for k, v in doc.items() if k != "sha256"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def plan_document(plan: Plan, graph: Graph, spec: DeviceSpec, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    kernels = []
    for k in plan.kernels:
        kernels.append(
            {
                "kind": k.kind,
                "out": k.out,
                "reads": list(k.reads),
                "epilogue": k.epilogue,
                "cost": asdict(k.cost),
                "body": expr_to_json(k.body),
            }
        )
    doc: dict[str, Any] = {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        "graph": graph.to_json(),
        "device": spec.to_json(),
        "plan": {
            "key": plan.key,
            "notation": plan.notation(),
            "outputs": list(plan.outputs),
            "partition": list(plan.partition) if plan.partition is not None else None,
            "kernels": kernels,
        },
        "meta": meta or {},
    }
    doc["sha256"] = content_hash(doc)
    return doc


def save_plan(path: str | Path, plan: Plan, graph: Graph, spec: DeviceSpec, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    doc = plan_document(plan, graph, spec, meta)
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def load_plan(path: str | Path, expect_graph: Graph | None = None) -> tuple[Plan, Graph, DeviceSpec, dict[str, Any]]:
    """(plan, graph, device spec, meta) from a plan file; raises PlanFileError."""
    p = Path(path)
    return plan_from_document(read_json(p, PlanFileError, "plan file"), str(p), expect_graph)


def plan_from_document(
    doc: Any, source: str = "<plan>", expect_graph: Graph | None = None
) -> tuple[Plan, Graph, DeviceSpec, dict[str, Any]]:
    """Parse a plan document as untrusted data; torch names the in-memory ``expect_graph`` already uses
    are accepted (the caller holds that graph), others must be on the allowlist (docs/security.md)."""
    allow = torch_names(expect_graph) if expect_graph is not None else frozenset()
    with loading_file(allow):
        return _plan_from_document(doc, source, expect_graph, allow)


def _plan_from_document(
    doc: Any, source: str, expect_graph: Graph | None, allow: frozenset[str]
) -> tuple[Plan, Graph, DeviceSpec, dict[str, Any]]:
    if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
        raise PlanFileError(f"{source}: not a plan file ('format' must be {PLAN_FORMAT!r})")
    if doc.get("version") != PLAN_VERSION:
        raise PlanFileError(f"{source}: unsupported plan version {doc.get('version')!r} (this build reads {PLAN_VERSION})")
    if doc.get("sha256") != content_hash(doc):
        raise PlanFileError(f"{source}: content hash mismatch: the file was edited or corrupted after it was written")
    check_document(doc, "plan", source, PlanFileError)
    try:
        graph = graph_from_json(doc.get("graph"), f"{source}: graph", allow_torch=allow)
        spec = device_from_json(doc.get("device"), f"{source}: device")
    except (GraphError, DeviceSpecError, OpError) as exc:
        raise PlanFileError(f"{source}: {exc}") from None
    if expect_graph is not None and expect_graph.fingerprint() != graph.fingerprint():  # the name may differ
        raise PlanFileError(
            f"{source}: the plan was made for graph {graph.name!r}, which differs from the given graph {expect_graph.name!r}"
        )
    pd = doc["plan"]
    tensors = {n.id: n.type for n in graph.nodes}
    kernels = tuple(_kernel(k, i, source) for i, k in enumerate(pd["kernels"]))
    partition = pd.get("partition")
    plan = Plan(graph.name, kernels, tuple(pd["outputs"]), tensors, pd.get("key", ""),
                tuple(partition) if partition is not None else None)
    check_plan(plan, graph, source)
    return plan, graph, spec, dict(doc.get("meta", {}))


def _kernel(d: dict[str, Any], i: int, source: str) -> Kernel:
    """Kernel ``i`` of a plan document whose fields its schema has checked."""
    where = f"{source}: kernel {i}"
    kind, out, reads, epilogue = d["kind"], d["out"], d["reads"], d.get("epilogue")
    try:
        body = expr_from_json(d["body"], "body")
    except (ValueError, OpError) as exc:  # a body past the depth limit included (core.limits)
        raise PlanFileError(f"{where}: {exc}") from None
    if not isinstance(body, Expr):
        raise PlanFileError(f"{where}: the body must compute a value, not just load {body.tensor!r}")
    cost = KernelCost(**d["cost"])
    problem = kind_problem(KernelKind(kind), body, epilogue)
    if problem:
        raise PlanFileError(f"{where}: the body does not fit kind {kind}: {problem}")
    return Kernel(kind, body, out, tuple(reads), cost, epilogue)


def kind_problem(kind: KernelKind, body: Expr, epilogue: str | None) -> str | None:
    """Why ``body`` is not a kernel of ``kind`` (None when it is): backends generate code from the kind
    and trust the body, so plan files and bundles are checked with this."""
    kinds = [op_def(e.op).kind for e in body.walk()]
    matmuls = kinds.count(OpKind.MATMUL)
    if kind == KernelKind.OPAQUE:
        ok = kinds == [OpKind.OPAQUE] and all(isinstance(a, Load) for a in body.args)
        why = "an opaque kernel is one Opaque op over loaded tensors"
    elif kind == KernelKind.STANDALONE:
        ok = kinds == [OpKind.STANDALONE] and all(isinstance(a, Load) for a in body.args)
        why = f"a standalone kernel is one standalone op ({', '.join(n for n, o in OPS.items() if o.kind == OpKind.STANDALONE)}) over loaded tensors"
    elif kind == KernelKind.ELEMENTWISE:
        ok = all(k.fuses for k in kinds)
        why = "an elementwise kernel holds elementwise and row-reduction ops only"
    else:
        ok = matmuls == 1 and all(k in (OpKind.MATMUL, OpKind.ELEMENTWISE) for k in kinds)
        mm = next((e for e in body.walk() if op_def(e.op).kind == OpKind.MATMUL), None)
        ok = ok and mm is not None and all(isinstance(a, Load) for a in mm.args)
        why = f"a {kind} kernel is one MatMul of loaded operands, then elementwise ops"
        if ok and kind == KernelKind.CUBLASLT:
            chain = []
            e: Expr | Load = body
            while isinstance(e, Expr) and op_def(e.op).kind != OpKind.MATMUL:
                chain.append(e.op)
                e = e.args[0]
            ok = epilogue in CUBLASLT_EPILOGUES and tuple(reversed(chain)) == CUBLASLT_EPILOGUES[epilogue]
            why = f"a cublaslt kernel's body must be its epilogue ({', '.join(CUBLASLT_EPILOGUES)}) applied to one MatMul"
    if kind != KernelKind.CUBLASLT and epilogue is not None:
        ok, why = False, f"only a cublaslt kernel has an epilogue, not a {kind} kernel"
    return None if ok else why


def check_plan(plan: Plan, graph: Graph, source: str = "<plan>") -> None:
    """Structural fit of a plan to its graph: every kernel writes a graph tensor of the
    right type once, reads only tensors already in memory, and the outputs are written."""
    check_plan_tensors(plan, {n.id: n.type for n in graph.nodes}, [n.id for n in graph.inputs],
                       len(graph.outputs), source, f"graph {graph.name!r}")


def check_plan_tensors(plan: Plan, tensors: Mapping[str, TensorType], inputs: Iterable[str], n_outputs: int,
                       source: str, owner: str = "the graph") -> None:
    """:func:`check_plan` against a tensor table (a bundle carries one instead of a graph): ``tensors``
    holds every value of the graph by name, ``inputs`` the names of its inputs."""
    graph_inputs = set(inputs)
    memory = set(graph_inputs)
    for i, k in enumerate(plan.kernels):
        where = f"{source}: kernel {i} ({k.out})"
        if k.out not in tensors or k.out in graph_inputs:
            raise PlanFileError(f"{where}: writes {k.out!r}, which is not an op of {owner}")
        if k.out in memory:
            raise PlanFileError(f"{where}: {k.out!r} is written twice")
        if k.body.type != tensors[k.out]:
            raise PlanFileError(f"{where}: body type {k.body.type} differs from {owner}'s {tensors[k.out]}")
        loads = _loads(k.body)
        if loads != set(k.reads):
            raise PlanFileError(f"{where}: body loads {sorted(loads)} but 'reads' lists {sorted(k.reads)}")
        unknown = {t for t in loads if t not in tensors}
        if unknown:
            raise PlanFileError(f"{where}: reads {sorted(unknown)}, which {owner} does not have")
        missing = loads - memory
        if missing:
            raise PlanFileError(f"{where}: reads {sorted(missing)} before any kernel wrote it")
        for e in k.body.walk():
            if e.node in tensors and tensors[e.node] != e.type:
                raise PlanFileError(f"{where}: value {e.node!r} has type {e.type}, {owner} says {tensors[e.node]}")
            _check_inferred(e, tensors, where)
        memory.add(k.out)
    if len(plan.outputs) != n_outputs:
        raise PlanFileError(f"{source}: plan has {len(plan.outputs)} outputs, {owner} has {n_outputs}")
    for o in plan.outputs:
        if o not in memory:
            raise PlanFileError(f"{source}: output {o!r} is never written")


def _check_inferred(e: Expr, tensors: Mapping[str, TensorType], where: str) -> None:
    """The recorded shape of a body node must be what its op's shape rule gives for its operands (a node
    the graph does not name, such as a cuBLASLt body's inner value, is checked this way only)."""
    shapes = [tuple(tensors[a.tensor].shape) if isinstance(a, Load) else tuple(a.type.shape) for a in e.args]
    try:
        want = tuple(op_def(e.op).out_shape(shapes, e.attr_dict))
    except (OpError, ValueError, TypeError, IndexError) as exc:
        raise PlanFileError(f"{where}: {e.op} node {e.node!r} does not fit its operands: {exc}") from None
    if want != tuple(e.type.shape):
        raise PlanFileError(f"{where}: {e.op} node {e.node!r} records shape {list(e.type.shape)}, its operands give {list(want)}")


def _loads(e: Expr | Load) -> set[str]:
    if isinstance(e, Load):
        return {e.tensor}
    out: set[str] = set()
    for a in e.args:
        out |= _loads(a)
    return out
