"""Where the tests' shared files are, wherever a test module sits in the tree."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
FIXTURES = TESTS / "fixtures"
GPU_DATA = TESTS / "data" / "gpu"
