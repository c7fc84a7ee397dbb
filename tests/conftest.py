import shutil

import pytest


def pytest_collection_modifyitems(config, items):
    no_nvcc = shutil.which("nvcc") is None
    try:
        import cupy  # noqa: F401
        import cupy.cuda.runtime as rt

        has_gpu = rt.getDeviceCount() > 0
    except Exception:
        has_gpu = False
    for item in items:
        if "nvcc" in item.keywords and no_nvcc:
            item.add_marker(pytest.mark.skip(reason="nvcc is not on PATH"))
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="no CUDA device with cupy"))
