"""Fixtures shared by the backends' tests."""

from __future__ import annotations

import pytest

from backends.cpu.compiler import Compiler, CompilerUnavailable


@pytest.fixture(scope="module")
def compiler() -> Compiler:
    """The C compiler the CPU backend uses (the test skips where there is none)."""
    try:
        return Compiler()
    except CompilerUnavailable as exc:
        pytest.skip(f"no C compiler: {exc}")
