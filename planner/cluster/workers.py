"""A cluster worker: one Ray actor that owns one device (its own CPU cores, pinned, or one GPU), builds its backend
once and searches the regions it is sent there, so that every timing of a region is taken on that one device.

The class is plain Python; :mod:`planner.cluster.pool` makes it an actor. Kernels are built into the backend's
kernel cache, which workers on one machine (or on a shared filesystem) share.

A worker may be *kept* between plans on a standing cluster (a detached actor, named by :func:`worker_key`): a
planner takes it with a lease (:meth:`RegionWorker.lease`), which no other planner can take until it is released or
runs out, and a kept worker with no lease for ``keep_s`` seconds ends itself."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import socket
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from planner.backend import BackendUnavailable
from planner.cluster.jobs import RegionJob, RegionOutcome, search_region
from planner.core.cost import DeviceSpec
from planner.core.errors import OpError
from planner.registry import get_backend
from planner.search.searchlog import SearchLog

#: one lock file per core: a worker holds the locks of the cores it is pinned to until its process ends
CORE_LOCKS = Path(tempfile.gettempdir()) / f"fusion-planner-cores-{os.getuid()}"

_held: list[int] = []  # this process's lock descriptors: kept open, so the locks last as long as the process


#: how long a worker waits for cores that a worker just ending still holds
CLAIM_WAIT_S = 10.0


def claim_cores(count: int) -> list[int]:
    """Pin this process to ``count`` cores of its affinity that no other worker on this machine holds (waiting
    up to :data:`CLAIM_WAIT_S` for a worker that is ending to let go of them)."""
    CORE_LOCKS.mkdir(exist_ok=True)
    deadline = time.monotonic() + CLAIM_WAIT_S
    while True:
        claimed = _try_cores(count)
        if len(claimed) == count:
            break
        for _, fd in claimed:
            os.close(fd)
        if time.monotonic() >= deadline:
            raise BackendUnavailable(f"a worker needs {count} cores of its own on {socket.gethostname()}; other "
                                     f"workers hold the rest (lock files in {CORE_LOCKS})")
        time.sleep(0.2)
    _held.extend(fd for _, fd in claimed)
    cores = [core for core, _ in claimed]
    os.sched_setaffinity(0, cores)
    return cores


def _try_cores(count: int) -> list[tuple[int, int]]:
    claimed: list[tuple[int, int]] = []
    for core in sorted(os.sched_getaffinity(0)):
        fd = os.open(CORE_LOCKS / f"{core}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        claimed.append((core, fd))
        if len(claimed) == count:
            break
    return claimed


def release_cores() -> None:
    """Give up the cores this process holds (a worker's end does it too)."""
    while _held:
        os.close(_held.pop())


def trust_torch_ops(names: Sequence[str]) -> None:
    """Trust the torch callables the driver trusted (its allowlist additions and the calls of the modules it
    traced), so that a region holding torch-backed steps runs here too."""
    if not names:
        return
    from planner.torch.ops import allow_torch_ops  # torch is optional: only a torch model's regions need it

    for name in names:
        with contextlib.suppress(OpError):  # a traced call with no canonical name here: a region that needs it
            allow_torch_ops([name])  # is refused by name when it runs


#: the packages whose code a worker runs: a kept worker answers only planners of the same code
CODE_PACKAGES = ("planner", "backends", "rewrite_rules")
_CODE_SUFFIXES = (".py", ".egg", ".json", ".c", ".h", ".cu")


@functools.cache
def code_fingerprint() -> str:
    """A hash of the planner's installed code (its packages' source and data files): a worker kept by a planner of
    other code is never taken by this one."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for package in CODE_PACKAGES:
        for f in sorted((root / package).rglob("*")):
            if f.suffix in _CODE_SUFFIXES and f.is_file() and "__pycache__" not in f.parts:
                h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def worker_key(args: Sequence[Any], env: Mapping[str, str]) -> str:
    """The name prefix of the kept workers that can serve a search: the same backend, device spec, options,
    trusted torch ops, passed environment and planner code."""
    text = json.dumps([repr(a) for a in args] + sorted(env.items()) + [code_fingerprint()])
    return "fp-" + hashlib.sha256(text.encode()).hexdigest()[:16]


class RegionWorker:
    """The actor's body: ``describe`` says where it runs, ``search`` searches one region; ``lease``, ``release``
    and ``retire`` are a kept worker's (see the module docstring)."""

    def __init__(self, name: str, backend: str, spec: DeviceSpec, options: Mapping[str, Any], device: str,
                 torch_ops: Sequence[str], env: Mapping[str, str]) -> None:
        """``env``: the planner's settings (:data:`~planner.cluster.pool.PASSED_ENV`), set here before anything reads
        them (no module reads one at import; torch, whose OpenMP pool reads ``OMP_*`` when it loads, is imported
        after). Passed so rather than as Ray's ``runtime_env``: an actor with a runtime env of its own cannot take
        one of the worker processes Ray starts ahead, and waits for a process of its own (0.3-0.6 s more each)."""
        os.environ.update(env)
        self.name = name
        self.cores = claim_cores(int(options.get("threads") or 1)) if device == "cpu" else []
        trust_torch_ops(torch_ops)
        self.backend = get_backend(backend, spec, **options)
        self._holder: str | None = None
        self._until = 0.0  # the lease runs out then (time.monotonic)
        self._idle_since = time.monotonic()
        self._keep_s = 0.0
        self._reaper: threading.Thread | None = None

    def lease(self, token: str, hold_s: float, keep_s: float) -> bool:
        """Take this worker for planner ``token`` for ``hold_s`` seconds (again: extend it); False while another
        planner's lease runs. ``keep_s``: how long the worker waits for the next lease once this one ends."""
        now = time.monotonic()
        if self._holder not in (None, token) and now < self._until:
            return False
        self._holder, self._until, self._keep_s = token, now + hold_s, keep_s
        if self._reaper is None and keep_s > 0:
            self._reaper = threading.Thread(target=self._end_when_idle, daemon=True)
            self._reaper.start()
        return True

    def release(self, token: str) -> None:
        if self._holder == token:
            self._holder, self._idle_since = None, time.monotonic()

    def retire(self) -> bool:
        """End this worker if no planner holds it (its cores are wanted by a worker of another kind); True if
        it ends."""
        if self._holder is not None and time.monotonic() < self._until:
            return False
        self._holder, self._until = "retired", float("inf")
        threading.Timer(0.2, os._exit, (0,)).start()
        return True

    def _end_when_idle(self) -> None:
        while True:
            time.sleep(max(min(self._keep_s / 4, 5.0), 0.05))
            now = time.monotonic()
            if self._holder is not None and now >= self._until:  # its planner vanished without a release
                self._holder, self._idle_since = None, self._until
            if self._holder is None and now - self._idle_since >= self._keep_s:
                os._exit(0)

    def describe(self) -> dict[str, Any]:
        device = (f"cores {','.join(map(str, self.cores))}" if self.cores
                  else f"GPU {os.environ.get('CUDA_VISIBLE_DEVICES', '(Ray set none)')}")
        return {"name": self.name, "host": socket.gethostname(), "pid": os.getpid(), "device": device}

    def search(self, job: RegionJob) -> RegionOutcome:
        outcome = search_region(job, self.backend, SearchLog(enabled=False))
        outcome.worker = self.name
        return outcome
