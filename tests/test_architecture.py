"""The repository's shape: the design card's top level, layers that import only downwards, no import cycles
between files or folders, no hidden local imports, tests that use public names only, and the deprecated
spellings that still work."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import grimp
import pytest
from testpaths import ROOT, TESTS

#: the packages the code lives in (the design card's top level)
PACKAGES = ("planner", "backends", "rewrite_rules")

#: modules a function may import locally, because they need an optional dependency (torch, cupy);
#: and the lazy entries: ``planner.plan`` without importing egglog, and the rule checker (hypothesis, a tenth of a
#: second of a process's start) only where rules are checked
OPTIONAL = ("planner.torch.", "backends.cupy.gpu", "backends.cupy.nvrtc", "planner.dynamo")
LAZY_ENTRY = {("planner/__init__.py", "planner.api"), ("planner/rules/load.py", "planner.rules.check"),
              ("planner/commands/check_rules.py", "planner.rules.check")}
OURS = (*PACKAGES, "fusion_planner")


def test_the_top_level_is_the_design_cards():
    tops = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")}
    assert {"pyproject.toml", "planner", "rewrite_rules", "backends", "tests", "docs"} <= tops
    for package in PACKAGES:
        assert (ROOT / package / "__init__.py").is_file()
    assert sorted(p.name for p in (ROOT / "rewrite_rules").glob("*.egg"))  # the rule files are package data


#: what the repository commits at its top level: the design card's folders and the files around them
COMMITTED_TOP = {".ci", ".gitignore", "Makefile", "README.md", "pyproject.toml", "planner", "rewrite_rules", "backends",
                 "fusion_planner", "tests", "docs", "benchmarks", "examples"}


def test_nothing_else_is_committed_at_the_top_level():
    """A stray output folder (a fuzz run's ``--out abc``) once got committed; the top level stays the card's."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert {path.split("/")[0] for path in listed.split("\0") if path} <= COMMITTED_TOP


def test_layers_hold():
    """import-linter's contracts in pyproject.toml: each layer imports only from the layers below it."""
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if exe is None:
        pytest.skip("import-linter is not installed")
    out = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    modules = sorted(graph.modules)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(start: str) -> None:
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))

    for m in modules:
        if m not in index:
            visit(m)
    return out


def test_no_import_cycles():
    graph = grimp.build_graph("fusion_planner")
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_cycle(tmp_path, monkeypatch):
    pkg = tmp_path / "cyclepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cyclepkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from cyclepkg import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _cycles(grimp.build_graph("cyclepkg", cache_dir=None)) == [["cyclepkg.a", "cyclepkg.b"]]


def test_no_function_local_imports_of_the_package_except_optional_ones():
    found = []
    for path in sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in OURS:
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names if a.name.split(".")[0] in OURS]
                else:
                    continue
                if names and not any(n.startswith(OPTIONAL) for n in names) and (rel, names[0]) not in LAZY_ENTRY:
                    found.append(f"{rel}:{node.lineno}: {names[0]}")
    assert found == []


def test_tests_use_public_names_only():
    ours = r"(?:planner|backends|rewrite_rules|fusion_planner)"
    private = re.compile(rf"from {ours}[\w.]* import [^\n]*\b_[A-Za-z]\w*|\b{ours}[\w.]*\._[A-Za-z]\w*")
    offenders = [f"{p.name}:{i}" for p in sorted(TESTS.rglob("*.py"))
                 for i, line in enumerate(p.read_text().splitlines(), 1) if private.search(line)]
    assert offenders == []


def test_core_and_the_remote_runner_import_neither_egglog_nor_torch():
    code = ("import sys; import planner.core, planner.core.reference, backends.cupy.runner, "
            "backends.cupy.__main__; "
            "print(sorted(m for m in ('egglog', 'torch', 'cupy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr


def test_planning_faces_and_cluster_workers_do_not_import_the_rule_checker():
    code = ("import sys; import planner.api, planner.cli, planner.cluster.workers; "
            "print(sorted(m for m in ('hypothesis', 'planner.rules.check') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr


def test_the_old_spellings_work_for_one_release_and_say_so():
    import backends.cpu.backend
    import planner
    import planner.core.graph
    import planner.core.reference

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sys.modules.pop("fusion_planner", None)
        import fusion_planner.backends.cpu.backend
        import fusion_planner.backends.reference
        import fusion_planner.core.graph

        import fusion_planner

    assert any(issubclass(w.category, DeprecationWarning) and "0.3" in str(w.message) for w in caught)
    assert fusion_planner.core.graph is planner.core.graph and fusion_planner.plan is planner.plan
    assert fusion_planner.backends.cpu.backend is backends.cpu.backend
    assert fusion_planner.backends.reference is planner.core.reference
    for argv in (["-m", "fusion_planner", "--help"], ["-m", "planner", "--help"]):
        out = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "explain" in out.stdout, out.stderr


def test_the_wheel_holds_the_three_packages_the_rule_files_and_the_entry_points(tmp_path):
    """What `pip install` of the distribution installs outside the repository: the packages, the .egg rule files as
    package data, the backend plugins' entry points, the CLI and the torch.compile backend."""
    import zipfile

    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = tmp_path.glob("fusion_planner-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if n.endswith(".py")} == {*PACKAGES, "fusion_planner"}
    shipped = {p.name for p in (ROOT / "rewrite_rules").glob("*.egg")}
    assert {n.split("/")[-1] for n in names if n.startswith("rewrite_rules/") and n.endswith(".egg")} == shipped
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    for line in ("[planner.backends]", "cpu = backends.cpu:PLUGIN", "cupy = backends.cupy:PLUGIN",
                 "fusion-planner = planner.cli:main", "fusion_planner = planner.dynamo:dynamo_backend"):
        assert line in text, text
    assert not any(n.startswith(("tests/", "benchmarks/", "docs/")) for n in names)
