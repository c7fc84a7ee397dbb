"""Self-contained candidate bundles: plan here (egglog), time there (numpy + cupy only).

A bundle (``fusion-planner export-candidates``) holds, for every candidate, each
kernel's body (op tree), its generated CUDA source and launch shape or its
cuBLASLt call, plus tensor shapes and dtypes, the input recipe (seed and
scales) and the reference recipe (the unfused plan, evaluated in fp64 numpy).
Reading a bundle needs only ``planner.core.ops``, ``planner.core.graph``, ``planner.core.cost``
and ``planner.core.plans``; none of them imports egglog.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from backends.cupy.codegen import CodegenError, generate
from backends.cupy.kernel import CudaKernel, cuda_kernel_from_json
from planner.core.cost import KernelCost
from planner.core.files import read_json
from planner.core.graph import GraphError, TensorType, tensor_type
from planner.core.inputs import RECIPE, input_scales, seeded_inputs
from planner.core.kinds import KernelKind, OpKind
from planner.core.ops import CUBLASLT_EPILOGUES, epilogue_has_bias, op_def
from planner.core.planfile import PlanFileError, check_plan_tensors, kind_problem
from planner.core.plans import Expr, Kernel, Load, Plan, expr_from_json, expr_to_json
from planner.core.schema import check_document
from planner.core.torch_allowlist import loading_file

SCHEMA = "fusion-planner/candidates/1"


class BundleError(ValueError):
    """A candidates file is malformed; the message names the field."""


@dataclass(frozen=True)
class CublasCall:
    """D(M,N) = epilogue(A(M,K) @ B(K,N) [+ bias(N)]), all row-major."""

    a: str
    b: str
    bias: str | None
    epilogue: str
    m: int
    n: int
    k: int
    dtype: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class BundleKernel:
    kernel: Kernel
    cuda: CudaKernel | None  # generated source (elementwise, gemm_epilogue)
    cublas: CublasCall | None  # library call (cublaslt)
    unsupported: str | None = None  # why no GPU form exists (opaque, ...)


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    kernels: tuple[BundleKernel, ...]
    est_us: float


@dataclass(frozen=True)
class Bundle:
    graph: str
    device: str
    tensors: dict[str, TensorType]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    seed: int
    scales: dict[str, float]
    reference: Plan
    candidates: tuple[Candidate, ...]
    graph_sha256: str = ""  # Graph.fingerprint() of the exported graph

    def make_inputs(self) -> dict[str, np.ndarray]:
        """Seeded normal inputs (in bundle order), scaled, representable in their dtype (planner.core.inputs)."""
        return seeded_inputs(self.inputs, self.tensors, self.seed, self.scales)


# ---------------------------------------------------------------- writing


def cublas_call(k: Kernel, tensors: Mapping[str, TensorType]) -> CublasCall:
    mm = next(e for e in k.body.walk() if op_def(e.op).kind == OpKind.MATMUL)
    a, b = (x.tensor for x in mm.args if isinstance(x, Load))
    bias = None
    if k.epilogue is None or k.epilogue not in CUBLASLT_EPILOGUES:
        raise BundleError(f"cublaslt kernel for {k.out!r} has unknown epilogue {k.epilogue!r}")
    if epilogue_has_bias(k.epilogue):
        bias = next(r for r in k.reads if r not in (a, b))
    (m, kk), (_, n) = tensors[a].shape, tensors[b].shape
    return CublasCall(a, b, bias, k.epilogue, m, n, kk, tensors[k.out].dtype)


def kernel_to_json(k: Kernel, tensors: Mapping[str, TensorType]) -> dict[str, Any]:
    d: dict[str, Any] = {
        "kind": k.kind,
        "out": k.out,
        "reads": list(k.reads),
        "epilogue": k.epilogue,
        "body": expr_to_json(k.body),
        "cost": dataclasses.asdict(k.cost),
        "facts": dict(k.facts),
    }
    made = _device_code(k, tensors)
    if made.cublas is not None:
        d["cublaslt"] = made.cublas.to_json()
    elif made.cuda is not None:
        d["cuda"] = made.cuda.to_json()
    else:
        d["unsupported"] = made.unsupported
    return d


def plan_to_json(p: Plan) -> dict[str, Any]:
    return {
        "key": p.key,
        "plan": p.notation(),
        "partition": list(p.partition) if p.partition is not None else None,
        "composition": p.composition(),
        "est_us": p.est_us,
        "outputs": list(p.outputs),
        "kernels": [kernel_to_json(k, p.tensors) for k in p.kernels],
    }


def export_bundle(cands: Any, seed: int = 0, plans: list[Plan] | None = None) -> dict[str, Any]:
    """The bundle JSON of a CandidateSet (``planner.egraph.candidates``), or of some of its ``plans``."""
    graph = cands.graph
    reference = cands.unfused
    plans = list(cands.plans) if plans is None else list(plans)
    return {
        "schema": SCHEMA,
        "graph": graph.name,
        "graph_sha256": graph.fingerprint(),
        "device": cands.spec.name,
        "tensors": {n.id: {"shape": list(n.type.shape), "dtype": n.type.dtype} for n in graph.nodes},
        "inputs": {
            "names": [n.id for n in graph.inputs],
            "seed": seed,
            "scales": input_scales(graph),
            "recipe": RECIPE,
        },
        "outputs": list(graph.outputs),
        "reference": {
            "recipe": "the unfused plan's kernel bodies evaluated in float64 numpy (oracle mode)",
            **plan_to_json(reference),
        },
        "candidates": [plan_to_json(p) for p in plans],
    }


def write_bundle(cands: Any, path: str | Path, seed: int = 0) -> dict[str, Any]:
    data = export_bundle(cands, seed)
    Path(path).write_text(json.dumps(data, indent=1))
    return data


# ---------------------------------------------------------------- reading


def _kernel_from_json(d: Mapping[str, Any], where: str) -> tuple[Kernel, Mapping[str, Any]]:
    """A kernel (its fields checked by the bundle's schema) and its raw entry, whose device code
    :func:`_checked_device_code` checks against the body once the candidate's plan has passed the plan checks."""
    body = expr_from_json(d["body"], f"{where}.body")
    if not isinstance(body, Expr):
        raise BundleError(f"{where}: a kernel body must compute something, not only load")
    kind = d["kind"]
    problem = kind_problem(KernelKind(kind), body, d.get("epilogue"))
    if problem:
        raise BundleError(f"{where}: the body does not fit kind {kind}: {problem}")
    k = Kernel(
        kind=kind,
        body=body,
        out=d["out"],
        reads=tuple(d["reads"]),
        cost=KernelCost(**d["cost"]),
        epilogue=d.get("epilogue"),
        facts=dict(d.get("facts") or {}),
    )
    return k, d


def _device_code(k: Kernel, tensors: Mapping[str, TensorType]) -> BundleKernel:
    """A kernel with the CUDA source or the cuBLASLt call its body gives, made here from the body."""
    if k.kind == KernelKind.CUBLASLT:
        return BundleKernel(k, None, cublas_call(k, tensors))
    try:
        return BundleKernel(k, generate(k, dict(tensors)), None)
    except CodegenError as exc:
        return BundleKernel(k, None, None, str(exc))


def _checked_device_code(k: Kernel, d: Mapping[str, Any], tensors: Mapping[str, TensorType], where: str) -> BundleKernel:
    """The device code of a kernel read from a file: the file's copy must be what the body generates, so
    the GPU runs only code this project writes (a bundle edited to hold other source is refused)."""
    made = _device_code(k, tensors)
    given_cuda = cuda_kernel_from_json(d["cuda"]) if d.get("cuda") else None
    given_call = CublasCall(**d["cublaslt"]) if d.get("cublaslt") else None
    if given_cuda != made.cuda or given_call != made.cublas:
        raise BundleError(f"{where}: its device code is not what its body generates (the file was edited, or "
                          "written by another version of fusion-planner: export it again)")
    return made


def candidate_from_json(d: Mapping[str, Any], graph: str, tensors: dict[str, TensorType], where: str,
                        inputs: Sequence[str] | None = None, n_outputs: int | None = None) -> Candidate:
    """A candidate (its fields checked by the bundle's schema) checked as a plan file is
    (``core.planfile.check_plan_tensors``) against the tensor table, its graph's ``inputs`` (default: the tensors no
    kernel writes) and output count."""
    read = [_kernel_from_json(k, f"{where}.kernels[{i}]") for i, k in enumerate(d["kernels"])]
    part = d.get("partition")
    plan = Plan(graph, tuple(k for k, _ in read), tuple(d["outputs"]), tensors, d["key"],
                tuple(part) if part is not None else None)
    written = {k.out for k in plan.kernels}
    given = [t for t in tensors if t not in written] if inputs is None else inputs
    try:
        check_plan_tensors(plan, tensors, given, len(plan.outputs) if n_outputs is None else n_outputs, where)
    except PlanFileError as exc:
        raise BundleError(str(exc)) from None
    kernels = tuple(_checked_device_code(k, raw, tensors, f"{where}.kernels[{i}]") for i, (k, raw) in enumerate(read))
    return Candidate(plan, kernels, float(d.get("est_us", math.nan)))


def bundle_from_json(data: Any, source: str = "<json>") -> Bundle:
    """Parse a candidates bundle as untrusted data (torch names checked as in docs/security.md)."""
    with _reading(source):
        return _bundle_from_json(data, source)


@contextlib.contextmanager
def _reading(where: str) -> Iterator[None]:
    """Read untrusted data: torch names checked (docs/security.md), and a field of the wrong type or shape
    anywhere in it refused as a BundleError naming ``where``."""
    with loading_file():
        try:
            yield
        except BundleError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError, StopIteration) as exc:
            raise BundleError(f"{where}: malformed bundle ({type(exc).__name__}: {exc})") from None


def tensor_table(raw: Any, where: str) -> dict[str, TensorType]:
    """Every tensor of a bundle's graph (its types checked by the schema), each shape and dtype checked with a graph
    file's limits."""
    try:
        return {name: TensorType(*tensor_type(t["shape"], t["dtype"], name)) for name, t in raw.items()}
    except GraphError as exc:
        raise BundleError(f"{where}: {exc}") from None


def _bundle_from_json(data: Any, source: str) -> Bundle:
    if not isinstance(data, Mapping) or data.get("schema") != SCHEMA:
        raise BundleError(f"{source}: not a candidates bundle (schema {SCHEMA!r} expected)")
    check_document(data, "bundle", source, BundleError)
    tensors = tensor_table(data["tensors"], f"{source}.tensors")
    graph, inputs = data["graph"], data["inputs"]
    names, outputs = tuple(inputs["names"]), tuple(data["outputs"])
    unknown = [n for n in (*names, *outputs) if n not in tensors]
    if unknown:
        raise BundleError(f"{source}: inputs or outputs {unknown[:5]} are not in 'tensors'")
    try:
        ref = candidate_from_json(data["reference"], graph, tensors, f"{source}.reference",
                                  names, len(outputs)).plan
        cands = tuple(
            candidate_from_json(c, graph, tensors, f"{source}.candidates[{i}]", names, len(outputs))
            for i, c in enumerate(data["candidates"])
        )
    except (ValueError, TypeError) as exc:
        if isinstance(exc, BundleError):
            raise
        raise BundleError(f"{source}: {exc}") from None
    return Bundle(
        graph=graph,
        device=str(data.get("device", "")),
        tensors=tensors,
        inputs=names,
        outputs=outputs,
        seed=inputs["seed"],  # its schema: an integer numpy's generators take (non-negative, 64 bits)
        # a zero scale would draw all-zero inputs, on which every candidate "verifies": the schema wants them > 0
        scales={str(k): float(x) for k, x in inputs.get("scales", {}).items()},
        reference=ref,
        graph_sha256=str(data.get("graph_sha256", "")),
        candidates=cands,
    )


def read_bundle_json(path: str | Path) -> Any:
    """An exported file's JSON, with the input-file limits of every other file the planner reads."""
    return read_json(path, BundleError, "candidates bundle")


def load_bundle(path: str | Path) -> Bundle:
    return bundle_from_json(read_bundle_json(path), str(path))


def variant_candidate(v: Any, i: int) -> Candidate:
    """One C-05 variant (a candidate with its graph name and tensors inline)."""
    check_document(v, "bundle", f"variants[{i}]", BundleError, part="candidate")
    if "tensors" not in v:
        raise BundleError(f"variants[{i}]: a C-05 variant needs its 'tensors'")
    with _reading(f"variants[{i}]"):
        return candidate_from_json(v, str(v.get("graph", "")), tensor_table(v["tensors"], f"variants[{i}].tensors"),
                                   f"variants[{i}]")


def generated_kernels(path: str | Path) -> list[CudaKernel]:
    """Every generated kernel of an exported file: a candidates bundle, or a C-05 bundle (its ``variants``)."""
    data = read_bundle_json(path)
    if isinstance(data, dict) and "variants" in data:
        cands = [variant_candidate(v, i) for i, v in enumerate(data["variants"])]
    else:
        cands = list(bundle_from_json(data, str(path)).candidates)
    return [bk.cuda for cand in cands for bk in cand.kernels if bk.cuda is not None]
