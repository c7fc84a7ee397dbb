"""benchmarks/avx2.py narrows every contender, and keeps what the caller's environment already says."""

from __future__ import annotations

import importlib

from testpaths import ROOT, benchmark_script


def test_every_contender_is_told_to_use_avx2_code():
    env = benchmark_script("avx2").narrowed_env({"PATH": "/bin", "XLA_FLAGS": "--xla_cpu_enable_fast_math=false"})
    assert env["PATH"] == "/bin" and env["FUSION_PLANNER_CPU_ISA"] == "avx2" and env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert env["XLA_FLAGS"] == "--xla_cpu_enable_fast_math=false --xla_cpu_max_isa=AVX2"
    assert benchmark_script("avx2").narrowed_env(env)["XLA_FLAGS"] == env["XLA_FLAGS"]


def test_a_child_of_the_peers_benchmark_keeps_the_narrowing_of_xlas_code_in_every_mode(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # the script imports its siblings (noise)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false --xla_cpu_max_isa=AVX2")
    peers = importlib.import_module("cpu_peers")  # imported by name, as its siblings import it
    one = peers.child_env("1")["XLA_FLAGS"].split()
    assert "--xla_cpu_multi_thread_eigen=false" in one and "--xla_cpu_max_isa=AVX2" in one
    assert peers.child_env("all")["XLA_FLAGS"] == "--xla_cpu_max_isa=AVX2"
    monkeypatch.delenv("XLA_FLAGS")
    assert "XLA_FLAGS" not in peers.child_env("all")
