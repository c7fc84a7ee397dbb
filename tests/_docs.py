"""The samples of the README and docs/*.md, run as a reader would run them and compared with what is printed.

A sample is a fenced block whose lines start with ``$ `` (a shell command, ``\\`` continuing it), each followed
by its output (stdout and stderr as a terminal shows them) up to the next ``$ `` line; or a ```` ```python ````
block, whose output (what it prints on stdout) is the next fence when that one is plain (no language, no ``$``).
A line ``...`` in an output stands for any number of lines.

Each document's samples run in order in one scratch folder (``examples`` and ``tests`` linked in, a private plan
cache), so a later command may read what an earlier one wrote. A command that measures (a search on the cpu
backend, a calibration, a timed run or search in a Python snippet, a command marked ``# measured``) is compared by
its shape: its first line, its tables' header lines and the
first word of its last line, with every number masked. Any other is compared line by line, numbers and hashes
masked and runs of spaces folded (column widths follow the numbers).

``python tests/_docs.py --write [FILE.md ...]`` runs the samples and writes their real output into the
documents (keeping each sample's ``...`` elision: as many lines before and after it as the sample had).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ELIDED = "..."
#: commands whose output depends on timing: compared by shape
MEASURES = re.compile(r"--backend cpu|backend=\"cpu\"|calibrate|SEARCH_LOG|--search-log|\brun\b.*plan\.json"
                      r"|backends\.cupy time|bench c05|torch\.compile|# measured|\.time\(|perf_counter|SearchLog"
                      r"|\"cpu\"")
#: commands that need nvcc on PATH (registers and spills come from it): skipped without it, as their tests are
NEEDS_NVCC = re.compile(r"--kernel-facts|bench c05")
#: seconds one sample may take
TIMEOUT_S = 300

_FENCE = re.compile(r"^```(\w*)\s*$")
#: a hash (six or more hex digits, a letter among them) or a number: either is masked as N, so that a hash that
#: happens to be all digits, or a fraction of six digits, masks as any other value does
_VALUE = re.compile(r"(?<![.\w])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{6,}\b"
                    r"|(?<![A-Za-z_])[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:e[-+]?\d+)?")


@dataclass
class Sample:
    """One command (or Python snippet) and the output a document prints for it."""

    doc: Path
    command: str
    output: list[str]
    python: bool = False
    #: a snippet with no output fence after it (it must run, its output is not shown)
    silent: bool = False
    #: where the output lines sit in the document (0-based, end exclusive)
    span: tuple[int, int] = (0, 0)

    @property
    def needs_nvcc(self) -> bool:
        return bool(NEEDS_NVCC.search(self.command))

    @property
    def measures(self) -> bool:
        return bool(MEASURES.search(self.command))

    def __str__(self) -> str:
        head = self.command.splitlines()[0]
        return f"{self.doc.name}: {head[:100]}"


@dataclass
class Run:
    """A document's scratch folder and environment."""

    cwd: Path
    env: dict[str, str] = field(default_factory=dict)
    #: the last command's exit status, which ``$?`` reads in the next
    status: int = 0

    def execute(self, sample: Sample) -> tuple[int, list[str]]:
        if sample.python:
            argv, stdin = [sys.executable, "-"], sample.command
        else:
            argv, stdin = ["bash", "-c", f"(exit {self.status}); {sample.command}"], ""
        # a command's stdout and stderr in the order they were written (unbuffered), as a terminal shows them; a
        # snippet's stdout alone (what it prints; its logging goes there only when it says so)
        stderr = subprocess.PIPE if sample.python else subprocess.STDOUT
        done = subprocess.run(argv, input=stdin, cwd=self.cwd, env=self.env, stdout=subprocess.PIPE, stderr=stderr,
                              text=True, timeout=TIMEOUT_S)
        self.status = done.returncode
        lines = done.stdout.rstrip("\n").splitlines()
        if done.returncode != 0 and sample.python:
            lines += done.stderr.rstrip("\n").splitlines()[-3:]
        return done.returncode, lines


def scratch(folder: Path) -> Run:
    """A folder to run one document's samples in, with the repository's examples and test fixtures."""
    for name in ("examples", "tests"):
        link = folder / name
        if not link.exists():
            link.symlink_to(ROOT / name)
    env = dict(os.environ)
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", PYTHONUNBUFFERED="1",
               FUSION_PLANNER_PLAN_CACHE=str(folder / "plan-cache"), COLUMNS="200",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(folder)]))  # this checkout's code, whatever is installed
    env.pop("SEARCH_LOG", None)
    return Run(folder, env)


def samples(doc: Path) -> list[Sample]:
    """The samples of one document, in order."""
    lines = doc.read_text().splitlines()
    found: list[Sample] = []
    i = 0
    pending_python: Sample | None = None
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        body = lines[i + 1:end]
        lang = m.group(1)
        if lang == "python":
            pending_python = Sample(doc, "\n".join(body) + "\n", [], python=True, silent=True, span=(end, end))
            found.append(pending_python)
        elif lang == "" and any(line.startswith("$ ") for line in body):
            found += _commands(doc, body, i + 1)
            pending_python = None
        elif lang == "" and pending_python is not None:
            pending_python.output, pending_python.span, pending_python.silent = body, (i + 1, end), False
            pending_python = None
        else:
            pending_python = None
        i = end + 1
    return found


def _commands(doc: Path, body: list[str], first: int) -> list[Sample]:
    out: list[Sample] = []
    j = 0
    while j < len(body):
        if not body[j].startswith("$ "):
            j += 1
            continue
        command = [body[j][2:]]
        while command[-1].endswith("\\") and j + 1 < len(body):
            j += 1
            command.append(body[j])
        k = j + 1
        while k < len(body) and not body[k].startswith("$ "):
            k += 1
        out.append(Sample(doc, "\n".join(command), body[j + 1:k], span=(first + j + 1, first + k)))
        j = k
    return out


#: clauses a measured line prints only where the machine's timings make them true (candidates skipped because
#: their kernels' measured times already lose), masked away as numbers are
_MEASURED_CLAUSE = re.compile(r", N slower by their kernels")


def mask(line: str) -> str:
    """A line with its numbers and hashes masked, its timing-dependent clauses dropped and runs of spaces folded."""
    return _MEASURED_CLAUSE.sub("", " ".join(_VALUE.sub("N", line).split()))


def mismatch(sample: Sample, actual: list[str]) -> str | None:
    """Why ``actual`` is not the output ``sample`` prints, or None."""
    want = [line for line in sample.output if line.strip()]
    got = [line for line in actual if line.strip()]
    if sample.silent:
        return None
    if not want and got:
        return f"the document shows no output; the sample prints {got[0]!r}"
    if sample.measures:
        return _shape_mismatch(want, got)
    return _line_mismatch(want, got)


def is_table_header(line: str) -> bool:
    """A plan table's header (``plan bytes launches ...`` as column names), not a search-log line that names
    them in its prose (a tie's "the cost model's choice (fewer bytes, launches)", which noise may or may not
    print)."""
    return {"bytes", "launches"} <= set(line.split())


def _shape_mismatch(want: list[str], got: list[str]) -> str | None:
    if not want:
        return None
    if not got:
        return "no output"
    masked = [mask(line) for line in got]
    if mask(want[0]) != masked[0] and mask(want[0]) not in masked:
        return f"first line {want[0]!r} is not printed; the output begins {got[0]!r}"
    for line in want:
        if is_table_header(line) and mask(line) not in masked:
            return f"table header {line!r} is not printed"
    last = [line for line in want if line.strip() != ELIDED][-1].split()[0]
    if not any(line.split()[0] == last for line in got):
        return f"no line begins with {last!r} (the sample's last line)"
    return None


def _line_mismatch(want: list[str], got: list[str]) -> str | None:
    chunks: list[list[str]] = [[]]
    for line in want:
        if line.strip() == ELIDED:
            chunks.append([])
        else:
            chunks[-1].append(mask(line))
    masked = [mask(line) for line in got]
    at = 0
    for n, chunk in enumerate(chunks):
        if not chunk:
            continue
        anchored = n == 0
        where = _find(masked, chunk, at, anchored)
        if where is None:
            first = next((i for i in range(at, len(masked)) if masked[i] == chunk[0]), None)
            if first is None:
                return f"line {chunk[0]!r} is not printed{' first' if anchored else ''}"
            bad = next(i for i, (w, g) in enumerate(zip(chunk, masked[first:], strict=False)) if w != g) \
                if len(masked) - first >= len(chunk) else len(masked) - first
            shown = masked[first + bad] if first + bad < len(masked) else "<end of output>"
            return f"after {chunk[max(bad - 1, 0)]!r} the sample has {chunk[min(bad, len(chunk) - 1)]!r}, the output {shown!r}"
        at = where + len(chunk)
    if chunks[-1] and at != len(masked):
        return f"the output goes on after the sample's last line: {got[at]!r}"
    return None


def _find(lines: list[str], chunk: list[str], start: int, anchored: bool) -> int | None:
    stops = [start] if anchored else range(start, len(lines) - len(chunk) + 1)
    for i in stops:
        if lines[i:i + len(chunk)] == chunk:
            return i
    return None


def written(sample: Sample, actual: list[str]) -> list[str]:
    """The output to print for ``sample``: ``actual``, elided where the sample elides."""
    if ELIDED not in [line.strip() for line in sample.output]:
        return actual
    marks = [i for i, line in enumerate(sample.output) if line.strip() == ELIDED]
    head, tail = marks[0], len(sample.output) - marks[-1] - 1
    if head + tail >= len(actual):
        return actual
    return [*actual[:head], ELIDED, *(actual[len(actual) - tail:] if tail else [])]


def rewrite(doc: Path, folder: Path) -> int:
    """Run ``doc``'s samples and write their output into it; the count of samples rewritten."""
    run = scratch(folder)
    lines = doc.read_text().splitlines()
    edits: list[tuple[tuple[int, int], list[str]]] = []
    for sample in samples(doc):
        code, actual = run.execute(sample)
        if sample.python and code != 0:
            print(f"{sample}: exit {code}, left as it was: {' | '.join(actual[-3:])}", file=sys.stderr)
            continue
        if sample.silent:
            continue  # a snippet whose document shows no output
        edits.append((sample.span, written(sample, actual)))
    for (start, end), new in reversed(edits):
        lines[start:end] = new
    doc.write_text("\n".join(lines) + "\n")
    return len(edits)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="write the docs samples' real output into the documents")
    parser.add_argument("--write", action="store_true", required=True)
    parser.add_argument("docs", nargs="*", type=Path, default=DOCS)
    args = parser.parse_args()
    for path in args.docs:
        with tempfile.TemporaryDirectory() as tmp:
            print(f"{path}: {rewrite(path.resolve(), Path(tmp))} sample(s) written", file=sys.stderr)
