"""Built-in example graphs: the seeds' workloads and stacks of them."""

from __future__ import annotations

from planner.graph import Graph, GraphBuilder


def mlp_epilogue(m: int = 4096, n: int = 4096, k: int = 4096, dtype: str = "fp16", gelu: str = "tanh") -> Graph:
    """Seed 000's chain: GEMM -> +bias -> GELU -> +residual."""
    if gelu not in ("tanh", "erf"):
        raise ValueError(f"--gelu must be 'tanh' or 'erf', got {gelu!r}")
    b = GraphBuilder(f"mlp-epilogue-{m}x{n}x{k}-{dtype}-{gelu}")
    b.input("x", (m, k), dtype)
    b.input("w", (k, n), dtype)
    b.input("b", (n,), dtype)
    b.input("r", (m, n), dtype)
    b.op("mm", "MatMul", ["x", "w"])
    b.op("bias", "BiasAdd", ["mm", "b"])
    b.op("gelu", "GeluTanh" if gelu == "tanh" else "GeluErf", ["bias"])
    b.op("res", "Add", ["gelu", "r"])
    return b.build(["res"])


def heavy(n: int = 2**26, dtype: str = "fp16") -> Graph:
    """Seed 000's "fusion loses" pair: 200 + 100 live registers spill when fused."""
    b = GraphBuilder(f"heavy-{n}-{dtype}")
    b.input("x", (n,), dtype)
    b.op("a", "Stage", ["x"], {"flops": 1, "regs": 200})
    b.op("b", "Stage", ["a"], {"flops": 1, "regs": 100})
    return b.build(["b"])


def ew_chain(k: int = 4, n: int = 2**24, dtype: str = "fp32", fat_temps: int = 0) -> Graph:
    """Seed 001's chain: stage s is y = a_s*y + b_s, then ReLU on even s.

    ``fat_temps`` > 0 appends the C-05 register-pressure probe: a Stage that
    keeps that many live temporaries (identity on values).
    """
    if k < 1:
        raise ValueError(f"--k must be at least 1, got {k}")
    b = GraphBuilder(f"ew-chain-k{k}-{n}-{dtype}" + (f"-fat{fat_temps}" if fat_temps else ""))
    y = b.input("x", (n,), dtype)
    for s in range(k):
        y = b.op(f"affine{s}", "Affine", [y], {"a": 1 + 0.01 * (s + 1), "b": 0.001 * (s + 1)})
        if s % 2 == 0:
            y = b.op(f"relu{s}", "Relu", [y])
    if fat_temps:
        y = b.op("fat", "Stage", [y], {"flops": 2 * fat_temps, "regs": 2 * fat_temps, "temps": fat_temps})
    return b.build([y])


def mlp_stack(layers: int = 4, d: int = 1024, m: int = 64, dtype: str = "fp16") -> Graph:
    """``layers`` mlp-epilogue blocks; each block's residual is its own input."""
    b = GraphBuilder(f"mlp-stack-L{layers}-d{d}-m{m}-{dtype}")
    x = b.input("x", (m, d), dtype)
    for i in range(layers):
        b.input(f"w{i}", (d, d), dtype)
        b.input(f"b{i}", (d,), dtype)
        mm = b.op(f"mm{i}", "MatMul", [x, f"w{i}"])
        bias = b.op(f"bias{i}", "BiasAdd", [mm, f"b{i}"])
        g = b.op(f"gelu{i}", "GeluTanh", [bias])
        x = b.op(f"res{i}", "Add", [g, x])
    return b.build([x])


EXAMPLES = ("mlp-epilogue", "heavy", "ew-chain", "mlp-stack")
