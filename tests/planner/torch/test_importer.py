"""The torch frontend: planned modules equal eager torch; torch.compile backend; clear errors."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from testpaths import ROOT

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import planner.torch.importer  # noqa: E402
from planner.api import allclose_report  # noqa: E402
from planner.core.cost import load_device  # noqa: E402
from planner.core.ops import OpError  # noqa: E402
from planner.core.report import kernel_name  # noqa: E402
from planner.torch.errors import TorchImportError  # noqa: E402
from planner.torch.importer import TORCH_DTYPES, import_module, load_factory  # noqa: E402
from planner.torch.ops import resolve_torch_fn  # noqa: E402
from planner.torch.tracing import Recorder  # noqa: E402

# The numpy reference always runs; the generated-C cpu backend once it is importable.
BACKENDS = ["reference"] + (["cpu"] if importlib.util.find_spec("backends.cpu.backend") else [])


class MLP(nn.Module):
    def __init__(self, act: nn.Module, d: int = 16, h: int = 32) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, h), act, nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Residual(nn.Module):
    """Two residual Linear blocks with functional ops and scalar affine arithmetic."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        x = x + F.gelu(self.a(x), approximate="tanh")
        y = F.relu(self.b(x)) * 0.5 - 1.0
        return x + (-y) / 4.0


class SwiGLU(nn.Module):
    def __init__(self, d: int = 16, h: int = 24) -> None:
        super().__init__()
        self.gate = nn.Linear(d, h, bias=False)
        self.up = nn.Linear(d, h, bias=False)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class TwoOutputs(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)

    def forward(self, x):
        h = F.silu(self.fc(x))
        return h + x, torch.softmax(self.ln(h), dim=-1)


def _block() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return load_factory(str(ROOT / "examples/transformer_block.py:build"))


FAMILIES = {
    "mlp-gelu-tanh": lambda: MLP(nn.GELU(approximate="tanh")),
    "mlp-gelu-erf": lambda: MLP(nn.GELU()),
    "mlp-relu": lambda: MLP(nn.ReLU()),
    "mlp-silu": lambda: MLP(nn.SiLU()),
    "swiglu": SwiGLU,
    "residual": Residual,
    "two-outputs": TwoOutputs,
    "transformer-block": lambda: _block()[0],
}
SHAPE = {"transformer-block": (2, 8, 64)}


def _model(name: str, dtype: torch.dtype) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    m = FAMILIES[name]().eval().to(dtype)
    return m, torch.randn(*SHAPE.get(name, (2, 6, 16)), dtype=dtype)


def _assert_close(got, want) -> None:
    got, want = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        ok, max_abs, max_rel = allclose_report(g.float().numpy(), w.detach().float().numpy(), TORCH_DTYPES[w.dtype])
        assert ok, (max_abs, max_rel)


CASES = [(n, torch.float32) for n in FAMILIES] + [
    (n, torch.bfloat16) for n in ("mlp-gelu-tanh", "swiglu", "two-outputs", "transformer-block")
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("name", "dtype"), CASES, ids=[f"{n}-{str(d)[6:]}" for n, d in CASES])
def test_plan_matches_eager(name: str, dtype: torch.dtype, backend: str) -> None:
    m, x = _model(name, dtype)
    opts = {} if backend == "reference" else {"max_candidates": 6, "repeats": 3}
    result = planner.plan(m, (x,), backend=backend, device="h200", **opts)
    x2 = torch.randn_like(x)  # fresh values, the planned shapes
    with torch.no_grad():
        _assert_close(result(x2), m(x2))
    assert result.plan in result.candidates.plans
    assert result.log
    starred = [line for line in result.table().splitlines() if line.startswith("*")]
    assert len(starred) == 1 and kernel_name(result.plan.kernels[0])[:16] in starred[0]


def test_mapping_uses_the_op_table() -> None:
    ops = lambda name: {n.op for n in import_module(*_model(name, torch.float32)).graph.ops}  # noqa: E731
    assert ops("mlp-gelu-tanh") == {"MatMul", "BiasAdd", "GeluTanh"}
    assert ops("mlp-gelu-erf") == {"MatMul", "BiasAdd", "GeluErf"}
    assert ops("swiglu") == {"MatMul", "Silu", "Mul"}
    assert ops("residual") == {"MatMul", "BiasAdd", "GeluTanh", "Add", "Relu", "Affine", "Neg"}
    g = import_module(*_model("mlp-relu", torch.float32)).graph
    assert g["x"].type.shape == (12, 16)  # (2, 6, 16) flattened: M = 2 * 6
    assert g["fc1.weight.T"].type.shape == (16, 32)  # Linear weight bound as (K, N)


def test_erf_gelu_never_gets_a_cublaslt_gelu_epilogue() -> None:
    def gelu_epilogues(name: str) -> int:
        result = planner.plan(*_model(name, torch.float32), backend="reference")
        return sum(
            1 for p in result.candidates.plans for k in p.kernels if k.kind == "cublaslt" and "GELU" in (k.epilogue or "")
        )

    assert gelu_epilogues("mlp-gelu-erf") == 0
    assert gelu_epilogues("mlp-gelu-tanh") > 0  # the check can fail: the tanh model does get them


class MaskedAttention(nn.Module):
    """Attention with a mask per head (which the importer keeps as one torch call) after a LayerNorm."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)

    def forward(self, x):
        b, s, d = x.shape
        q = self.ln(x).view(b, s, 2, d // 2).transpose(1, 2)
        mask = torch.arange(2.0).view(1, 2, 1, 1) * torch.ones(s, s).tril()  # one mask per head: not mapped
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask).transpose(1, 2).reshape(b, s, d)


def test_opaque_ops_are_logged_and_saved_by_name(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    m, x = MaskedAttention().eval(), torch.randn(2, 5, 16)
    with caplog.at_level(logging.INFO, logger="planner.torch.importer"):
        result = planner.plan(m, (x,), backend="reference")
    assert "stayed opaque" in caplog.text and "scaled_dot_product_attention" in caplog.text
    out = result.save(tmp_path)
    plan = json.loads((out / "plan.json").read_text())
    impls = {k["body"]["attrs"]["impl"] for k in plan["plan"]["kernels"] if k["kind"] == "opaque"}
    assert any("scaled_dot_product_attention" in i for i in impls), impls  # traced by torch.export: the aten op
    assert not any("layer_norm" in i for i in impls) and "RowMean" in {n.op for n in result.graph.ops}  # fp32: fused
    assert json.loads((out / "graph.json").read_text())["format"] == "fusion-planner-graph"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="planner.torch.importer"):
        import_module(*_block())
    assert "stayed opaque" not in caplog.text  # the block's attention and its head layouts are op-table ops


def test_saved_plan_executes_in_a_fresh_process(tmp_path: Path) -> None:
    """Torch-backed Opaque impls are found by name in a process that never imported the frontend."""
    m, (x,) = _block()
    result = planner.plan(m, (x,), backend="reference")
    result.save(tmp_path)
    feed = planner.torch.importer.graph_inputs_from_module(result.imported, m, (x,))
    np.savez(tmp_path / "feed.npz", **feed)
    code = (
        "import sys, numpy as np; from planner.core.graph import load_graph; from planner.core.reference import execute_graph;"
        "g = load_graph(sys.argv[1] + '/graph.json'); feed = dict(np.load(sys.argv[1] + '/feed.npz'));"
        "assert 'planner.torch.importer' not in sys.modules; outs = [execute_graph(g, feed)[0]];"
        "from planner.core.planfile import load_plan; from planner.core.reference import execute_plan;"
        "plan, graph, spec, meta = load_plan(sys.argv[1] + '/plan.json'); outs.append(execute_plan(plan, feed)[0]);"
        "np.save(sys.argv[1] + '/out.npy', np.stack(outs))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    with torch.no_grad():
        want = m(x).reshape(-1, 64).numpy()
    for got in np.load(tmp_path / "out.npy"):
        assert allclose_report(got, want, "fp32")[0]


def test_single_use_torch_calls_fold_into_one_opaque_kernel() -> None:
    class Chains(nn.Module):
        def forward(self, x):
            s = torch.log_softmax(x, dim=-1)  # two users: its own kernel
            t = torch.erf(s).transpose(0, 1)  # single-use chain: one kernel with two calls
            u = torch.cat([t, t], dim=1).transpose(0, 1)  # t referenced twice in one call
            return torch.cos(s) + u[:4]

    m, x = Chains(), torch.randn(4, 8)
    imported = import_module(m, (x,))
    opaque = [n for n in imported.graph.ops if n.op == "Opaque"]
    steps = {n.id: [st["impl"] for st in json.loads(n.attr_dict["call"])["steps"]] for n in opaque}
    assert len(opaque) == 3, steps  # log_softmax | cos | erf+transpose+cat+transpose+getitem
    used = {i for n in imported.graph.nodes for i in n.inputs} | set(imported.graph.outputs)
    assert all(n.id in used for n in opaque)  # nothing emitted and then dropped
    _assert_close(planner.plan(m, (x,), backend="reference")(x), m(x))
    masked = import_module(MaskedAttention().eval(), (torch.randn(2, 5, 16),)).graph
    assert sum(n.op == "Opaque" for n in masked.ops) == 1  # attention with its view/transpose/reshape steps folded in


def test_opaque_names_are_an_allowlist() -> None:
    assert resolve_torch_fn("torch.softmax") is torch.softmax
    assert resolve_torch_fn("torch.ops.aten.softmax.int") is torch.ops.aten.softmax.int
    for bad in ("torch.load", "torch.save", "torch.Tensor.numpy", "torch.hub.load", "torch.operator.setitem", "os.system"):
        with pytest.raises(OpError):
            resolve_torch_fn(bad)


def test_parameters_are_bound_at_call_time() -> None:
    m, x = _model("mlp-relu", torch.float32)
    result = planner.plan(m, (x,), backend="reference")
    with torch.no_grad():
        m.fc2.bias.add_(1.0)
        _assert_close(result(x), m(x))


@pytest.mark.parametrize("backend", BACKENDS)
def test_parameters_are_converted_once_and_again_only_when_they_change(backend, monkeypatch) -> None:
    """A call converts only its inputs; the cpu backend reads fp32 inputs in place (no copy at all); a
    parameter updated in place, or replaced, is converted again; rebind() forgets every bound parameter."""
    import backends.cpu.compiled as cpu  # where a compiled plan copies its inputs into its buffers

    m, x = _model("mlp-relu", torch.float32)
    result = planner.plan(m, (x,), backend=backend, max_candidates=2)
    copies = []
    real = cpu.to_storage
    monkeypatch.setattr(cpu, "to_storage", lambda arr, dtype, out: (copies.append(arr.shape), real(arr, dtype, out)))
    params = sum(1 for b in result.imported.bindings if b.source == "state")
    result(x)  # planning already called it once, to check it against eager torch
    assert result.bound.conversions == params
    first = len(copies)
    for _ in range(3):
        _assert_close(result(x), m(x))
    assert result.bound.conversions == params  # not converted again
    if backend == "cpu":
        assert first == 0 and len(copies) == 0  # parameters and the activation are read where they lie
        assert result.compiled.binds >= 4 * (params + 1)
    with torch.no_grad():
        m.fc2.bias.add_(1.0)  # in place: torch's version counter moves
        _assert_close(result(x), m(x))
        m.fc1.weight = nn.Parameter(m.fc1.weight * 2)  # replaced
        _assert_close(result(x), m(x))
    assert result.bound.conversions == params + 2
    with torch.no_grad():
        m.fc2.bias.data.mul_(3.0)  # invisible to the version counter
    result.rebind()
    with torch.no_grad():
        _assert_close(result(x), m(x))


def test_in_place_ops_are_mapped_out_of_place() -> None:
    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.act = nn.Linear(16, 16), nn.ReLU(inplace=True)

        def forward(self, x):
            h = self.fc(x)
            h += x  # a residual written in place
            h.mul_(2.0)
            return self.act(h) + h  # the ReLU overwrote h: eager gives 2 * relu(h)

    m = InPlace().eval()
    x = torch.randn(2, 6, 16)
    result = planner.plan(m, (x,), backend="reference")
    assert "Opaque" not in {n.op for n in result.graph.ops}
    with torch.no_grad():
        _assert_close(result(x), m(x.clone()))


def test_the_import_runs_the_model_once_and_copies_values_only_when_a_later_op_is_in_place(monkeypatch) -> None:
    """Importing runs the model once (the recorder), not also a separate eager check, and copies the
    recorded values only for a graph with an in-place op, which could overwrite them."""

    calls = []

    class Chain(nn.Module):
        def forward(self, x):
            calls.append(1)
            return torch.relu(2.0 * x + 1.0)

    copies = []
    real_clone = torch.Tensor.clone
    monkeypatch.setattr(torch.Tensor, "clone", lambda t, *a, **k: (copies.append(1), real_clone(t, *a, **k))[1])
    import_module(Chain(), (torch.randn(64),))
    assert copies == [] and len(calls) == 1  # fx tracing calls forward once, with proxies
    gm = torch.fx.symbolic_trace(nn.ReLU(inplace=True))
    assert Recorder(gm).copy and not Recorder(torch.fx.symbolic_trace(Chain())).copy


def test_primitive_ops_and_a_written_out_gelu_import_as_fusable_ops() -> None:
    """GPT-2's GELU written with ``torch.pow`` and ``torch.tanh``, and the other one-tensor primitives
    (exp, sqrt, rsqrt, sigmoid, square, ``** 2``, ``** 0.5``) and tensor / tensor, are op-table ops, not Opaque: the whole
    body can be one fused kernel, and the CPU plan matches eager torch."""
    import math

    from planner.egraph.candidates import build_candidates

    class Primitives(nn.Module):
        def forward(self, x):
            g = 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
            h = (torch.rsqrt(torch.sigmoid(F.tanh(g)).exp() ** 2 + 1.0).square() + 1.0) ** 0.5
            return h / (x * x + 1.0)

    m = Primitives().eval()
    x = torch.randn(8, 64)
    result = planner.plan(m, (x,), backend="cpu", max_candidates=8)
    ops = {n.op for n in result.graph.ops}
    assert "Opaque" not in ops and {"Tanh", "Sigmoid", "Exp", "Sqrt", "Rsqrt", "Square", "Mul", "Div"} <= ops
    assert min(len(p.kernels) for p in build_candidates(result.graph, load_device("seed-k4")).plans) == 1
    with torch.no_grad():
        _assert_close(result(x), m(x))
    chain = planner.plan(nn.Sequential(nn.Tanh(), nn.Sigmoid()), (x,), backend="reference")
    assert [n.op for n in chain.graph.ops] == ["Tanh", "Sigmoid"]  # the modules' forward calls torch.tanh/sigmoid


def test_written_out_gelu_and_silu_become_the_ops_themselves_and_library_epilogues() -> None:
    """The rules of algebra.egg: GPT-2's MLP as the library writes it (Conv1D's addmm, the written-out tanh
    GELU) gets cuBLASLt's GELU_BIAS epilogue, and ``h * torch.sigmoid(h)`` is SiLU in the GEMM's epilogue."""
    import math

    class Gpt2Mlp(nn.Module):
        def __init__(self, d: int = 32) -> None:
            super().__init__()
            self.fc, self.proj = Conv1DOnTheInput(d, 4 * d), Conv1DOnTheInput(4 * d, d)

        def forward(self, x):
            h = self.fc(x)
            return self.proj(0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0)))))

    class SiluByHand(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(32, 48)

        def forward(self, x):
            h = self.fc(x)
            return h * torch.sigmoid(h)

    x = torch.randn(2, 8, 32)
    for module, expect in ((Gpt2Mlp(), "GeluTanh"), (SiluByHand(), "Silu")):
        m = module.eval()
        modelled = planner.plan(m, (x,), backend="reference", cache=False)  # the cost model's choice
        assert expect not in {n.op for n in modelled.graph.ops}  # written out in the graph...
        assert any(expect in k.ops for k in modelled.plan.kernels)  # ...one op in the plan, by the rules
        if expect == "GeluTanh":
            assert "GELU_BIAS" in {k.epilogue for p in modelled.candidates.plans for k in p.kernels}
        measured = planner.plan(m, (x,), backend="cpu", max_candidates=8, cache=False, threads=1)
        with torch.no_grad():
            _assert_close(measured(x), m(x))


def test_sub_neg_maximum_minimum_are_ops_that_match_torch_bit_for_bit() -> None:
    """tensor - tensor, -x, torch.maximum and torch.minimum import as ``Sub``, ``Neg``, ``Maximum`` and
    ``Minimum``; one fused C kernel gives torch's bits on NaN, ±0 ties and infinities."""

    class Picks(nn.Module):
        def forward(self, x, y):
            return torch.maximum(x, -y) - torch.minimum(y, x).neg()

    edge = torch.tensor([float("nan"), 0.0, -0.0, 1.0, float("inf"), -float("inf"), 2.0, -3.0])
    x = torch.cat([edge, edge.flip(0), torch.randn(48)]).reshape(4, 16)
    y = torch.cat([edge.roll(1), -edge, torch.randn(48)]).reshape(4, 16)
    m = Picks().eval()
    result = planner.plan(m, (x, y), backend="cpu", max_candidates=4, cache=False)
    assert {n.op for n in result.graph.ops} == {"Maximum", "Minimum", "Sub", "Neg"}
    assert len(result.plan.kernels) == 1
    want = m(x, y)
    got = result(x, y)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num().view(torch.int32), want.nan_to_num().view(torch.int32))
    for a, b in ((0.0, -0.0), (-0.0, 0.0)):  # a tie gives the second operand, as torch and numpy do
        ta, tb = torch.full((4, 16), a), torch.full((4, 16), b)
        assert torch.equal(result(ta, -tb).view(torch.int32), m(ta, -tb).view(torch.int32))


#: clamp-like calls -> the Clamp they import as (lo, hi, sides), or None where a tensor bound keeps the torch call
CLAMPS = {
    "clamp": (lambda x: torch.clamp(x, -0.5, 0.75), (-0.5, 0.75, "both")),
    "clamp-min": (lambda x: x.clamp(min=0.25), (0.25, 0.0, "min")),
    "clamp-max": (lambda x: x.clamp_max(0.5), (0.0, 0.5, "max")),
    "clip": (lambda x: torch.clip(x, max=1.0, min=-1.0), (-1.0, 1.0, "both")),
    "hardtanh": (lambda x: F.hardtanh(x, -2.0, 0.5), (-2.0, 0.5, "both")),
    "relu6": (nn.ReLU6(inplace=True), (0.0, 6.0, "both")),
    "in-place": (lambda x: (x * 2).clamp_(min=-1.0), (-1.0, 0.0, "min")),
    "tensor-bound": (lambda x: torch.clamp(x, min=torch.zeros(16)), None),
}


@pytest.mark.parametrize("name", list(CLAMPS))
def test_clamps_import_as_the_clamp_op_and_keep_torchs_values(name: str) -> None:
    """clamp (both or one bound), clip, hardtanh, relu6 and an in-place clamp_ import as ``Clamp``; one fused C
    kernel gives torch's values on NaN and infinities. A tensor of bounds stays a torch call."""
    fn, want_attrs = CLAMPS[name]

    class Clamped(nn.Module):
        def forward(self, x):
            return fn(x + 1.0)

    edge = torch.tensor([float("nan"), 0.0, -0.0, 1.0, float("inf"), -float("inf"), 2.0, -3.0])
    x = torch.cat([edge, edge.flip(0), torch.randn(48) * 3]).reshape(4, 16)
    m = Clamped().eval()
    clamps = [n for n in import_module(m, (x,)).graph.ops if n.op == "Clamp"]
    if want_attrs is None:
        assert not clamps
    else:
        assert [(n.attr_dict["lo"], n.attr_dict["hi"], n.attr_dict["sides"]) for n in clamps] == [want_attrs]
    result = planner.plan(m, (x,), backend="cpu", max_candidates=4, cache=False)
    want, got = m(x), result(x)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_leaky_relu_hardswish_and_hardsigmoid_import_as_ops_and_keep_torchs_values() -> None:
    class Hard(nn.Module):
        def forward(self, x):
            return F.leaky_relu(x, 0.2) + F.hardswish(x) * F.hardsigmoid(x) + nn.LeakyReLU()(x - 1)

    edge = torch.tensor([float("nan"), 0.0, -0.0, 1.0, float("inf"), -float("inf"), 3.0, -3.0])
    x = torch.cat([edge, edge.flip(0), torch.randn(48) * 4]).reshape(4, 16)
    m = Hard().eval()
    ops = Counter(n.op for n in import_module(m, (x,)).graph.ops)
    assert ops["LeakyRelu"] == 2 and ops["Hardswish"] == 1 and ops["Hardsigmoid"] == 1 and "Opaque" not in ops
    result = planner.plan(m, (x,), backend="cpu", max_candidates=4, cache=False)
    want, got = m(x), result(x)
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=1e-6, atol=1e-6)


def test_an_in_place_write_into_a_view_changes_the_value_it_views() -> None:
    """A write through ``permute`` (the same rows) or ``view`` of a computed value reaches the value: planned,
    equal to eager; through a view the plan holds as a copy, while the value is read after, it is refused by name
    (before: the write was lost and the plan differed from eager)."""

    class Through(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            y = self.conv(x)
            y.permute(0, 2, 3, 1).mul_(2.0)
            z = y * 1.5
            z.view(z.shape).add_(1.0)
            return y + z

    class Flattened(nn.Module):
        def forward(self, x):
            y = x * 2
            y.view(-1).add_(1.0)
            return y * 3

    class Part(nn.Module):
        def forward(self, x):
            part = (x * 2)[0]
            part.add_(1.0)
            return part * 3

    x = torch.randn(2, 4, 5, 5)
    for m in (Through().eval(), Part()):
        result = planner.plan(m, (x,), backend="cpu", cache=False, max_candidates=2)
        with torch.no_grad():
            torch.testing.assert_close(result(x), m(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(TorchImportError, match="holds as a copy.*'mul' is read after the write"):
        import_module(Flattened(), (x,))


def test_norms_and_softmax_import_as_row_ops_and_fuse_into_one_row_kernel() -> None:
    """nn.LayerNorm after a residual add, LLaMA's RMSNorm written out (pow, mean, rsqrt, a weight),
    F.softmax and F.layer_norm import as row reductions and per-row ops, no Opaque node: the whole
    body can be one row kernel, and the CPU plan matches eager torch."""

    class Rows(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(48)
            self.w = nn.Parameter(torch.randn(48))

        def forward(self, x, r):
            h = self.ln(x + r)
            h = self.w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
            return F.softmax(h, dim=-1) + F.layer_norm(h, (48,)) - h.amax(-1, keepdim=True) / h.sum(-1, keepdim=True)

    from planner.egraph.candidates import build_candidates

    m = Rows().eval()
    x, r = torch.randn(2, 5, 48), torch.randn(2, 5, 48)
    result = planner.plan(m, (x, r), backend="cpu", max_candidates=8)
    ops = {n.op for n in result.graph.ops}
    assert "Opaque" not in ops
    assert {"RowMean", "RowMax", "RowSum", "SubRow", "MulRow", "DivRow", "BiasMul", "Exp", "Rsqrt"} <= ops
    assert min(len(p.kernels) for p in build_candidates(result.graph, load_device("seed-k4")).plans) == 1
    with torch.no_grad():
        _assert_close(result(x, r), m(x, r))


def test_a_norm_written_another_way_fuses_through_the_primitives() -> None:
    """RMSNorm as ``x / sqrt(mean(x**2) + eps) * w`` matches no named norm: it imports as Square, RowMean,
    Affine, Sqrt, DivRow and BiasMul, and the rules still give a one-row-kernel plan."""
    from planner.egraph.candidates import build_candidates

    class OtherRMS(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(40))

        def forward(self, x):
            return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w

    m, x = OtherRMS().eval(), torch.randn(3, 7, 40)
    result = planner.plan(m, (x,), backend="cpu", max_candidates=4)
    assert [n.op for n in result.graph.ops] == ["Square", "RowMean", "Affine", "Sqrt", "DivRow", "BiasMul"]
    assert min(len(p.kernels) for p in build_candidates(result.graph, load_device("seed-k4")).plans) == 1
    with torch.no_grad():
        _assert_close(result(x), m(x))


def test_exported_dtype_assertions_are_dropped() -> None:
    """``torch.export`` writes ``aten._assert_tensor_metadata`` for each ``.to(dtype)`` (every LLaMA-style
    RMSNorm): the importer drops it instead of refusing the module."""

    class Norm(nn.Module):
        def forward(self, x):
            h = x.to(torch.float32)
            return torch.rsqrt(h * h + 1.0).to(x.dtype) * x

    x = torch.randn(4, 32)
    ep = torch.export.export(Norm().eval(), (x,))
    assert "_assert_tensor_metadata" in str(ep.graph)
    result = planner.plan(ep, (x,), backend="reference")
    assert "Opaque" not in {n.op for n in result.graph.ops}
    _assert_close(result(x), Norm()(x))


def test_dtype_conversions_and_promotions_are_casts_in_the_graph() -> None:
    """``.to(dtype)``, ``.float()``, ``.half()`` and torch's promotion of a bf16 tensor times an fp32 one are the
    op table's Cast (no Opaque node); through torch.export too (its ``_to_copy``). Each value keeps torch's dtype."""

    class Mixed(nn.Module):
        def forward(self, x, y):
            h = x.float().softmax(-1)  # softmax computed in fp32
            z = (x * y).half()  # bf16 * fp32 is fp32 in torch, then fp16
            return h.to(x.dtype) + x, z.float() * 2.0

    x, y = torch.randn(6, 40).bfloat16(), torch.randn(6, 40)
    for traced in (Mixed().eval(), torch.export.export(Mixed().eval(), (x, y))):
        result = planner.plan(traced, (x, y), backend="cpu", cache=False, max_candidates=4)
        graph = result.graph
        assert "Opaque" not in {n.op for n in graph.ops}
        assert sorted(dict(n.attrs)["dtype"] for n in graph.ops if n.op == "Cast") == ["bf16", "fp16", "fp32", "fp32",
                                                                                      "fp32"]
        assert {n.type.dtype for n in graph.ops if n.op in ("RowMax", "RowSum", "Mul")} == {"fp32"}
        got, want = result(x, y), Mixed()(x, y)
        assert [t.dtype for t in got] == [torch.bfloat16, torch.float32]
        for g, w in zip(got, want, strict=True):
            _assert_close(g, w)


def test_torch_compile_plans_a_graph_with_integer_inputs_and_runs_a_boolean_one_eagerly(
        caplog: pytest.LogCaptureFixture) -> None:
    torch._dynamo.reset()

    class Embed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 8)

        def forward(self, ids):
            return torch.relu(self.emb(ids))

    class Masked(nn.Module):
        def forward(self, x, keep):
            return torch.where(keep, x, 0.0) * 2.0

    m = Embed().eval()
    ids = torch.tensor([[1, 2, 3], [4, 5, 9]])
    with caplog.at_level(logging.INFO, logger="planner.dynamo"), torch.no_grad():
        got = torch.compile(m, backend="fusion_planner", options={"backend": "reference"})(ids)
        _assert_close(got, m(ids))
        assert "planned" in caplog.text  # token ids feed the Opaque embedding; the ReLU is an op-table op
        caplog.clear()
        x, keep = torch.randn(4), torch.tensor([True, False, True, True])
        assert torch.equal(torch.compile(Masked(), backend="fusion_planner")(x, keep), Masked()(x, keep))
    assert re.search(r"a graph input is bool", caplog.text) and "runs eagerly" in caplog.text
    torch._dynamo.reset()


def test_a_language_model_called_with_token_ids_plans_its_embedding_as_an_op() -> None:
    """A 2-layer language model called with token ids: the lookup is the op table's Embedding (no Opaque node),
    the ids reach it exactly (bound as fp32), and an id outside the table is an error, as in torch."""
    torch.manual_seed(0)
    block, _ = _block()

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(50, 64)
            self.blocks = nn.ModuleList([type(block)(64, 4, 256), type(block)(64, 4, 256)])
            self.head = nn.Linear(64, 50, bias=False)

        def forward(self, ids):
            x = self.emb(ids)
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    lm, ids = LM().eval(), torch.randint(0, 50, (2, 16))
    result = planner.plan(lm, (ids,), backend="cpu", cache=False, max_candidates=6)
    ops = [n.op for n in result.graph.ops]
    assert "Opaque" not in ops and ops.count("Embedding") == 1
    with torch.no_grad():
        _assert_close(result(ids), lm(ids))
        other = torch.randint(0, 50, (2, 16))
        _assert_close(result(other), lm(other))
    for bad in (50, -1):
        with pytest.raises(IndexError, match=f"id {bad} is not a row of a table of 50 rows"):
            result(torch.where(ids == ids[0, 0], bad, ids))
    with pytest.raises(RuntimeError, match="indices"):  # float ids: no plan can be made; eager torch's own error
        result(ids.float())
    with pytest.raises(TorchImportError, match="exact only below"):
        result(torch.full((2, 16), 2**24))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_integer_inputs_are_carried_as_exact_fp32_up_to_the_limit(dtype) -> None:
    """Token ids and masks reach a plan as fp32 converted from the tensor's memory: exact up to 2**24 - 1 either
    side of 0, strided and transposed tensors included; 2**24 or more is an error naming the input."""
    from planner.torch.binding import INDEX_LIMIT, to_numpy

    t = torch.tensor([[INDEX_LIMIT - 1, -(INDEX_LIMIT - 1), 0], [7, 1, -3]], dtype=dtype)
    np.testing.assert_array_equal(to_numpy(t), t.numpy().astype(np.float64))
    np.testing.assert_array_equal(to_numpy(t[:, ::2]), t[:, ::2].numpy())
    np.testing.assert_array_equal(to_numpy(t, transpose=True), t.numpy().T)
    assert to_numpy(t).dtype == np.float32 and to_numpy(t[:, ::2]).flags.c_contiguous
    for bad in (INDEX_LIMIT, -INDEX_LIMIT, 2**31 - 1):
        with pytest.raises(TorchImportError, match="exact only below"):
            to_numpy(torch.tensor([[1, bad]], dtype=dtype))


def test_shape_dependent_control_flow_falls_back_to_export() -> None:
    class Shapey(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            return F.relu(self.fc(x)) if x.shape[0] > 1 else x

    m = Shapey().eval()
    x = torch.randn(4, 16)
    result = planner.plan(m, (x,), backend="reference")
    assert result.imported.tracer == "export"
    _assert_close(result(x), m(x))


class Optional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, shift=None):
        h = F.relu(self.fc(x))
        return h if shift is None else h + shift


def test_an_input_left_to_its_default_is_planned_by_export_and_given_later_gets_a_plan_of_its_own() -> None:
    m, x, shift = Optional().eval(), torch.randn(4, 16), torch.randn(4, 16)
    result = planner.plan(m, (x,), backend="reference")
    assert result.imported.tracer == "export"  # fx would make ``shift`` a second graph input
    _assert_close(result(x), m(x))
    _assert_close(result(x, shift), m(x, shift))
    _assert_close(result(x, shift=shift), m(x, shift))
    _assert_close(result(shift=shift, x=x), m(x, shift))
    _assert_close(result(x=x), m(x))
    with pytest.raises(TypeError, match="Optional.forward: .*scale"):
        result(x, scale=2.0)


class Copied:
    """A result type whose rebuild copies the tensors it is given, as transformers' ``DynamicCache`` does."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t.clone()


torch.utils._pytree.register_pytree_node(Copied, lambda c: ([c.t], None), lambda values, _: Copied(values[0]))


class ReturnsCopied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        h = F.relu(self.fc(x))
        return h, Copied(h * 2)


def test_a_result_whose_rebuild_reads_the_tensors_gets_them_computed() -> None:
    """The cpu backend hands a plain result's tensors out before its kernels run (they only view its arrays);
    a result type whose rebuild copies them must get them after: it copied unwritten memory before."""
    m, x = ReturnsCopied().eval(), torch.randn(4, 16)
    result = planner.plan(m, (x,), backend="cpu", max_candidates=2)
    assert not result.imported.wraps_views(["fp32", "fp32"])
    for _ in range(2):
        h, copied = result(x)
        with torch.no_grad():
            want_h, want = m(x)
        _assert_close(h, want_h)
        _assert_close(copied.t, want.t)


def test_a_loop_over_a_split_is_traced_by_fx_with_its_concrete_length() -> None:
    """GPT-2-style attention iterating over ``qkv.split(d, -1)`` in a generator: fx alone cannot iterate a traced
    value; the tracer takes the length from the example inputs, so no torch.export (1.2 s) is needed. A loop over
    a value computed after an in-place op is not evaluated (it would write the caller's tensor): torch.export."""

    class Att(nn.Module):
        def forward(self, qkv):
            b, s, _ = qkv.shape
            q, k, v = (t.view(b, s, 2, 8).transpose(1, 2) for t in qkv.split(16, dim=-1))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return a.transpose(1, 2).reshape(b, s, 16)

    class InPlace(nn.Module):
        def forward(self, x):
            x.mul_(2.0)
            return sum(t.relu() for t in x.split(4, dim=-1))

    x = torch.randn(2, 8, 48)
    imported = import_module(Att().eval(), (x,))
    assert imported.tracer == "fx" and "Opaque" not in {n.op for n in imported.graph.ops}
    result = planner.plan(Att().eval(), (x,), backend="reference")
    _assert_close(result(x), Att()(x))
    y = torch.randn(3, 8)
    before = y.clone()
    with pytest.raises(TorchImportError, match="writes the module's call input 'x' in place"):
        import_module(InPlace(), (y,))  # traced by torch.export, whose ATen mul_ writes the input: refused
    assert torch.equal(y, before)


def test_data_dependent_control_flow_is_a_clear_error() -> None:
    class Branchy(nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x * 2
            return x - 1

    with pytest.raises(TorchImportError) as err:
        planner.plan(Branchy(), torch.randn(4, 8), backend="reference")
    msg = str(err.value)
    assert "if x.sum() > 0" in msg and "torch.export" in msg and "control flow" in msg


@pytest.mark.parametrize(
    ("model", "inputs", "needle"),
    [
        (nn.Linear(8, 8), torch.randn(4, 8, dtype=torch.float64), "float64"),
        (nn.Linear(8, 8).double(), torch.randn(4, 8), "parameter 'weight' has dtype float64"),
        (nn.Linear(8, 8), torch.randn(4, 8).long(), "do not fit Linear"),  # indices are accepted; Linear takes none
        (nn.Linear(8, 8), torch.randn(4, 8) > 0, "has dtype bool"),
        (nn.Linear(8, 8), torch.randn(4, 7), "do not fit Linear"),
        (nn.Linear(8, 8), (torch.randn(4, 8), torch.randn(4, 8)), "do not match Linear.forward"),
    ],
    ids=["fp64-input", "fp64-param", "int-input", "bool-input", "wrong-shape", "too-many-inputs"],
)
def test_bad_example_inputs(model: nn.Module, inputs, needle: str) -> None:
    with pytest.raises(TorchImportError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        planner.plan(model, inputs, backend="reference")


def test_calling_with_other_shapes_plans_them_or_is_refused_by_choice() -> None:
    from planner.torch.guards import GuardError

    m, x = _model("mlp-relu", torch.float32)
    other = torch.randn(3, 6, 16)
    _assert_close(planner.plan(m, (x,), backend="reference")(other), m(other))
    with pytest.raises(GuardError, match=r"other inputs than inputs \[3, 6, 16\] float32"):
        planner.plan(m, (x,), backend="reference", on_change="error")(other)


def test_torch_compile_backend_matches_eager() -> None:
    torch._dynamo.reset()
    m, x = _model("residual", torch.float32)
    compiled = torch.compile(m, backend="fusion_planner")
    with torch.no_grad():
        _assert_close(compiled(x), m(x))
        x2 = torch.randn_like(x)
        _assert_close(compiled(x2), m(x2))
    torch._dynamo.reset()


def test_torch_compile_plans_each_shape_of_a_dynamic_graph() -> None:
    torch._dynamo.reset()
    m, x = _model("mlp-relu", torch.float32)
    compiled = torch.compile(m, backend="fusion_planner")
    with torch.no_grad():
        compiled(x)
        for rows in (3, 5):  # the second shape makes dynamo capture the graph with a dynamic size
            x3 = torch.randn(rows, 6, 16)
            _assert_close(compiled(x3), m(x3))
        fixed = torch.compile(m, backend="fusion_planner", dynamic=False)
        for rows in (2, 3):  # each shape gets its own plan
            x3 = torch.randn(rows, 6, 16)
            _assert_close(fixed(x3), m(x3))
    torch._dynamo.reset()


def test_torch_compile_backend_is_an_entry_point() -> None:
    """In a fresh interpreter that never imports planner, torch finds the backend by its entry point."""
    code = (
        "import sys, torch; from torch import nn; torch.manual_seed(0);"
        "m = nn.Sequential(nn.Linear(8, 8), nn.GELU(approximate='tanh')).eval(); x = torch.randn(4, 8);"
        "assert 'planner' not in sys.modules;"
        "y = torch.compile(m, backend='fusion_planner')(x);"
        "assert 'planner.torch.importer' in sys.modules;"
        "print(float((y - m(x)).abs().max()))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.strip().splitlines()[-1]) < 1e-4


@pytest.mark.parametrize("example", ["mlp", "swiglu_mlp", "transformer_block"])
def test_example_factories_plan_from_the_cli(example: str) -> None:
    from planner.cli import main

    assert main(["explain", "--torch", str(ROOT / f"examples/{example}.py:build"), "--device", "h200"]) == 0


def test_plan_torch_cli_searches_and_verifies(capsys: pytest.CaptureFixture) -> None:
    from planner.cli import main

    args = ["plan", "--torch", str(ROOT / "examples/mlp.py:build"), "--backend", "reference", "--no-cache", "--json"]
    assert main(args) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["graph"] == "MLP" and res["best"]["plan"] and res["candidates"]
    verdicts = [c["verdict"] for c in res["candidates"]]
    assert verdicts.count("best") == 1 and not any(v.startswith("rejected") for v in verdicts)


def test_cli_bad_factory_exits_2(tmp_path: Path) -> None:
    from planner.cli import main

    assert main(["explain", "--torch", str(tmp_path / "missing.py:build")]) == 2
    assert main(["explain", "--torch", str(ROOT / "examples/mlp.py:nope")]) == 2


def test_a_factory_or_model_file_that_raises_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    from planner.cli import main

    assert main(["explain", "--torch", str(ROOT / "examples/mlp.py:build"), "--torch-arg", "hidden=abc"]) == 2
    err = capsys.readouterr().err
    assert "examples/mlp.py:build called with {'hidden': 'abc'} raised TypeError" in err and "Traceback" not in err
    broken = tmp_path / "broken.py"
    broken.write_text("import torch\nraise RuntimeError('no weights here')\n")
    assert main(["explain", "--torch", f"{broken}:build"]) == 2
    err = capsys.readouterr().err
    assert "broken.py failed to load: RuntimeError: no weights here" in err and "Traceback" not in err


def test_factory_arguments_reach_the_factory_and_bad_ones_are_named() -> None:
    from planner.torch.importer import factory_kwargs

    spec = str(ROOT / "examples/transformer_block.py:build")
    kwargs = factory_kwargs(["d_model=32", "heads=2", "seq=4", "dtype=bf16"])
    assert kwargs == {"d_model": 32, "heads": 2, "seq": 4, "dtype": "bf16"}
    module, (x,) = load_factory(spec, kwargs)
    assert module.qkv.in_features == 32 and module.heads == 2 and x.shape == (2, 4, 32) and x.dtype == torch.bfloat16
    with pytest.raises(TorchImportError, match="does not take the arguments"):
        load_factory(spec, {"width": 3})
    for bad in ("d_model", "1x=2", "=3"):
        with pytest.raises(TorchImportError, match="NAME=VALUE"):
            factory_kwargs([bad])
    ok = subprocess.run([sys.executable, "-m", "planner", "explain", "--torch", spec, "--torch-arg", "d_model=32",
                         "--torch-arg", "heads=2"], capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr
    bad_cli = subprocess.run([sys.executable, "-m", "planner", "explain", "--torch", spec, "--torch-arg", "width=3"],
                             capture_output=True, text=True, cwd=ROOT)
    assert bad_cli.returncode == 2 and "width" in bad_cli.stderr


def test_torch_backed_kernels_decode_once_and_run_on_the_plans_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    import planner
    import planner.core.opaque as opaque

    module, args = _block()
    result = planner.plan(module, args, backend="cpu", max_candidates=2, cache=False, threads=1)
    facts = result.compiled.kernel_facts
    kinds = [k.kind for k in result.plan.kernels]
    assert [f["impl"] for f, k in zip(facts, kinds, strict=True) if k == "opaque"] == ["opaque-in-place"] * kinds.count("opaque")
    checks = []
    real = opaque.check_torch_call
    monkeypatch.setattr(opaque, "check_torch_call", lambda *a: checks.append(a) or real(*a))
    with torch.no_grad():
        want = module(*args)
    for _ in range(3):
        got = result(*args)
        assert allclose_report(got.numpy(), want.numpy(), "fp32")[0]
    assert checks == []  # each call description was checked and decoded when the plan was built
    result.compiled.execute()  # the bare kernels on the inputs already loaded


def test_a_call_that_needs_autograd_or_another_device_is_a_clear_error() -> None:
    m, x = _model("mlp-relu", torch.float32)
    result = planner.plan(m, (x,), backend="reference")
    with pytest.raises(TorchImportError, match="requires grad.*torch.no_grad"):
        result(x.clone().requires_grad_())
    with torch.no_grad():
        _assert_close(result(x.clone().requires_grad_()), m(x))  # no gradient asked for: fine
    with pytest.raises(TorchImportError, match="on meta; a plan takes host tensors"):
        result(torch.empty(x.shape, device="meta"))


def test_torch_compile_runs_a_graph_that_needs_gradients_eagerly() -> None:
    torch._dynamo.reset()
    m, x = _model("residual", torch.float32)
    compiled = torch.compile(m, backend="fusion_planner")
    xg = x.clone().requires_grad_()
    out = compiled(xg)
    out.sum().backward()  # the eager graph keeps autograd
    assert xg.grad is not None
    _assert_close(out.detach(), m(x))
    torch._dynamo.reset()


def test_the_plan_is_re_measured_against_eager_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    m, x = _model("mlp-relu", torch.float32)
    result = planner.plan(m, (x,), backend="cpu", max_candidates=2, cache=False, threads=1)
    assert result.vs_eager is not None and result.vs_eager > 0
    assert result.log[-1].startswith("vs eager torch: ") and "interleaved" in result.log[-1]
    assert "vs eager torch" in result.table() and "best vs unfused" in result.table()
    assert result.to_json()["vs_eager_torch"] == round(result.vs_eager, 4)
    assert planner.plan(m, (x,), backend="reference").vs_eager is None  # nothing is timed there


class MatmulEpilogue(nn.Module):
    """``x @ w + b`` written out, and GPT-2's Conv1D (``torch.addmm`` on the flattened rows)."""

    def __init__(self, d: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, hidden) / 4)
        self.b = nn.Parameter(torch.randn(hidden))
        self.w2 = nn.Parameter(torch.randn(hidden, d) / 4)
        self.b2 = nn.Parameter(torch.randn(d))

    def forward(self, x):
        h = F.gelu(x @ self.w + self.b, approximate="tanh")
        out = torch.addmm(self.b2, h.view(-1, h.shape[-1]), self.w2)
        return out.view(x.shape) + x


class Conv1DOnTheInput(nn.Module):
    """GPT-2's Conv1D applied to the call input itself: ``x.view(-1, d)`` of a graph input."""

    def __init__(self, d: int = 16, hidden: int = 24) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, hidden) / 4)
        self.bias = nn.Parameter(torch.randn(hidden))

    def forward(self, x):
        size_out = x.size()[:-1] + (self.weight.size(-1),)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


def test_a_view_of_a_call_input_is_the_input_itself() -> None:
    """A view of a graph input that keeps its flattened shape is no node (it was an Opaque copy kernel)."""
    m = Conv1DOnTheInput().eval()
    x = torch.randn(2, 5, 16)
    ops = [n.op for n in import_module(m, (x,)).graph.ops]
    assert ops == ["MatMul", "BiasAdd"]
    result = planner.plan(m, (x,), backend="cpu", max_candidates=4, cache=False, threads=1)
    assert "opaque" not in result.plan.composition()
    with torch.no_grad():
        _assert_close(result(x), m(x))


def test_matmul_and_addmm_are_gemms_with_their_bias() -> None:
    m = MatmulEpilogue().eval()
    x = torch.randn(2, 4, 16)
    imported = import_module(m, (x,))
    ops = [n.op for n in imported.graph.ops]
    assert ops.count("MatMul") == 2 and ops.count("BiasAdd") == 2 and "Opaque" not in ops
    result = planner.plan(m, (x,), backend="cpu", max_candidates=4, cache=False, threads=1)
    assert "opaque" not in result.plan.composition() and "gemm" in result.plan.composition().replace("cublaslt", "gemm")
    with torch.no_grad():
        _assert_close(result(x), m(x))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_16_bit_block_imports_with_no_opaque_node_and_matches_eager(dtype: str) -> None:
    """LayerNorm, softmax and SDPA in 16 bits import as the row ops and the attention ops, as in fp32 (an unfused
    plan stores the row statistics in 16 bits; the output check judges every candidate), and RMSNorm's default
    eps is the input dtype's.  The planned block matches eager torch within the dtype's tolerance."""
    module, (x,) = load_factory(str(ROOT / "examples/transformer_block.py:build"),
                                {"d_model": 32, "heads": 2, "seq": 8, "dtype": dtype})
    imported = import_module(module, (x,))
    ops = {n.op for n in imported.graph.ops}
    assert "Opaque" not in ops and {"RowMean", "BatchScores", "Heads", "Merge"} <= ops
    result = planner.plan(module, (x,), backend="cpu", max_candidates=4, cache=False, threads=1)
    with torch.no_grad():
        want = module(x)
    got = result(x)
    assert got.dtype == want.dtype
    result.check(want, x)  # raises past the dtype's tolerance

    class RMS(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.RMSNorm(16)

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return self.norm(t)

    rms = RMS().to(x.dtype)
    eps = [n.attr_dict for n in import_module(rms, (x[..., :16],)).graph.ops if n.op == "Affine"]
    assert eps == [{"a": 1.0, "b": torch.finfo(x.dtype).eps}]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_output_is_handed_out_as_the_bits_the_last_kernel_wrote(dtype):
    """A planned 16-bit module returns a tensor of its dtype over a fresh array the last kernel wrote (no fp32
    widening and narrowing on the way), with the same values the widening path gives."""
    import planner

    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(32, 48)

        def forward(self, x):
            return F.gelu(self.fc(x), approximate="tanh") * 2.0

    m, x = Mlp().eval().to(dtype), torch.randn(8, 32, dtype=dtype)
    result = planner.plan(m, (x,), backend="cpu", max_candidates=4)
    first, second = result(x), result(x)
    assert first.dtype == dtype and first.shape == (8, 48)
    assert first.data_ptr() != second.data_ptr() and torch.equal(first, second)
    (widened,) = result.compiled.run(result.bound.feed((x,)))
    assert widened.dtype == np.float32 and torch.equal(first.float(), torch.from_numpy(widened).reshape(8, 48))
    with torch.no_grad():
        ok, max_abs, _ = allclose_report(first.float().numpy(), m(x).float().numpy(), TORCH_DTYPES[dtype])
    assert ok, max_abs


class _ConvBlock(nn.Module):
    """A ResNet basic block's first half with its residual: Conv2d, BatchNorm2d, ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)) + x)


def test_an_eval_batchnorm_plans_though_its_integer_counter_is_a_buffer() -> None:
    """num_batches_tracked (int64) is never read in eval mode: it no longer stops the import."""
    torch.manual_seed(0)
    block = _ConvBlock().eval()
    with torch.no_grad():
        block.bn.running_mean.uniform_(-0.5, 0.5)
        block.bn.running_var.uniform_(0.5, 2.0)
    x = torch.randn(2, 8, 16, 16)
    result = planner.plan(block, (x,), backend="reference")
    _assert_close(result(x), block(x))


def test_a_training_batchnorm_is_refused_naming_the_buffer_it_writes() -> None:
    """torch.export leaves the counter's ATen add_ and the running statistics' update inside batch_norm: both are
    writes a plan would lose. Refused, with the hint to plan in eval mode, and the module left as it was."""
    block = _ConvBlock().train()
    x = torch.randn(2, 8, 16, 16)
    before = {k: v.clone() for k, v in block.state_dict().items()}
    with pytest.raises(TorchImportError, match=r"(num_batches_tracked|running_mean).*module\.eval\(\)"):
        planner.plan(block, (x,), backend="reference")
    assert all(torch.equal(v, before[k]) for k, v in block.state_dict().items())
