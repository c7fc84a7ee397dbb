"""The candidate bundles the GPU tests run (tests/data/gpu/*.json).

The GPU machine has no egglog, so the GPU tests read bundles exported here;
``test_gpu_bundles_match_the_current_code_generator`` (CPU) fails when they go stale.  Regenerate
with ``python -m tests.gpu_bundles``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent / "data" / "gpu"  # also run as a script: python -m tests.gpu_bundles

LT_EPILOGUES = ("DEFAULT", "BIAS", "RELU", "RELU_BIAS", "GELU", "GELU_BIAS")


def epilogue_graph(epilogue: str, dtype: str, m: int = 64, n: int = 96, k: int = 128) -> Any:
    from planner.core.graph import GraphBuilder
    from planner.core.ops import CUBLASLT_EPILOGUES, OPS

    b = GraphBuilder(f"lt-{epilogue}-{dtype}")
    b.input("x", (m, k), dtype)
    b.input("w", (k, n), dtype)
    y = b.op("mm", "MatMul", ["x", "w"])
    for i, op in enumerate(CUBLASLT_EPILOGUES[epilogue]):
        if OPS[op].arity == 2:
            b.input("b", (n,), dtype)
            y = b.op(f"e{i}", op, [y, "b"])
        else:
            y = b.op(f"e{i}", op, [y])
    return b.build([y])


def _specs() -> dict[str, tuple[Callable[[], Any], Callable[[Any], bool] | None]]:
    from planner.core.examples import attention, ew_chain, layer_norm, mlp_epilogue, rms_norm, softmax

    one = lambda p: len(p.kernels) == 1  # noqa: E731
    specs: dict[str, tuple[Callable[[], Any], Callable[[Any], bool] | None]] = {
        "mlp_fp16": (lambda: mlp_epilogue(24, 40, 36, "fp16"), None),
        "mlp_bf16": (lambda: mlp_epilogue(130, 136, 72, "bf16"), None),
        "mlp_decode": (lambda: mlp_epilogue(16, 512, 256, "fp16"), None),
        "ew_fp32": (lambda: ew_chain(4, 2**20 + 3, "fp32"), lambda p: len(p.kernels) <= 2),
        "ew_fp16": (lambda: ew_chain(3, 1001, "fp16"), lambda p: len(p.kernels) <= 2),
        "ew_bf16": (lambda: ew_chain(3, 4099, "bf16"), lambda p: len(p.kernels) <= 2),
        "fat": (lambda: ew_chain(4, 2**20, "fp32", fat_temps=48), one),
        "lean": (lambda: ew_chain(4, 2**20, "fp32"), one),
        "lt_gelu_fp32": (lambda: epilogue_graph("GELU_BIAS", "fp32", 128, 128, 64), one),
        "rows_ln_fp32": (lambda: layer_norm(96, 768, "fp32"), lambda p: len(p.kernels) <= 3),
        "rows_ln_fp16": (lambda: layer_norm(40, 5000, "fp16", residual=False), lambda p: len(p.kernels) <= 2),
        "rows_softmax_bf16": (lambda: softmax(70, 128, "bf16"), lambda p: len(p.kernels) <= 3),
        "rows_rms_bf16": (lambda: rms_norm(50, 1024, "bf16"), lambda p: len(p.kernels) <= 3),  # fp32 between Casts
        # attention's standalone kernels: the head layouts, the batched products, the fused online softmax
        "attn_fp32": (lambda: attention(2, 128, 256, 4, "fp32"), lambda p: len(p.kernels) <= 7),
        "attn_masked_bf16": (lambda: attention(2, 96, 192, 3, "bf16", masked=True), lambda p: len(p.kernels) <= 8),
    }
    for epi in LT_EPILOGUES:
        specs[f"lt_{epi}"] = (lambda e=epi: epilogue_graph(e, "fp16"), one)
    return specs


def build(name: str) -> dict[str, Any]:
    from backends.cupy.bundle import export_bundle
    from planner.core.cost import load_device
    from planner.egraph.candidates import build_candidates

    make, keep = _specs()[name]
    cands = build_candidates(make(), load_device("h200"))
    plans = [p for p in cands.plans if keep is None or keep(p)]
    return export_bundle(cands, seed=0, plans=plans)


def example_graphs() -> list[Any]:
    """Built-in examples in the shapes that exercise each code path of the CUDA generator."""
    from planner.core.examples import (
        attention,
        conv_block,
        ew_chain,
        heavy,
        layer_norm,
        mlp_epilogue,
        mlp_stack,
        rms_norm,
        rope,
        softmax,
        token_mlp,
    )

    return [
        mlp_epilogue(4096, 4096, 4096, "fp16"),
        mlp_epilogue(100, 200, 72, "bf16", "erf"),  # no tile multiple, erf GELU
        mlp_epilogue(16, 4096, 4096, "fp16"),  # decode
        ew_chain(4, 2**24, "fp32"),
        ew_chain(3, 1001, "fp16"),  # odd length: scalar tail
        ew_chain(4, 2**24, "fp32", fat_temps=48),
        heavy(2**20, "fp16"),
        mlp_stack(2, 256, 64, "fp16"),
        layer_norm(64, 768, "fp32"),  # row kernels: a residual add, two means, per-row broadcasts
        layer_norm(32, 5000, "fp16", residual=False),  # a row longer than the row buffer, 16-bit storage
        softmax(48, 128, "bf16"),  # a row max and a row sum
        rms_norm(32, 768, "bf16"),  # LLaMA's RMSNorm: Casts to fp32 and back, rounding in registers
        rope(1, 128, 768, 12, "bf16"),  # tables read modulo their size, rotated reads in 8-wide vectors
        rope(2, 64, 256, 4, "fp16", norm=True),  # RoPE inside a row kernel
        attention(2, 128, 256, 4, "bf16", masked=True),  # a padding mask read one row per group
        attention(1, 128, 256, 4, "fp32"),  # causal: the layouts, the batched products, the fused kernel
        attention(2, 64, 128, 2, "bf16", biased=True),  # a position bias row per query, the biased fused kernel
        token_mlp(64, 1000, 256, 512, "bf16"),  # ids gathered from a table, a packed projection's columns
        conv_block(2, 64, 28, "fp16"),  # channels-last copies, Im2col, the GEMMs' epilogues, the pools
    ]


@functools.cache
def example_kernels() -> dict[str, tuple[str, Any, Any]]:
    """Every generated CUDA kernel of the examples' candidates, by source digest: (graph name, Kernel, CudaKernel);
    built once a process (the nvcc and the NVRTC tests share it)."""
    from backends.cupy.codegen import generate
    from planner.core.cost import load_device
    from planner.egraph.candidates import build_candidates

    out = {}
    for g in example_graphs():
        cands = build_candidates(g, load_device("h200"), cap=256, k=8)
        for p in cands.plans:
            for k in p.kernels:
                if k.kind == "cublaslt":  # a library call
                    continue
                c = generate(k, p.tensors)
                out[c.digest] = (g.name, k, c)
    return out


def names() -> list[str]:
    return sorted(_specs())


def path(name: str) -> Path:
    return DATA / f"{name}.json"


def write_all() -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    for name in names():
        path(name).write_text(json.dumps(build(name), indent=None, sort_keys=True) + "\n")


if __name__ == "__main__":
    write_all()
