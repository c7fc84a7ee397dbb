import os
import shutil
import sys
from pathlib import Path

import pytest

# the helpers (testpaths, _fake_backend, gpu_bundles) sit here; test modules sit in folders mirroring the package
sys.path.append(str(Path(__file__).resolve().parent))


def _nvrtc_missing() -> str | None:
    """Why cupy's NVRTC cannot compile here, or None; ``FUSION_PLANNER_REQUIRE_NVRTC=1`` (``make test``) makes
    a missing NVRTC a failure of its tests rather than a skip."""
    if os.environ.get("FUSION_PLANNER_REQUIRE_NVRTC") == "1":
        return None
    try:
        from cupy.cuda import compiler

        compiler._get_nvrtc_version()
    except Exception as exc:
        return f"no cupy NVRTC ({type(exc).__name__}: {str(exc)[:80]}); pip install '.[test]'"
    return None


def pytest_collection_modifyitems(config, items):
    no_nvcc = shutil.which("nvcc") is None
    no_nvrtc = _nvrtc_missing()
    try:
        import cupy  # noqa: F401
        import cupy.cuda.runtime as rt

        has_gpu = rt.getDeviceCount() > 0
    except Exception:
        has_gpu = False
    for item in items:
        if "nvcc" in item.keywords and no_nvcc:
            item.add_marker(pytest.mark.skip(reason="nvcc is not on PATH"))
        if "nvrtc" in item.keywords and no_nvrtc:
            item.add_marker(pytest.mark.skip(reason=no_nvrtc))
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="no CUDA device with cupy"))


@pytest.fixture(autouse=True, scope="session")
def _session_plan_cache(tmp_path_factory):
    """Session-wide fixtures never read the user's plan cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FUSION_PLANNER_PLAN_CACHE", str(tmp_path_factory.mktemp("session-plan-cache")))
        yield


@pytest.fixture(autouse=True, scope="session")
def _generated_attention():
    """fp32 attention is the generated kernel unless a test says otherwise: the measured choice between it and
    torch's (``FUSION_PLANNER_CPU_ATTENTION=auto``) depends on the machine, and tests assert the kernel's facts."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FUSION_PLANNER_CPU_ATTENTION", "generated")
        yield


@pytest.fixture(autouse=True, scope="session")
def _onednn_convolution():
    """3x3 convolutions are oneDNN's unless a test says otherwise: the measured choice between it and
    Winograd's (``FUSION_PLANNER_CPU_CONVOLUTION=auto``) depends on the machine, and tests assert the kernel's
    facts."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FUSION_PLANNER_CPU_CONVOLUTION", "onednn")
        yield


@pytest.fixture(autouse=True)
def _private_plan_cache(tmp_path, monkeypatch):
    """Each test gets an empty plan cache: a cached plan from another test must not answer."""
    monkeypatch.setenv("FUSION_PLANNER_PLAN_CACHE", str(tmp_path / "plan-cache"))
