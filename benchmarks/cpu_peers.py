"""fusion-planner's CPU backend against numpy, torch eager, torch.compile (inductor) and jax.jit.

Usage: python benchmarks/cpu_peers.py [--out docs/results/cpu_peers.md] [--rounds 11]
                                      [--workloads ew2,ew4,...] [--modes 1,all] [--no-first-call]

Needs ``jax`` in the benchmark's environment (``pip install "jax[cpu]"``; the tests do not).

* **Steady state**, one child process per thread mode (``1``: one thread, pinned to one core;
  ``all``: every core of the affinity mask), every library limited to that many threads through
  its own settings before it starts: all contenders of a workload are built, checked against
  eager torch, warmed, then timed in interleaved rounds (each round times every contender
  three times, in turn, the order rotating from round to round), so they see the same machine
  load and each follows every other as often; a figure is the median over all rounds' samples.  On every
  core, each contender's turn first calls it untimed for :data:`SETTLE_S`: OpenBLAS's workers spin for up to
  2^28 cycles (about 0.1 s) after a call and took the second core from whoever ran next (torch.mm on two
  threads measured 5.7 ms right after numpy's product, 2.0 ms alone), and on this 2-vCPU VM a pool whose
  workers slept (a pause, or another library's turn) ran a 2 ms plan in 2.5-6 ms for several calls.  fusion-planner is timed twice, one planned result: the bare kernels
  (its compiled plan on inputs already in its buffers, writing where the call's dropped output was) and the
  end-to-end call (torch tensors in, torch tensors out); their difference is the call's overhead.
* **Bandwidth**: memcpy and triad on the same thread count, on arrays of at least 4x the
  last-level cache, and each memory-bound fused kernel (the ew-chain ones) on that array size:
  its byte ledger over its time, as a fraction of memcpy.
* **First call** (``all`` cores): for each contender a fresh process imports the libraries, then
  builds the contender and calls it once (the timed part), cold (empty kernel, plan, inductor and
  jax caches) and warm (a second fresh process, caches kept); with its peak RSS growth over the
  process before the contender was built.

Every library runs with ``OMP_WAIT_POLICY=PASSIVE`` (what the CLI sets; docs/backends.md).

*block-bf16* is the block in bf16: numpy has no form of it (its bf16 matmul is ml_dtypes' scalar loop),
jax.jit runs it with bf16 parameters, and every contender must match eager torch within bf16's tolerance
(5e-2 scaled) instead of 1e-3.  The report says whether this CPU has the bf16 units torch uses (AMX,
AVX-512 BF16), which decides how the CPU backend multiplies it (docs/backends.md, *16-bit products*).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from noise import neighbour, pick_cores

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ("ew2", "ew4", "ew8", "mlp1024", "mlp64", "gpt2mlp", "gpt2conv1d", "block", "block-bf16", "attention",
             "layernorm", "softmax", "rmsnorm")
#: the MLP workloads whose end-to-end call and call overhead have targets
MLP_WORKLOADS = ("mlp1024", "mlp64", "gpt2mlp", "gpt2conv1d")
#: the row-kernel workloads (the op-coverage issue): a residual add + nn.LayerNorm, F.softmax, LLaMA's RMSNorm
ROW_WORKLOADS = ("layernorm", "softmax", "rmsnorm")
#: the workloads with attention (the op-coverage issue): a whole pre-LN block (fp32, bf16), and causal SDPA alone
ATTENTION_WORKLOADS = ("block", "block-bf16", "attention")
CONTENDERS = ("numpy", "torch", "torch.compile", "jax.jit", "fp.bare", "fp.call")
PEERS = ("numpy", "torch", "torch.compile", "jax.jit")
EW_N = 4_000_000
#: seconds each contender's turn on every core first runs it untimed: another library's spinning workers stop,
#: its own pool's workers are awake
SETTLE_S = 0.15


def child_env(mode: str, caches: Path | None = None) -> dict[str, str]:
    """The environment of a child: every pool at the mode's thread count, caches where asked."""
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=str(ROOT))
    # the caller's narrowing of XLA's code (benchmarks/avx2.py) holds in every mode; its thread flags are the mode's
    isa = [f for f in env.get("XLA_FLAGS", "").split() if f.startswith("--xla_cpu_max_isa")]
    if mode == "1":
        env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1", FUSION_PLANNER_THREADS="1",
                   XLA_FLAGS=" ".join(["--xla_cpu_multi_thread_eigen=false", "intra_op_parallelism_threads=1", *isa]))
    else:
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "FUSION_PLANNER_THREADS", "XLA_FLAGS"):
            env.pop(var, None)
        if isa:
            env["XLA_FLAGS"] = " ".join(isa)
    if caches is not None:
        env.update(XDG_CACHE_HOME=str(caches / "xdg"), TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
                   FP_BENCH_JAX_CACHE=str(caches / "jax"))
        env.pop("FUSION_PLANNER_PLAN_CACHE", None)
    return env


# ---------------------------------------------------------------- workloads (imported in children only)


@dataclass
class Workload:
    name: str
    module: Any  # torch.nn.Module
    inputs: tuple[Any, ...]  # torch tensors
    numpy_fn: Callable[..., Any]
    jax_fn: Callable[..., Any]  # jax_fn(params, *inputs)
    params: dict[str, Any] = field(default_factory=dict)  # numpy arrays, as the numpy and jax functions read them
    memory_bound: bool = False
    skip: tuple[str, ...] = ()  # contenders that have no form of this workload
    max_error: float = 1e-3  # scaled max error against eager torch that every contender must stay within


def build_workload(name: str) -> Workload:
    import numpy as np
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name.startswith("ew"):
        k = int(name[2:])
        stages = [(1 + 0.01 * (s + 1), 0.001 * (s + 1)) for s in range(k)]

        class Chain(nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                for s, (a, b) in enumerate(stages):
                    x = a * x + b
                    if s % 2 == 0:
                        x = torch.relu(x)
                return x

        def chain_np(x: Any) -> Any:
            y = np.multiply(x, stages[0][0])
            for s, (a, b) in enumerate(stages):
                if s:
                    np.multiply(y, a, out=y)
                np.add(y, b, out=y)
                if s % 2 == 0:
                    np.maximum(y, 0, out=y)
            return y

        def chain_jax(params: Any, x: Any) -> Any:
            import jax.numpy as jnp

            for s, (a, b) in enumerate(stages):
                x = a * x + b
                if s % 2 == 0:
                    x = jnp.maximum(x, 0)
            return x

        return Workload(name, Chain().eval(), (torch.randn(EW_N),), chain_np, chain_jax, memory_bound=True)
    if name.startswith("mlp"):
        m, n, kk = (1024, 1024, 1024) if name == "mlp1024" else (64, 2048, 2048)

        class Epilogue(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.w = nn.Parameter(torch.randn(kk, n) / math.sqrt(kk))
                self.b = nn.Parameter(torch.randn(n))

            def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
                return torch.nn.functional.gelu(x @ self.w + self.b, approximate="tanh") + r

        mod = Epilogue().eval()
        params = {"w": mod.w.detach().numpy(), "b": mod.b.detach().numpy()}

        def epi_np(x: Any, r: Any) -> Any:
            y = x @ params["w"]
            y += params["b"]
            return _gelu_np(y) + r

        def epi_jax(p: Any, x: Any, r: Any) -> Any:
            import jax

            return jax.nn.gelu(x @ p["w"] + p["b"], approximate=True) + r

        return Workload(name, mod, (torch.randn(m, kk), torch.randn(m, n)), epi_np, epi_jax, params)
    if name == "gpt2mlp":
        class GPT2MLP(nn.Module):
            def __init__(self, d: int = 768) -> None:
                super().__init__()
                self.c_fc = nn.Linear(d, 4 * d)
                self.c_proj = nn.Linear(4 * d, d)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.c_proj(torch.nn.functional.gelu(self.c_fc(x), approximate="tanh"))

        mod = GPT2MLP().eval()
        params = {k: v.detach().numpy().T.copy() if v.ndim == 2 else v.detach().numpy()
                  for k, v in mod.state_dict().items()}

        return _gpt2_workload(name, mod, params)
    if name == "gpt2conv1d":
        return _gpt2_conv1d(name)
    if name in ("block", "block-bf16"):
        sys.path.insert(0, str(ROOT / "examples"))
        import transformer_block

        d, heads, seq = 768, 12, 128
        bf16 = name == "block-bf16"
        mod, inputs = transformer_block.build(batch=1, seq=seq, d_model=d, heads=heads, dtype="bf16" if bf16 else "fp32")
        params = {k: host_array(v.T if v.ndim == 2 else v) for k, v in mod.state_dict().items()}
        # numpy has no bf16 GEMM (ml_dtypes' matmul is a scalar loop); bf16's tolerance (docs/rules.md)
        return Workload(name, mod, inputs, lambda x: _block_np(params, x, heads), lambda p, x: _block_jax(p, x, heads), params,
                        skip=("numpy",) if bf16 else (), max_error=5e-2 if bf16 else 1e-3)
    if name == "attention":
        return _attention_workload(name)
    if name in ROW_WORKLOADS:
        return _row_workload(name)
    raise SystemExit(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def host_array(t: Any) -> Any:
    """A torch tensor as a C-ordered numpy array of its dtype (bf16 as ml_dtypes' bfloat16)."""
    import ml_dtypes
    import numpy as np
    import torch

    t = t.detach()
    if t.dtype == torch.bfloat16:
        return np.ascontiguousarray(t.float().numpy()).astype(ml_dtypes.bfloat16)
    return np.ascontiguousarray(t.numpy())


def _gpt2_workload(name: str, mod: Any, params: dict[str, Any]) -> Workload:
    """A GPT-2 MLP on x [1, 128, 768] with its numpy and jax forms; ``params`` hold (in, out) weights."""
    import torch

    def mlp_np(x: Any) -> Any:
        h = x @ params["c_fc.weight"]
        h += params["c_fc.bias"]
        return _gelu_np(h) @ params["c_proj.weight"] + params["c_proj.bias"]

    def mlp_jax(p: Any, x: Any) -> Any:
        import jax

        return jax.nn.gelu(x @ p["c_fc.weight"] + p["c_fc.bias"], approximate=True) @ p["c_proj.weight"] + p["c_proj.bias"]

    return Workload(name, mod, (torch.randn(1, 128, 768),), mlp_np, mlp_jax, params)


def _gpt2_conv1d(name: str) -> Workload:
    """GPT-2's MLP as the transformers library writes it: Conv1D (``torch.addmm`` on ``x.view(-1, d)``, the
    weight stored (in, out)) and the GELU written out with ``torch.pow`` and ``torch.tanh``; x [1, 128, 768]."""
    import torch
    from torch import nn

    class Conv1D(nn.Module):
        def __init__(self, nf: int, nx: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
            self.bias = nn.Parameter(torch.randn(nf) * 0.02)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            size_out = x.size()[:-1] + (self.weight.size(-1),)
            return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)

    class NewGELU(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))

    class GPT2MLP(nn.Module):
        def __init__(self, d: int = 768) -> None:
            super().__init__()
            self.c_fc, self.c_proj, self.act = Conv1D(4 * d, d), Conv1D(d, 4 * d), NewGELU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c_proj(self.act(self.c_fc(x)))

    mod = GPT2MLP().eval()
    params = {k: v.detach().numpy().copy() for k, v in mod.state_dict().items()}

    return _gpt2_workload(name, mod, params)


def _attention_workload(name: str, seq: int = 512, d: int = 768, heads: int = 12) -> Workload:
    """Causal multi-head SDPA as GPT-2 writes it around one packed projection, x [1, 512, 3*768]: split, view,
    transpose, F.scaled_dot_product_attention(is_causal=True), transpose and reshape back; fp32."""
    import numpy as np
    import torch
    from torch import nn

    class CausalAttention(nn.Module):
        def forward(self, qkv: torch.Tensor) -> torch.Tensor:
            b, s, _ = qkv.shape
            q, k, v = (t.view(b, s, heads, d // heads).transpose(1, 2) for t in qkv.split(d, dim=-1))
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return a.transpose(1, 2).reshape(b, s, d)

    def att_np(qkv: Any) -> Any:
        b, s, _ = qkv.shape
        q, k, v = (qkv[..., i * d:(i + 1) * d].reshape(b, s, heads, -1).transpose(0, 2, 1, 3) for i in range(3))
        att = q @ k.transpose(0, 1, 3, 2) / np.float32(math.sqrt(d // heads))
        att = np.where(np.tril(np.ones((s, s), bool)), att, np.float32(-np.inf))
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        return (att @ v).transpose(0, 2, 1, 3).reshape(b, s, d)

    def att_jax(p: Any, qkv: Any) -> Any:
        import jax

        b, s, _ = qkv.shape
        q, k, v = (qkv[..., i * d:(i + 1) * d].reshape(b, s, heads, -1) for i in range(3))
        return jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, d)

    return Workload(name, CausalAttention().eval(), (torch.randn(1, seq, 3 * d),), att_np, att_jax)


def _row_workload(name: str) -> Workload:
    """x [4, 512, 1024] + r through nn.LayerNorm(1024); F.softmax over x [16, 12, 128, 128] (attention
    scores); RMSNorm as LLaMA writes it (pow, mean, rsqrt, weight) on x [4, 512, 2048]: fp32."""
    import numpy as np
    import torch
    from torch import nn

    if name == "layernorm":
        class ResidualNorm(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.ln = nn.LayerNorm(1024)

            def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
                return self.ln(x + r)

        mod = ResidualNorm().eval()
        with torch.no_grad():
            mod.ln.weight.normal_()
            mod.ln.bias.normal_()
        params = {"w": mod.ln.weight.detach().numpy(), "b": mod.ln.bias.detach().numpy()}

        def ln_np(x: Any, r: Any) -> Any:
            h = x + r
            mu = h.mean(-1, keepdims=True)
            c = h - mu
            return c / np.sqrt((c * c).mean(-1, keepdims=True) + np.float32(1e-5)) * params["w"] + params["b"]

        def ln_jax(p: Any, x: Any, r: Any) -> Any:
            import jax

            h = x + r
            mu = h.mean(-1, keepdims=True)
            c = h - mu
            return c * jax.lax.rsqrt((c * c).mean(-1, keepdims=True) + 1e-5) * p["w"] + p["b"]

        return Workload(name, mod, (torch.randn(4, 512, 1024), torch.randn(4, 512, 1024)), ln_np, ln_jax, params)
    if name == "softmax":
        class Softmax(nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return torch.nn.functional.softmax(x, dim=-1)

        def sm_np(x: Any) -> Any:
            e = np.exp(x - x.max(-1, keepdims=True))
            return e / e.sum(-1, keepdims=True)

        def sm_jax(p: Any, x: Any) -> Any:
            import jax

            return jax.nn.softmax(x, axis=-1)

        return Workload(name, Softmax().eval(), (torch.randn(16, 12, 128, 128),), sm_np, sm_jax)

    class RMSNorm(nn.Module):  # as transformers' LlamaRMSNorm writes it
        def __init__(self, d: int = 2048) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(d))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            return self.weight * h.to(x.dtype)

    mod = RMSNorm().eval()
    params = {"w": mod.weight.detach().numpy()}

    def rms_np(x: Any) -> Any:
        return params["w"] * (x / np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(1e-6)))

    def rms_jax(p: Any, x: Any) -> Any:
        import jax

        return p["w"] * (x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6))

    return Workload(name, mod, (torch.randn(4, 512, 2048),), rms_np, rms_jax, params)


def _gelu_np(y: Any) -> Any:
    import numpy as np

    return 0.5 * y * (1.0 + np.tanh(np.float32(math.sqrt(2 / math.pi)) * (y + np.float32(0.044715) * y * y * y)))


def _block_np(p: dict[str, Any], x: Any, heads: int) -> Any:
    import numpy as np

    def ln(v: Any, w: Any, b: Any) -> Any:
        mu = v.mean(-1, keepdims=True)
        var = ((v - mu) ** 2).mean(-1, keepdims=True)
        return (v - mu) / np.sqrt(var + np.float32(1e-5)) * w + b

    b_, s, d = x.shape
    h = ln(x, p["ln1.weight"], p["ln1.bias"]) @ p["qkv.weight"] + p["qkv.bias"]
    q, k, v = (h[..., i * d:(i + 1) * d].reshape(b_, s, heads, d // heads).transpose(0, 2, 1, 3) for i in range(3))
    att = q @ k.transpose(0, 1, 3, 2) / np.float32(math.sqrt(d // heads))
    att = np.where(np.tril(np.ones((s, s), bool)), att, np.float32(-np.inf))
    att = np.exp(att - att.max(-1, keepdims=True))
    att /= att.sum(-1, keepdims=True)
    a = (att @ v).transpose(0, 2, 1, 3).reshape(b_, s, d)
    x = x + a @ p["proj.weight"] + p["proj.bias"]
    f = _gelu_np(ln(x, p["ln2.weight"], p["ln2.bias"]) @ p["fc1.weight"] + p["fc1.bias"])
    return x + f @ p["fc2.weight"] + p["fc2.bias"]


def _block_jax(p: dict[str, Any], x: Any, heads: int) -> Any:
    import jax

    def ln(v: Any, w: Any, b: Any) -> Any:
        mu = v.mean(-1, keepdims=True)
        var = ((v - mu) ** 2).mean(-1, keepdims=True)
        return (v - mu) * jax.lax.rsqrt(var + 1e-5) * w + b

    b_, s, d = x.shape
    h = ln(x, p["ln1.weight"], p["ln1.bias"]) @ p["qkv.weight"] + p["qkv.bias"]
    q, k, v = (h[..., i * d:(i + 1) * d].reshape(b_, s, heads, d // heads) for i in range(3))
    a = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b_, s, d)
    x = x + a @ p["proj.weight"] + p["proj.bias"]
    f = jax.nn.gelu(ln(x, p["ln2.weight"], p["ln2.bias"]) @ p["fc1.weight"] + p["fc1.bias"], approximate=True)
    return x + f @ p["fc2.weight"] + p["fc2.bias"]


# ---------------------------------------------------------------- contenders


def make_contender(w: Workload, name: str, planned: Any = None) -> tuple[Callable[[], Any], Any]:
    """(call, the planned result for fusion-planner): ``call()`` runs the contender once on the workload's
    inputs, in its native form, and returns a value that is ready (jax's is blocked on).  ``planned``: the
    workload's planned result already made (``fp.bare`` and ``fp.call`` time one plan in the same buffers)."""
    import torch

    if name == "numpy":
        xs = [t.numpy() for t in w.inputs]
        return (lambda: w.numpy_fn(*xs)), None
    if name == "torch":
        def eager() -> Any:
            with torch.no_grad():
                return w.module(*w.inputs)
        return eager, None
    if name == "torch.compile":
        compiled = torch.compile(w.module)

        def inductor() -> Any:
            with torch.no_grad():
                return compiled(*w.inputs)
        return inductor, None
    if name == "jax.jit":
        import jax

        if os.environ.get("FP_BENCH_JAX_CACHE"):
            jax.config.update("jax_compilation_cache_dir", os.environ["FP_BENCH_JAX_CACHE"])
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        fn = jax.jit(w.jax_fn)
        params = {k: jax.device_put(v) for k, v in w.params.items()}
        xs = [jax.device_put(host_array(t)) for t in w.inputs]
        return (lambda: fn(params, *xs).block_until_ready()), None
    if name in ("fp.call", "fp.bare"):
        import planner

        result = planned if planned is not None else planner.plan(w.module, w.inputs, backend="cpu")
        if name == "fp.call":
            return (lambda: result(*w.inputs)), result
        result(*w.inputs)  # loads the inputs into the plan's buffers
        return result.compiled.execute, result
    raise SystemExit(f"unknown contender {name!r}")


def as_numpy(value: Any) -> Any:
    import numpy as np

    if hasattr(value, "detach"):
        return value.detach().float().numpy()
    return np.asarray(value).astype(np.float32)


def _time_us(fn: Callable[[], Any], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


def steady(workload: str, rounds: int, mode: str) -> dict[str, Any]:
    """Every contender of one workload, checked against eager torch, then timed in interleaved rounds (on every
    core, each turn after :data:`SETTLE_S` of untimed calls)."""
    import numpy as np

    w = build_workload(workload)
    calls, plans = {}, {}
    for c in CONTENDERS:
        if c not in w.skip:
            calls[c], plans[c] = make_contender(w, c, plans.get("fp.bare"))
    want = as_numpy(calls["torch"]())
    errors = {}
    for c, fn in calls.items():
        got = as_numpy(fn()) if c != "fp.bare" else None
        if got is not None:
            err = float(np.max(np.abs(got.reshape(want.shape) - want)) / max(1.0, float(np.max(np.abs(want)))))
            errors[c] = err
            if err > w.max_error:
                raise SystemExit(f"{workload}: {c} differs from eager torch (scaled max error {err:.3g})")
        for _ in range(2):
            fn()
    samples: dict[str, list[float]] = {c: [] for c in calls}
    order = list(calls)
    for r in range(rounds):  # the order rotates: each contender follows each other one as often (a library's
        for c in order[r % len(order):] + order[: r % len(order)]:  # spinning pool slows whoever runs next)
            settle(mode, calls[c])
            samples[c] += _time_us(calls[c], 3)
    result = plans["fp.call"]
    assert plans["fp.bare"] is result
    med = {c: statistics.median(v) for c, v in samples.items()}
    out: dict[str, Any] = {"workload": workload, "median_us": med, "errors": errors,
                           "plan": result.plan.notation(), "kernels": len(result.plan.kernels),
                           "composition": result.plan.composition()}
    if w.memory_bound:
        out["bandwidth"] = kernel_bandwidth(result)
    return out


def settle(mode: str, call: Callable[[], Any]) -> None:
    """On every core, run ``call`` untimed for :data:`SETTLE_S` (at least once) before its timed calls."""
    if mode == "1":
        return
    end = time.perf_counter() + SETTLE_S
    call()
    while time.perf_counter() < end:
        call()


def kernel_bandwidth(result: Any) -> list[dict[str, Any]]:
    """Each fused (multi-op) kernel of an ew-chain plan, rebuilt alone at the bandwidth array size and
    timed interleaved with memcpy: byte ledger / time as a fraction of memcpy's bandwidth (past the default
    element limit where the last-level cache is large: 4x it is the point)."""
    from planner.core import limits

    n = bandwidth_elements()
    with limits.input_limits(replace(limits.current(), elements=max(n, limits.current().elements))):
        return _kernel_bandwidth(result, n)


def _kernel_bandwidth(result: Any, n: int) -> list[dict[str, Any]]:
    big = resized(result.graph, n)
    small_plan = result.plan
    from backends.cpu.backend import CpuBackend
    from planner.core.cost import load_device
    from planner.core.reference import random_inputs
    from planner.egraph.candidates import build_candidates

    spec = load_device("seed-k4")
    cands = build_candidates(big, spec)
    plan = next((p for p in cands.plans if p.composition() == small_plan.composition()), None)
    if plan is None:
        return []
    backend = CpuBackend(spec)
    compiled = backend.compile(plan)
    compiled.run(random_inputs(big, seed=0))
    compiled.execute()  # every kernel's output in the plan's own buffers, pages touched
    copy, src = pooled_copy(n, backend.pool)
    rows = []
    for i, (step, facts) in enumerate(zip(compiled.steps, compiled.kernel_facts, strict=True)):
        if len(step.kernel.ops) < 2:
            continue
        ks, cs = [], []
        for _ in range(7):
            ks += _time_us(step.call, 3)
            cs += _time_us(copy, 3)
        kern_gbps = facts["bytes_moved"] / (statistics.median(ks) * 1e3)
        copy_gbps = 2 * src.nbytes / (statistics.median(cs) * 1e3)
        rows.append({"kernel": i, "ops": f"kernel {i}: {len(step.kernel.ops)} ops", "gbps": kern_gbps, "memcpy_gbps": copy_gbps,
                     "fraction": kern_gbps / copy_gbps})
    return rows


def resized(graph: Any, n: int) -> Any:
    """The workload's own graph with its flat inputs (the chain's ``x``) grown to ``n`` elements (past the
    default element limit where the last-level cache is large: 4x it is the point)."""
    from planner.core.graph import GraphBuilder

    b = GraphBuilder(f"{graph.name}-{n}")
    for node in graph.nodes:
        if node.op == "In":
            shape = (n,) if len(node.type.shape) == 1 else node.type.shape
            b.input(node.id, shape, node.type.dtype)
        else:
            b.op(node.id, node.op, list(node.inputs), node.attr_dict)
    return b.build(list(graph.outputs))


def bandwidth_elements() -> int:
    from backends.cpu.backend import cache_bytes

    return max(EW_N, 4 * cache_bytes()[0] // 4)


def pooled_copy(n: int, pool: Any) -> tuple[Callable[[], None], Any]:
    """memcpy of ``n`` fp32 on the pool's threads (numpy's copy is single-threaded): each thread copies a
    contiguous share, as the plan's kernels split their elements; and the source array."""
    import numpy as np

    from backends.cpu.parallel import split

    src = np.random.default_rng(1).standard_normal(n, dtype=np.float32)
    dst = np.empty_like(src)
    dst[...] = 0
    parts = split(n, pool.threads, 16)

    def copy() -> None:
        pool.run([lambda s=s, e=e: np.copyto(dst[s:e], src[s:e]) for s, e in parts])

    return copy, src


def stream(rounds: int) -> dict[str, float]:
    """memcpy and triad bandwidth (GB/s) on arrays of at least 4x the last-level cache, on this process's
    thread count (numpy is single-threaded: with more cores, the arrays are split across threads)."""
    import numpy as np

    from backends.cpu.parallel import WorkerPool, split, threads_from_env

    n = bandwidth_elements()
    pool = WorkerPool(threads_from_env())
    copy, a = pooled_copy(n, pool)
    b, c = a[::-1].copy(), np.empty_like(a)
    parts = split(n, pool.threads, 16)

    def triad() -> None:
        pool.run([lambda s=s, e=e: np.add(a[s:e], b[s:e], out=c[s:e]) for s, e in parts])

    cs, ts = [], []
    for _ in range(rounds):
        cs += _time_us(copy, 3)
        ts += _time_us(triad, 3)
    return {"memcpy_gbps": 2 * a.nbytes / (statistics.median(cs) * 1e3),
            "triad_gbps": 3 * a.nbytes / (statistics.median(ts) * 1e3), "array_mb": a.nbytes / 1e6}


def first_call(workload: str, contender: str) -> dict[str, Any]:
    """In a fresh process: build the contender and call it once; wall time and peak RSS growth."""
    import planner.api  # noqa: F401 - the library imported before the clock starts, like torch and jax

    if contender == "jax.jit":
        import jax  # noqa: F401
    w = build_workload(workload)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    fn, planned = make_contender(w, contender)
    t_built = time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"first_call_s": wall, "peak_rss_growth_mb": (rss1 - rss0) / 1024}
    if planned is not None:  # fusion-planner: planner.plan alone
        out["plan_s"] = t_built - t0
    return out


# ---------------------------------------------------------------- the parent


def run_child(args: list[str], env: dict[str, str], cores: set[int] | None, script: str = __file__) -> dict[str, Any]:
    """Run ``script`` (this one by default) with ``args`` in a child on ``cores``; its last stdout line, as JSON."""
    def pin() -> None:
        if cores is not None:
            os.sched_setaffinity(0, cores)

    r = subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True, preexec_fn=pin,
                       check=False)
    if r.returncode != 0:
        raise SystemExit(f"child {' '.join(args)} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def best_peer(median_us: dict[str, float]) -> str:
    """The fastest peer that ran the workload."""
    return min((c for c in PEERS if c in median_us), key=lambda c: median_us[c])


def ratio(peer_us: float, ours_us: float) -> str:
    return f"{peer_us / ours_us:.2f}"


def report(steady_rows: dict[str, list[dict[str, Any]]], streams: dict[str, dict[str, float]],
           firsts: dict[str, dict[str, dict[str, Any]]], command: str, noise_line: str) -> str:
    from planner.core.machine import cpu_model

    lines = [
        "# fusion-planner's CPU backend against numpy, torch eager, torch.compile and jax.jit",
        "",
        f"Command: `{command}`  ",
        f"Machine: {cpu_model()} ({platform.machine()}, {os.cpu_count()} CPUs), Python {platform.python_version()}  ",
        f"Date: {datetime.date.today().isoformat()}  ",
        f"Versions: {versions()}  ",
        f"bf16 GEMMs and attention: {bf16_units()}  ",
        f"Noise: {noise_line}",
        "",
        "Method: benchmarks/cpu_peers.py's docstring. Times are medians in µs; a ratio is the best peer's time "
        "over ours (> 1: fusion-planner is faster). *bare*: the plan's kernels on inputs already in its buffers; "
        "*call*: `result(x)`, torch tensors in and out. Best peer: the fastest of numpy, torch eager, "
        "torch.compile (inductor) and jax.jit in that run.",
        "",
    ]
    for mode, rows in steady_rows.items():
        s = streams[mode]
        lines += [f"## {'one thread, pinned' if mode == '1' else 'all cores'}", "",
                  f"memcpy {s['memcpy_gbps']:.1f} GB/s, triad {s['triad_gbps']:.1f} GB/s on {s['array_mb']:.0f} MB arrays.",
                  "",
                  "| workload | numpy | torch | torch.compile | jax.jit | fp bare | fp call | best peer | bare ratio | call ratio | plan |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in rows:
            m = row["median_us"]
            best = best_peer(m)
            lines.append(f"| {row['workload']} | " + " | ".join(f"{m[c]:,.0f}" if c in m else "—" for c in CONTENDERS)
                         + f" | {best} | {ratio(m[best], m['fp.bare'])} | {ratio(m[best], m['fp.call'])}"
                         + f" | {row['kernels']} kernels: {row['composition']} |")
        lines.append("")
        bw = [(row["workload"], b) for row in rows for b in row.get("bandwidth", [])]
        if bw:
            lines += ["Memory-bound fused kernels at the bandwidth array size:", "",
                      "| workload | kernel | GB/s | memcpy GB/s (same rounds) | fraction of memcpy |", "|---|---|---|---|---|"]
            lines += [f"| {wl} | {b['ops']} | {b['gbps']:.1f} | {b['memcpy_gbps']:.1f} | {b['fraction']:.0%} |" for wl, b in bw]
            lines.append("")
        overhead = [(row["workload"], row["median_us"]) for row in rows if not row["workload"].startswith("ew")]
        lines += ["End-to-end call overhead over the bare kernels: "
                  + ", ".join(f"{wl} {(m['fp.call'] - m['fp.bare']) / m['fp.bare']:+.1%}" for wl, m in overhead), ""]
    if firsts:
        lines += ["## First call (all cores): build + first call, seconds; peak RSS growth, MB", "",
                  "| workload | " + " | ".join(f"{c} cold | warm | MB" for c in FIRST_CONTENDERS) + " |",
                  "|---|" + "---|---|---|" * len(FIRST_CONTENDERS)]
        for wl, per in firsts.items():
            cells = []
            for c in FIRST_CONTENDERS:
                cold, warm = per[c]["cold"], per[c]["warm"]
                cells.append(f"{cold['first_call_s']:.2f} | {warm['first_call_s']:.2f} | {cold['peak_rss_growth_mb']:.0f}")
            lines.append(f"| {wl} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += targets(steady_rows, firsts)
    return "\n".join(lines) + "\n"


FIRST_CONTENDERS = ("torch", "torch.compile", "jax.jit", "fp.call")


def targets(steady_rows: dict[str, list[dict[str, Any]]], firsts: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """Issue 13's targets, each met or not, with its figure."""
    out = ["## Targets", ""]

    def verdict(ok: bool) -> str:
        return "met" if ok else "**not met**"

    for mode, rows in steady_rows.items():
        for row in rows:
            m = row["median_us"]
            best = best_peer(m)
            r = m[best] / m["fp.call"]
            if row["workload"].startswith("ew") or row["workload"] in MLP_WORKLOADS:
                out.append(f"- {row['workload']} ({mode} thread{'s' if mode != '1' else ''}): end-to-end ≥ 1.0× best peer "
                           f"({best}): {r:.2f}× — {verdict(r >= 1.0)}")
            if row["workload"] in ROW_WORKLOADS:
                out.append(f"- {row['workload']} ({mode} thread{'s' if mode != '1' else ''}): planned call "
                           f"({row['plan']}: {row['kernels']} kernel{'s' if row['kernels'] != 1 else ''}) end to end "
                           f"vs best peer ({best}): {r:.2f}× — {verdict(r >= 1.0)}")
            if row["workload"] in ATTENTION_WORKLOADS:
                tc = m["torch.compile"] / m["fp.call"]
                out.append(f"- {row['workload']} ({mode} thread{'s' if mode != '1' else ''}): planned call ≥ 1.0× "
                           f"torch.compile: {tc:.2f}× — {verdict(tc >= 1.0)}; ≥ 1.0× best peer ({best}): {r:.2f}× — "
                           f"{verdict(r >= 1.0)} ({row['plan']})")
            if row["workload"] in MLP_WORKLOADS:
                ov = (m["fp.call"] - m["fp.bare"]) / m["fp.bare"]
                out.append(f"- {row['workload']} ({mode}): call overhead ≤ 5% of the bare kernels: {ov:+.1%} — {verdict(ov <= 0.05)}")
            for b in row.get("bandwidth", []):
                out.append(f"- {row['workload']} ({mode}) {b['ops']}: ≥ 90% of memcpy: {b['fraction']:.0%} — "
                           f"{verdict(b['fraction'] >= 0.9)}")
    for wl, per in firsts.items():
        ours, tc = per["fp.call"], per["torch.compile"]
        out.append(f"- {wl}: cold first call {ours['cold']['first_call_s']:.2f} s vs torch.compile cold "
                   f"{tc['cold']['first_call_s']:.2f} s — {verdict(ours['cold']['first_call_s'] <= tc['cold']['first_call_s'])}; "
                   f"warm `planner.plan` {ours['warm']['plan_s']:.2f} s ≤ 0.5 s — {verdict(ours['warm']['plan_s'] <= 0.5)}"
                   f" (warm first call {ours['warm']['first_call_s']:.2f} s)")
    return out + [""]


def bf16_units() -> str:
    """How the CPU backend computes bf16 products on this machine (backends/cpu/gemm.py)."""
    from backends.cpu import gemm

    if gemm.native_16bit("bf16"):
        return "torch's native bf16 kernels (the CPU has AMX or AVX-512 BF16)"
    return "widened to fp32 (this CPU has no bf16 units torch uses)"


def versions() -> str:
    out = []
    for mod in ("numpy", "torch", "jax", "jaxlib"):
        try:
            out.append(f"{mod} {__import__(mod).__version__}")
        except ImportError:
            out.append(f"{mod} missing")
    cc = subprocess.run(["cc", "--version"], capture_output=True, text=True).stdout.splitlines()
    return ", ".join(out + ([cc[0]] if cc else []))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the markdown report here")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--modes", default="1,all", help="thread modes: 1 (one pinned thread), all (every core)")
    p.add_argument("--no-first-call", action="store_true", help="skip the cold/warm first-call processes")
    p.add_argument("--noise", action="store_true",
                   help="steady state beside a neighbour process streaming memory on another core (noise.py)")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "steady":
            print(json.dumps(steady(rest[0], args.rounds, rest[1])))
        elif kind == "stream":
            print(json.dumps(stream(args.rounds)))
        else:
            print(json.dumps(first_call(rest[0], rest[1])))
        return
    workloads = [w for w in args.workloads.split(",") if w]
    measured, busy = pick_cores()
    steady_rows: dict[str, list[dict[str, Any]]] = {}
    streams = {}
    noise_line = "none (the machine as it was)"
    for mode in args.modes.split(","):
        pinned = {measured} if mode == "1" else None
        with (tempfile.TemporaryDirectory() as caches,  # steady state: warm caches of its own, not the user's
              neighbour(busy if args.noise else None) as noisy):
            if args.noise:
                noise_line = noisy
            env = child_env(mode, Path(caches))
            streams[mode] = run_child(["--rounds", str(args.rounds), "--child", "stream"], env, pinned)
            steady_rows[mode] = []
            for wl in workloads:
                print(f"[{mode}] {wl}", file=sys.stderr)
                steady_rows[mode].append(run_child(["--rounds", str(args.rounds), "--child", "steady", wl, mode], env, pinned))
    firsts: dict[str, dict[str, dict[str, Any]]] = {}
    if not args.no_first_call:
        for wl in workloads:
            firsts[wl] = {}
            for c in FIRST_CONTENDERS:
                with tempfile.TemporaryDirectory() as caches:
                    env = child_env("all", Path(caches))
                    cold = run_child(["--child", "first", wl, c], env, None)
                    warm = run_child(["--child", "first", wl, c], env, None)
                firsts[wl][c] = {"cold": cold, "warm": warm}
                print(f"[first] {wl} {c}: {cold['first_call_s']:.2f} s cold, {warm['first_call_s']:.2f} s warm", file=sys.stderr)
    command = "python benchmarks/cpu_peers.py " + " ".join(a for a in sys.argv[1:])
    text = report(steady_rows, streams, firsts, command.strip(), noise_line)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
