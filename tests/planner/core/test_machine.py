"""Results files name the CPU and the vector units that decide a kernel's speed."""

from __future__ import annotations

import pytest

from planner.core.errors import UsageError
from planner.core.machine import ISA_ENV, cpu_model, isa, target_isa


@pytest.mark.parametrize(("flags", "text"), [
    ({"avx2", "fma"}, "AVX2, no AVX-512, no AMX"),
    ({"avx2", "avx512f"}, "AVX-512, no AMX"),
    ({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, "AVX-512 with BF16, AMX"),
    ({"sse2"}, "no AVX2, no AMX"),
    (set(), "ISA unknown"),
])
def test_the_isa_line_tells_the_two_kinds_of_machine_apart(flags, text):
    assert isa(flags) == text


def test_this_machine_is_named_with_its_isa():
    model = cpu_model()
    assert model and ("AMX" in model or "ISA unknown" in model or "(" not in model)


def test_the_code_is_narrowed_to_avx2_only_when_asked(monkeypatch):
    monkeypatch.delenv(ISA_ENV, raising=False)
    assert target_isa() == "native" and "narrowed" not in cpu_model()
    monkeypatch.setenv(ISA_ENV, "AVX2")
    assert target_isa() == "avx2" and cpu_model().endswith("code narrowed to AVX2)")


def test_an_unknown_isa_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv(ISA_ENV, "avx1024")
    with pytest.raises(UsageError, match=r"\$FUSION_PLANNER_CPU_ISA='avx1024': expected native, avx2"):
        target_isa()
