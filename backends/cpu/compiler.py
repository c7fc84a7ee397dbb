"""Compiling the CPU backend's C: the system compiler, probed once per machine for the flags it takes, builds
shared objects cached by the SHA-256 of (compiler, flags, source) under the user cache directory, in batches;
ctypes loads them. A compiler that hangs or whose build fails is an error naming the step."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends import process
from backends.codegen import (
    CodegenError,
)
from backends.cpu.prelude import (
    BASE_FLAGS,
    CONTRACT_FLAGS,
    NATIVE_FLAGS,
    PRELUDE,
    SYMBOL,
    VECTOR_MATH,
    WIDE_VECTOR_FLAGS,
)
from planner.core.env import env_seconds
from planner.core.files import untrusted_dir
from planner.core.machine import target_isa

log = logging.getLogger(__name__)


def _seal(path: Path) -> str:
    """The size and SHA-256 of a built shared object, recorded beside it."""
    data = path.read_bytes()
    return f"{len(data)} {hashlib.sha256(data).hexdigest()}\n"


def _sealed(so: Path) -> bool:
    """Does ``so`` match the size and hash recorded when it was built?  (A check against corruption and
    foreign files; the cache directory itself is trusted: docs/security.md.)"""
    try:
        return so.with_suffix(".sha256").read_text() == _seal(so)
    except OSError:
        return False


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/fusion-planner/cpu``, else ``~/.cache/fusion-planner/cpu``."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "fusion-planner" / "cpu"


def read_record(path: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON record of a measurement kept at ``path`` when it was made for ``key``; None when there is none,
    it is unreadable, or it holds for another machine or version (measure again)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("key") == key else None


def keep_record(path: Path, record: dict[str, Any], what: str) -> None:
    """Write a JSON ``record`` of a measurement (``what``) to ``path`` in the cache, atomically; a read-only cache
    only warns (the measurement is made again by the next process)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(record, f)
        os.replace(f.name, path)
    except OSError as exc:
        log.warning("cannot keep %s in %s: %s", what, path, exc)


def recorded_choice(kind: str, key: dict[str, Any], choices: Sequence[str],
                    decide: Callable[[], tuple[str, Mapping[str, float]]], what: str) -> str:
    """A measured choice among ``choices`` kept in the kernel cache as ``<kind>-<hash of key>.json``: the one
    recorded there for ``key``, else ``decide()``'s (choice, seconds per contender), recorded there."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / f"{kind}-{digest}.json"
    record = read_record(path, key)
    if record is not None and record.get("choice") in choices:
        return str(record["choice"])
    choice, seconds = decide()
    keep_record(path, {"key": key, "choice": choice, "seconds": dict(seconds)}, what)
    return choice


class CompilerUnavailable(RuntimeError):
    """No working C compiler on this machine."""


#: seconds the compiler may take to print its version or build the probe, and (``$FUSION_PLANNER_CC_TIMEOUT``
#: overrides it) to build one kernel or a batch
PROBE_TIMEOUT_S = 60.0
BUILD_TIMEOUT_S = 300.0
TIMEOUT_HINT = " (FUSION_PLANNER_CC_TIMEOUT sets the kernel limit)"


def build_timeout_s() -> float:
    return env_seconds("FUSION_PLANNER_CC_TIMEOUT", BUILD_TIMEOUT_S)


def _run(cmd: list[str], timeout: float, what: str, error: type[Exception]) -> process.Finished:
    """Run the compiler with a timeout, in its own process group: a hanging compiler (or a child of it) is an
    error naming the step, never a hang."""
    return process.run(cmd, timeout, what, error, TIMEOUT_HINT)


Probe = tuple[tuple[str, ...], tuple[str, ...], str]
#: the flags that narrow ``-march=native`` to each :func:`~planner.core.machine.target_isa` (the generated code uses
#: no AMX instruction: AVX-512 is what an AVX2 machine lacks of it)
ISA_FLAGS = {"native": (), "avx2": ("-mno-avx512f",)}
_NATIVE = BASE_FLAGS + NATIVE_FLAGS
#: what the probe tries, best first: (flags, libraries)
PROBE_ATTEMPTS = ((_NATIVE + WIDE_VECTOR_FLAGS + VECTOR_MATH[0], VECTOR_MATH[1]), (_NATIVE + VECTOR_MATH[0], VECTOR_MATH[1]),
                  (_NATIVE, ()), (BASE_FLAGS, ()))
PROBE_SOURCE = PRELUDE + "float fp_probe(float x) { return tanhf(x) + erff(x) + expf(x); }\n"


@functools.lru_cache(maxsize=4)
def _probe(cc: str) -> Probe:
    """(flags, libraries, version line): ``-march=native`` and vector math where they work.

    The answer is kept in the kernel cache, keyed by the compiler binary (path, size, mtime) and this
    probe: each process otherwise spent about 0.15 s on two compiler runs before its first kernel."""
    path = shutil.which(cc)
    if path is None:
        raise CompilerUnavailable(f"C compiler {cc!r} not found on PATH (set CC)")
    record = _probe_record(path)
    cached = _read_probe(record)
    if cached is not None:
        return cached
    found = _run_probe(cc, path)
    if record is not None and not untrusted_dir(record.parent):
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            _write_atomic(record, json.dumps({"flags": found[0], "libs": found[1], "version": found[2]}))
        except OSError as exc:
            log.debug("probe result not cached (%s)", exc)
    return found


def _probe_record(path: str) -> Path | None:
    try:
        st = os.stat(os.path.realpath(path))
    except OSError:
        return None
    key = hashlib.sha256(repr((os.path.realpath(path), st.st_size, st.st_mtime_ns, PROBE_SOURCE, PROBE_ATTEMPTS))
                         .encode()).hexdigest()[:24]
    return cache_dir() / f"probe-{key}.json"


def _read_probe(record: Path | None) -> Probe | None:
    """A cached probe result, if it is one the probe could have given (flags from a file never reach the
    compiler unless they are exactly one of :data:`PROBE_ATTEMPTS`)."""
    if record is None or not record.is_file() or untrusted_dir(record.parent):
        return None
    try:
        doc = json.loads(record.read_text()[:4096])
        found = (tuple(doc["flags"]), tuple(doc["libs"]), str(doc["version"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return found if found[:2] in PROBE_ATTEMPTS else None


def _run_probe(cc: str, path: str) -> Probe:
    version = _run([path, "--version"], PROBE_TIMEOUT_S, f"{cc} --version", CompilerUnavailable).stdout
    version = version.splitlines()[0] if version else path
    last = ""
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "probe.c"
        src.write_text(PROBE_SOURCE)
        for flags, libs in PROBE_ATTEMPTS:
            r = _run([path, *flags, "-o", str(Path(d) / "probe.so"), str(src), *libs, "-lm"], PROBE_TIMEOUT_S,
                     f"{cc} on the probe source", CompilerUnavailable)
            if r.returncode == 0:
                if "-march=native" not in flags:
                    log.warning("%s rejects -march=native; compiling with %s (%s)", cc, " ".join(flags), last)
                elif not libs:
                    log.info("%s: no vector math library (libmvec); transcendental ops stay scalar", cc)
                return flags, libs, version
            last = r.stderr.strip()
    raise CompilerUnavailable(f"C compiler {cc!r} cannot build a shared object: {last}")


@dataclass
class Compiler:
    """Compiles C sources into cached shared objects and loads them."""

    cc: str = ""
    directory: Path | None = None
    #: contract a*x + b into one fused multiply-add (rounded once); None: $FUSION_PLANNER_CPU_FMA, default on
    fma: bool | None = None
    #: flags after the probed ones that narrow the target: ``("-mno-avx512f",)`` compiles this machine's kernels as
    #: an AVX2 machine's (the prelude's 8-lane branch), to test and measure them where AVX-512 is present;
    #: None: those of ``$FUSION_PLANNER_CPU_ISA`` (:data:`ISA_FLAGS`)
    target: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        self.cc = self.cc or os.environ.get("CC", "cc")
        self.build_timeout_s = build_timeout_s()  # a bad $FUSION_PLANNER_CC_TIMEOUT is named here, before any build
        if self.fma is None:
            self.fma = os.environ.get("FUSION_PLANNER_CPU_FMA", "1").strip().lower() not in ("0", "off", "false", "no")
        if self.target is None:
            self.target = ISA_FLAGS[target_isa()]
        flags, self.libs, self.version = _probe(self.cc)
        self.flags = (*flags, CONTRACT_FLAGS[self.fma], *self.target)
        self.directory = self.directory or cache_dir()
        refused = untrusted_dir(self.directory)
        if refused:  # a shared object from there would run its code when loaded
            private = Path(tempfile.mkdtemp(prefix="fusion-planner-kernels-"))
            log.warning("not using the kernel cache %s: %s; compiling into %s", self.directory, refused, private)
            self.directory = private
        self._loaded: dict[str, tuple[ctypes.CDLL, str]] = {}
        self._batches: dict[str, ctypes.CDLL] = {}
        self.compiled = 0  # sources compiled (not found in the cache) by this object

    def key(self, source: str, extra: Sequence[str] = ()) -> str:
        h = hashlib.sha256()
        for part in (self.version, " ".join((*self.flags, *extra) + self.libs), source):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()

    def build(self, source: str, extra: Sequence[str] = ()) -> Path:
        """The shared object of ``source``, compiling it (with the ``extra`` flags too) unless cached."""
        return self.start_build(source, extra)()

    def start_build(self, source: str, extra: Sequence[str] = ()) -> Callable[[], Path]:
        """:meth:`build`, its compiler run started: the caller works meanwhile, then calls what this returns, which
        waits for the run and returns the shared object."""
        assert self.directory is not None
        key = self.key(source, extra)
        so = self.directory / f"k{key[:32]}.so"
        if so.exists():
            if _sealed(so):
                return lambda: so
            log.warning("kernel cache entry %s does not match its recorded size and hash; rebuilding it", so.name)
            so.unlink(missing_ok=True)
        self.directory.mkdir(parents=True, exist_ok=True)
        scratch = tempfile.TemporaryDirectory(dir=self.directory)
        src, tmp = Path(scratch.name) / "kernel.c", Path(scratch.name) / "kernel.so"
        try:
            src.write_text(source)
            run = process.Running([shutil.which(self.cc) or self.cc, *self.flags, *extra, "-o", str(tmp), str(src),
                                   *self.libs, "-lm"], f"{self.cc} on a generated kernel", CodegenError)
        except BaseException:
            scratch.cleanup()
            raise

        def finish() -> Path:
            try:
                r = run.finish(self.build_timeout_s, TIMEOUT_HINT)
                if r.returncode != 0:
                    raise CodegenError(f"{self.cc} failed on a generated kernel: {r.stderr.strip()[:2000]}")
                seal = _seal(tmp)
                os.replace(tmp, so)  # atomic: concurrent builders of one key agree
                _write_atomic(so.with_suffix(".sha256"), seal)
            finally:
                scratch.cleanup()
            self.compiled += 1
            return so

        return finish

    def vectorisation_report(self, source: str) -> str:
        """What the compiler says it vectorised in ``source`` (gcc's ``-fopt-info-vec-optimized``), with
        the flags kernels are built with; empty for compilers without that report."""
        with tempfile.TemporaryDirectory() as d:
            src = Path(d) / "kernel.c"
            src.write_text(source)
            r = _run([shutil.which(self.cc) or self.cc, *self.flags, "-fopt-info-vec-optimized",
                      "-o", str(Path(d) / "kernel.so"), str(src), *self.libs, "-lm"],
                     self.build_timeout_s, f"{self.cc} reporting vectorisation", CodegenError)
        return r.stderr if r.returncode == 0 else ""

    def load(self, source: str) -> tuple[ctypes.CDLL, str]:
        """The loaded library holding ``source``'s kernel and the kernel's symbol: its own shared object,
        or the batch (:meth:`build_many`) it was compiled in."""
        key = self.key(source)
        found = self._loaded.get(key)
        if found is None:
            found = self._load_batched(key) or (self._load_own(source), SYMBOL)
            self._loaded[key] = found
        return found

    def _load_own(self, source: str) -> ctypes.CDLL:
        path = self.build(source)
        try:
            return ctypes.CDLL(str(path))
        except OSError as exc:  # an entry that passed its seal yet does not load: rebuild it once
            log.warning("kernel cache entry %s does not load (%s); rebuilding it", path.name, exc)
            path.unlink(missing_ok=True)
            return ctypes.CDLL(str(self.build(source)))

    def _load_batched(self, key: str) -> tuple[ctypes.CDLL, str] | None:
        """The batch library and symbol a ``k<key>.ref`` names, if both are intact; else None (and the
        kernel is built on its own)."""
        assert self.directory is not None
        ref = self.directory / f"k{key[:32]}.ref"
        try:
            so_name, symbol = ref.read_text().split()
        except (OSError, ValueError):
            return None
        so = self.directory / so_name
        if not (_BATCH_NAME.fullmatch(so_name) and symbol == _batched_symbol(key) and _sealed(so)):
            log.warning("kernel cache entry %s names a missing or altered batch; building the kernel alone", ref.name)
            return None
        lib = self._batches.get(so_name)
        if lib is None:
            try:
                lib = ctypes.CDLL(str(so))
            except OSError:
                return None
            self._batches[so_name] = lib
        return (lib, symbol) if hasattr(lib, symbol) else None

    def build_many(self, sources: Sequence[str], jobs: int = 1) -> int:
        """Compile every source not in the cache, a few compiler runs for all of them: each run compiles one
        translation unit holding the prelude once and a share of the kernels (their symbols renamed by
        key), ``jobs`` runs at a time.  Returns how many kernels were compiled."""
        return self.start_many(sources, jobs)()

    def start_many(self, sources: Sequence[str], jobs: int = 1) -> Callable[[], int]:
        """:meth:`build_many`, its compiler runs started: the caller works meanwhile, then calls what this returns,
        which waits for them and returns how many kernels were compiled."""
        assert self.directory is not None
        todo: dict[str, str] = {}
        for src in sources:
            key = self.key(src)
            if key in todo or key in self._loaded or not src.startswith(PRELUDE):
                continue
            if (self.directory / f"k{key[:32]}.so").exists() or (self.directory / f"k{key[:32]}.ref").exists():
                continue
            todo[key] = src
        if not todo:
            return lambda: 0
        self.directory.mkdir(parents=True, exist_ok=True)
        items = sorted(todo.items())
        groups = [items[i::max(1, jobs)] for i in range(max(1, min(jobs, len(items))))]
        scratch = tempfile.TemporaryDirectory(dir=self.directory)
        try:
            runs = [self._start_batch(Path(scratch.name), group) for group in groups]
        except BaseException:
            scratch.cleanup()
            raise

        def finish() -> int:
            try:
                built = sum(len(group) for run, tmp, group in runs
                            if self._finish_batch(run, tmp, group, self.build_timeout_s))
            finally:
                for run, _, _ in runs:  # a timeout ended the loop: the other batches go too
                    if run.proc.poll() is None:
                        run.kill()
                scratch.cleanup()
            self.compiled += built
            return built

        return finish

    def _start_batch(self, d: Path, group: list[tuple[str, str]]) -> tuple[process.Running, Path, list[tuple[str, str]]]:
        parts = [PRELUDE]
        for key, src in group:
            parts.append(_renamed(src[len(PRELUDE):], key))
        digest = hashlib.sha256("".join(k for k, _ in group).encode()).hexdigest()[:32]
        c_file, tmp = d / f"{digest}.c", d / f"{digest}.so"
        c_file.write_text("\n".join(parts))
        cmd = [shutil.which(self.cc) or self.cc, *self.flags, "-o", str(tmp), str(c_file), *self.libs, "-lm"]
        return process.Running(cmd, f"{self.cc} on a batch of {len(group)} kernels", CodegenError), tmp, group

    def _finish_batch(self, run: process.Running, tmp: Path, group: list[tuple[str, str]], timeout: float) -> bool:
        done = run.finish(timeout, TIMEOUT_HINT)
        if done.returncode != 0:  # one bad kernel must not cost the others: each is built alone on first use
            log.warning("%s failed on a batch of %d kernels; they will be compiled one by one: %s",
                        self.cc, len(group), done.stderr.strip()[:500])
            return False
        assert self.directory is not None
        name = f"b{tmp.stem}.so"
        seal = _seal(tmp)
        os.replace(tmp, self.directory / name)
        _write_atomic((self.directory / name).with_suffix(".sha256"), seal)
        for key, _ in group:
            _write_atomic(self.directory / f"k{key[:32]}.ref", f"{name} {_batched_symbol(key)}\n")
        return True

    def function(self, source: str, n_pointers: int) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
        """``source``'s kernel: ``n_pointers`` pointers, then three int64 row/col arguments."""
        lib, symbol = self.load(source)
        fn = getattr(lib, symbol)
        fn.argtypes = [ctypes.c_void_p] * n_pointers + [ctypes.c_int64] * 3
        fn.restype = None
        return fn


#: the file-level names of a generated source (a kernel's own functions, types and constants), renamed per kernel
#: when kernels share a batch: two of one name in a translation unit fail the whole batch
_RENAME = re.compile(
    r"\bfp_(?:kernel|block|block8|stream|flush|row_store|first_tap|end_tap|input_block|output_block|zeros|in)\b")
_BATCH_NAME = re.compile(r"b[0-9a-f]{32}\.so")


def _renamed(body: str, key: str) -> str:
    return _RENAME.sub(lambda m: f"{m.group(0)}_{key[:16]}", body)


def _batched_symbol(key: str) -> str:
    return f"{SYMBOL}_{key[:16]}"
