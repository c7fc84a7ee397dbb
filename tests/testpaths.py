"""Where the tests' shared files are, wherever a test module sits in the tree."""

import importlib.util
from pathlib import Path
from types import ModuleType

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
FIXTURES = TESTS / "fixtures"
GPU_DATA = TESTS / "data" / "gpu"


def benchmark_script(name: str) -> ModuleType:
    """The module of ``benchmarks/<name>.py``, loaded from its file (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
