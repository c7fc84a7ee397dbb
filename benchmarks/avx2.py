"""Run a benchmark as on an AVX2-only machine: every contender's code narrowed to AVX2, on a CPU with AVX-512.

Usage: ``python benchmarks/avx2.py benchmarks/cpu_peers.py --out /tmp/peers_avx2.md`` (any benchmark script and its
arguments).  Machines of this kind come with AVX-512 (and AMX on Intel) or with AVX2 only; where only the first
kind is lent, this runs the script with each library told to use AVX2 code, so the kernels and the choices an AVX2
machine would see are measured side by side with the peers' AVX2 code:

- this project: ``FUSION_PLANNER_CPU_ISA=avx2`` (generated C compiled with ``-mno-avx512f`` after ``-march=native``;
  16-bit products widened, as without AVX-512 BF16 or AMX);
- torch eager: ``ATEN_CPU_CAPABILITY=avx2`` (ATen's kernels), ``MKL_ENABLE_INSTRUCTIONS=AVX2`` and
  ``ONEDNN_MAX_CPU_ISA=AVX2`` (its products and convolutions);
- torch.compile: Inductor reads ``ATEN_CPU_CAPABILITY`` for its vector code, and ``TORCHINDUCTOR_CPP_MARCH`` gives its
  C++ the flags ours get;
- jax.jit: ``XLA_FLAGS=--xla_cpu_max_isa=AVX2``; numpy's OpenBLAS: ``OPENBLAS_CORETYPE=Haswell``.

What it cannot narrow: XLA's matrix products (``--xla_cpu_max_isa`` narrows the code XLA generates, not its
runtime's dot: a 1024x1024x1024 product ran at 108 GFLOPS on one Zen 4 core with ``--xla_cpu_max_isa=SSE4_2``, as
without it, above what SSE code can reach there, 2026-12-07; on this core AVX-512 and AVX2 products have the same
peak, so the figures stand, on an AVX2 core jax.jit's products run AVX2 code anyway); the caches, memory and core
of the machine it runs on (an AVX2 EPYC is an older core with
other caches), and 512-bit execution of Zen 4 (two 256-bit halves) is not what makes AVX2 code fast or slow there.
Results files name the narrowing in their machine line ("code narrowed to AVX2").
"""

from __future__ import annotations

import os
import sys

NARROWED = {
    "FUSION_PLANNER_CPU_ISA": "avx2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "OPENBLAS_CORETYPE": "Haswell",
    # one token to Inductor, split by its command line into -march=native -mno-avx512f: the flags of our own kernels
    "TORCHINDUCTOR_CPP_MARCH": "native -mno-avx512f",
}
XLA_FLAG = "--xla_cpu_max_isa=AVX2"


def narrowed_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with every contender told to use AVX2 code."""
    out = {**env, **NARROWED}
    xla = out.get("XLA_FLAGS", "")
    out["XLA_FLAGS"] = f"{xla} {XLA_FLAG}".strip() if XLA_FLAG not in xla else xla
    return out


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help") or not argv[0].endswith(".py"):
        print(__doc__)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    os.execve(sys.executable, [sys.executable, *argv], narrowed_env(dict(os.environ)))


if __name__ == "__main__":
    main(sys.argv[1:])
