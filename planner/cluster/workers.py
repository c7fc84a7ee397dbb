"""A cluster worker: one Ray actor that owns one device (its own CPU cores, pinned, or one GPU), builds its backend
once and searches the regions it is sent there, so that every timing of a region is taken on that one device.

The class is plain Python; :mod:`planner.cluster.pool` makes it an actor. Kernels are built into the backend's
kernel cache, which workers on one machine (or on a shared filesystem) share."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import tempfile
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


def claim_cores(count: int) -> list[int]:
    """Pin this process to ``count`` cores of its affinity that no other worker on this machine holds."""
    CORE_LOCKS.mkdir(exist_ok=True)
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
    if len(claimed) < count:
        for _, fd in claimed:
            os.close(fd)
        raise BackendUnavailable(f"a worker needs {count} cores of its own on {socket.gethostname()}; other workers "
                                 f"hold the rest (lock files in {CORE_LOCKS})")
    _held.extend(fd for _, fd in claimed)
    cores = [core for core, _ in claimed]
    os.sched_setaffinity(0, cores)
    return cores


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


class RegionWorker:
    """The actor's body: ``describe`` says where it runs, ``search`` searches one region."""

    def __init__(self, name: str, backend: str, spec: DeviceSpec, options: Mapping[str, Any], device: str,
                 torch_ops: Sequence[str]) -> None:
        self.name = name
        self.cores = claim_cores(int(options.get("threads") or 1)) if device == "cpu" else []
        trust_torch_ops(torch_ops)
        self.backend = get_backend(backend, spec, **options)

    def describe(self) -> dict[str, Any]:
        device = (f"cores {','.join(map(str, self.cores))}" if self.cores
                  else f"GPU {os.environ.get('CUDA_VISIBLE_DEVICES', '(Ray set none)')}")
        return {"name": self.name, "host": socket.gethostname(), "pid": os.getpid(), "device": device}

    def search(self, job: RegionJob) -> RegionOutcome:
        outcome = search_region(job, self.backend, SearchLog(enabled=False))
        outcome.worker = self.name
        return outcome
