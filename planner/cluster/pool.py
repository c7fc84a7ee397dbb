"""The search's executors: ``serial`` (each region searched here, one after another) or ``ray`` (the distinct
regions fanned out over the workers of a Ray cluster, docs/scaling.md "Many machines").

:class:`RayPool` starts a local cluster (``workers``) or joins one (``address``), starts one
:class:`~planner.cluster.workers.RegionWorker` actor per device, and runs the region jobs on them, a budget share
each. On a cluster it did not start, the workers are kept (``keep_s``, by default :data:`DEFAULT_KEEP_S` where an
address is given): detached actors that the next search of the same kind leases instead of starting its own, so
that it pays no worker start (the imports, the backend, its calibration); idle ones of another kind are retired
when their cores are wanted. A worker that dies has its region re-queued on another; a worker whose region runs
past its budget plus a grace (``grace_s``) is taken for hung, killed and replaced, and its region re-queued. A
region that loses :data:`MAX_TRIES` workers ends the search with an error; so does a cluster left with no worker.
Each such event is logged (``logging``) and kept in :attr:`RayPool.events`."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from planner.backend import BackendUnavailable
from planner.cluster.jobs import Budget, RegionJob, RegionOutcome
from planner.cluster.workers import RegionWorker, worker_key
from planner.core.cost import DeviceSpec
from planner.core.errors import UsageError
from planner.registry import plugin
from planner.search.engine import SearchError

log = logging.getLogger(__name__)

#: what completes a region given a job's outcome, and the jobs now due (``planner.cluster.jobs.Parts.after``)
After = Callable[[RegionOutcome], tuple[RegionOutcome | None, list[RegionJob]]]

EXECUTORS = ("serial", "ray")
RAY_MISSING = "the ray executor needs Ray, an optional extra: pip install 'fusion-planner[ray]'"
#: a region still running this long after its search budget ran out is taken for a hung worker
DEFAULT_GRACE_S = 300.0
#: workers a region may lose (died or hung) before the search gives up on it
MAX_TRIES = 3
#: how long a new worker may take to start (import the planner, build its backend)
START_TIMEOUT_S = 300.0
#: how long a kept worker waits for the next search (``--keep-workers``) where an address is given
DEFAULT_KEEP_S = 600.0
#: the Ray namespace of kept workers
NAMESPACE = "fusion-planner"
#: how long a planner waits for a kept worker busy with another planner's search to answer a lease
LEASE_WAIT_S = 2.0
#: the environment a worker takes from the planner's process (the kernel cache, compiler, GEMM and thread
#: settings); the plan cache stays the driver's
PASSED_ENV = ("FUSION_PLANNER_", "OMP_", "SEARCH_OP_NAMES")
KEPT_HERE = ("FUSION_PLANNER_PLAN_CACHE",)

#: a local cluster's end under way (:meth:`RayPool.close`): Ray's shutdown waits for each of its processes in
#: turn (1.1-1.3 s here, its cores idle), which the planner need not wait for; the next cluster waits for it
_ending: threading.Thread | None = None


def _end_in_background(ray: Any) -> None:
    global _ending
    _ending = threading.Thread(target=ray.shutdown, name="fusion-planner-ray-shutdown")
    _ending.start()


def join_ending_cluster() -> None:
    """Wait until a local cluster a search started has ended (:meth:`RayPool.close`)."""
    global _ending
    if _ending is not None:
        _ending.join()
        _ending = None


def preloaded_modules(backend: str) -> list[str]:
    """What the worker processes of a cluster import as they start, ahead of a search (Ray's
    ``preload_python_modules``): the planner's worker and the backend's plugin."""
    return ["planner.cluster.workers", plugin(backend).create.__module__]


@dataclass(frozen=True)
class ExecutorOptions:
    """Where the region searches run: ``serial`` here, or ``ray``: a local cluster of ``workers`` (default: this
    machine's cores over the threads a worker takes), or the cluster at ``address`` (default workers: as many as
    its resources hold)."""

    kind: str = "serial"
    workers: int | None = None
    address: str | None = None
    grace_s: float = DEFAULT_GRACE_S
    #: seconds a worker is kept for the next search on a cluster this search did not start (None: the default,
    #: :data:`DEFAULT_KEEP_S` where an address is given, else 0: workers end with the search)
    keep_s: float | None = None

    @property
    def keep_workers_s(self) -> float:
        if self.keep_s is not None:
            return self.keep_s
        return DEFAULT_KEEP_S if self.address else 0.0

    def threads(self, backend: str, threads: int | None) -> int | None:
        """The threads a backend that takes them times on: as given; else a ray worker's one core (a serial
        search: the backend's own default, every core)."""
        takes = "threads" in plugin(backend).options
        return 1 if threads is None and takes and self.kind == "ray" else threads

    def validate(self) -> None:
        if self.kind not in EXECUTORS:
            raise UsageError(f"executor must be one of {', '.join(EXECUTORS)}, got {self.kind!r}")
        if self.kind == "serial" and (self.workers is not None or self.address is not None):
            raise UsageError("workers and a Ray address are options of the ray executor (--executor ray)")
        if self.workers is not None and (isinstance(self.workers, bool) or self.workers < 1):
            raise UsageError(f"workers must be at least 1, got {self.workers!r}")
        if not self.grace_s > 0:
            raise UsageError(f"the worker grace must be positive, got {self.grace_s}")
        if self.keep_s is not None and self.kind == "serial":
            raise UsageError("keeping workers is an option of the ray executor (--executor ray)")
        if self.keep_s is not None and not self.keep_s >= 0:
            raise UsageError(f"the workers' keep must be 0 or more seconds, got {self.keep_s!r}")
        if self.kind == "ray":
            import_ray()  # refused now, before any planning, where Ray is not installed


def import_ray() -> Any:
    try:
        import ray  # an optional extra
    except ImportError as exc:
        raise UsageError(RAY_MISSING) from exc
    return ray


@dataclass
class _Worker:
    name: str
    handle: Any
    pid: int
    where: str
    kept: bool = False  # a detached actor, leased: released, not killed, at the end


@dataclass
class _Running:
    worker: str
    job: RegionJob
    tries: int
    deadline: float


class RayPool:
    """Region searches on a Ray cluster's workers, one device each (see the module docstring)."""

    def __init__(self, options: ExecutorOptions, backend: str, spec: DeviceSpec, backend_options: Mapping[str, Any],
                 device: str, torch_ops: Sequence[str] = (), worker: type = RegionWorker) -> None:
        """``worker``: the actors' class, made with the arguments :class:`RegionWorker` takes and answering its
        ``describe`` and ``search`` (a simulation's stand-in: benchmarks/distributed.py)."""
        self.ray = import_ray()
        self.options = options
        self.threads = int(backend_options.get("threads") or 1) if device == "cpu" else 1
        self.device = device
        self.events: list[str] = []
        self.died = self.hung = 0
        self.started_cluster = False
        self.workers: dict[str, _Worker] = {}
        self._count = 0
        self._actor = self.ray.remote(worker)
        self._preload = preloaded_modules(backend)
        self._args = (backend, spec, dict(backend_options), device, tuple(torch_ops))
        self._env = {k: v for k, v in os.environ.items() if k.startswith(PASSED_ENV) and k not in KEPT_HERE}
        self._token = uuid.uuid4().hex  # this search's leases
        self._slot = 0  # the next kept-worker name to try
        self.reused = 0  # kept workers taken from an earlier search
        size = self._join()
        self.keep_s = options.keep_workers_s
        if self.keep_s and self.started_cluster and not options.address:
            log.info("workers are not kept: the local cluster this search started ends with it")
            self.keep_s = 0.0
        self._key = worker_key(self._args, self._env) if self.keep_s else ""
        try:
            if self.keep_s:
                self._retire_others(size)
            self._start([self._new_name() for _ in range(size)])
        except BaseException:
            self.close()
            raise
        self.size = size

    # -- the cluster
    def _join(self) -> int:
        ray, opts = self.ray, self.options
        if opts.address:
            _reachable(opts.address)
        join_ending_cluster()
        if not ray.is_initialized():  # else: this process's cluster (a caller's own ray.init)
            if opts.address:
                try:
                    ray.init(address=opts.address, logging_level=logging.ERROR, log_to_driver=False)
                except (ConnectionError, ValueError) as exc:
                    raise UsageError(f"cannot join the Ray cluster at {opts.address}: {_cause(exc)}") from None
            else:
                ray.init(num_cpus=self._local_cpus(), include_dashboard=False, logging_level=logging.ERROR,
                         log_to_driver=False, _system_config={"preload_python_modules": self._preload})
            self.started_cluster = True
        held = ray.cluster_resources().get("GPU" if self.device == "gpu" else "CPU", 0)
        fits = int(held // (1 if self.device == "gpu" else self.threads))
        size = opts.workers or fits
        if size < 1 or size > fits:
            need = f"{size} GPU(s)" if self.device == "gpu" else f"{size} x {self.threads} cores"
            raise UsageError(f"the Ray cluster holds {held:g} {'GPUs' if self.device == 'gpu' else 'CPUs'}: too few "
                             f"for {max(size, 1)} worker(s) of its own device each ({need})")
        return size

    def _local_cpus(self) -> int:
        cores = len(os.sched_getaffinity(0))
        workers = self.options.workers or max(cores // self.threads, 1)
        if self.device == "cpu" and workers * self.threads > cores:
            raise UsageError(f"{workers} workers x {self.threads} threads need {workers * self.threads} cores of their "
                             f"own; this machine has {cores} (a worker times on cores no other worker uses)")
        return max(workers * self.threads, cores)

    def _new_name(self) -> str:
        self._count += 1
        return f"w{self._count}"

    def _resources(self) -> dict[str, Any]:
        return {"num_gpus": 1, "num_cpus": 1} if self.device == "gpu" else {"num_cpus": self.threads}

    def _start(self, names: Sequence[str]) -> None:
        """Start workers (or lease kept ones) and wait until each has built its backend."""
        started = {name: self._kept_worker() if self.keep_s else (self._new_worker(name), None, False)
                   for name in names}
        for name in started:
            while True:
                handle, lease, reused = started[name]
                try:
                    where = self.ray.get(handle.describe.remote(), timeout=START_TIMEOUT_S)
                    if lease is None or self.ray.get(lease, timeout=START_TIMEOUT_S):
                        break
                except Exception as exc:
                    for h, _, _ in started.values():
                        self.ray.kill(h, no_restart=True)
                    raise BackendUnavailable(f"Ray worker {name} could not start: {_cause(exc)}") from None
                started[name] = self._kept_worker()  # another planner made and leased this one first
            self.reused += reused
            self.workers[name] = _Worker(name, handle, where["pid"], f"pid {where['pid']} on {where['host']}, "
                                         f"{where['device']}" + (", kept from an earlier search" if reused else ""),
                                         kept=lease is not None)
            self._note(f"{name}: {self.workers[name].where}", logging.INFO)

    def _new_worker(self, label: str, **placement: Any) -> Any:
        return self._actor.options(**self._resources(), **placement, max_restarts=0,
                                   max_task_retries=0).remote(label, *self._args, self._env)

    def _kept_worker(self) -> tuple[Any, Any, bool]:
        """A kept worker of this search's kind that no other planner holds, its lease, and whether an earlier
        search left it: an idle one an earlier search left (leased here), else a new one (detached, so that it
        outlives this search; its lease is answered once it has started)."""
        while True:
            self._slot += 1
            actor = f"{self._key}-{self._slot}"
            try:
                handle = self.ray.get_actor(actor, namespace=NAMESPACE)
            except ValueError:  # none of that name: a new one (or the one another planner made just now)
                handle = self._new_worker(actor, name=actor, namespace=NAMESPACE, lifetime="detached",
                                          get_if_exists=True)
                return handle, handle.lease.remote(self._token, START_TIMEOUT_S, self.keep_s), False
            lease = handle.lease.remote(self._token, START_TIMEOUT_S, self.keep_s)
            with contextlib.suppress(self.ray.exceptions.GetTimeoutError, self.ray.exceptions.RayActorError):
                if self.ray.get(lease, timeout=LEASE_WAIT_S):
                    return handle, lease, True
            log.info("kept worker %s is held by another search (or gone)", actor)

    def _retire_others(self, size: int) -> None:
        """Where the cluster lacks the free devices for ``size`` workers, end the idle kept workers of other
        kinds (another backend, thread count or planner version) that hold them."""
        kind = "GPU" if self.device == "gpu" else "CPU"
        need = size * (1 if self.device == "gpu" else self.threads)
        if self.ray.available_resources().get(kind, 0) >= need:
            return
        for actor in self.ray.util.list_named_actors(all_namespaces=True):
            if actor["namespace"] != NAMESPACE or actor["name"].startswith(self._key):
                continue
            try:
                handle = self.ray.get_actor(actor["name"], namespace=NAMESPACE)
                if self.ray.get(handle.retire.remote(), timeout=LEASE_WAIT_S):
                    self.ray.kill(handle, no_restart=True)
                    self._note(f"retired the idle kept worker {actor['name']} (another kind) for its "
                               f"{kind.lower()}s", logging.INFO)
            except (ValueError, self.ray.exceptions.GetTimeoutError, self.ray.exceptions.RayActorError):
                continue  # gone already, or busy with another search

    def pids(self) -> dict[str, int]:
        """Each live worker's process id (on its own host)."""
        return {name: w.pid for name, w in self.workers.items()}

    def close(self) -> None:
        """Kill the workers, or release the kept ones for the next search; leave a cluster joined, and end a local
        one this search started in the background (the next one waits for it, and so does the process's exit)."""
        kept = [w.handle.release.remote(self._token) for w in self.workers.values() if w.kept]
        for w in self.workers.values():
            if not w.kept:
                self.ray.kill(w.handle, no_restart=True)
        with contextlib.suppress(Exception):  # a worker that died meanwhile is not released, and needs not be
            self.ray.get(kept, timeout=LEASE_WAIT_S)
        self.workers.clear()
        if self.started_cluster and self.options.address:  # this process's connection: left at once
            self.ray.shutdown()
        elif self.started_cluster:
            _end_in_background(self.ray)
        self.started_cluster = False

    def _note(self, text: str, level: int = logging.WARNING) -> None:
        self.events.append(text)
        log.log(level, "%s", text)

    # -- the jobs
    def run(self, jobs: Sequence[RegionJob], budget: Budget, after: After | None = None) -> Iterator[RegionOutcome]:
        """Search every job on the workers; yields each outcome as it arrives (not in the jobs' order). ``after``
        takes each outcome and says what it completes and which jobs are now due (a region's parts: ``Parts``)."""
        queue: deque[tuple[RegionJob, int]] = deque((job, 0) for job in jobs)
        running: dict[Any, _Running] = {}
        idle = list(self.workers)
        while queue or running:
            while queue and idle:
                job, tries = queue.popleft()
                name = idle.pop(0)
                share = budget.share(len(self.workers))
                deadline = time.perf_counter() + share + self.options.grace_s
                if self.workers[name].kept:  # held while it searches, and as long as it may before taken for hung
                    self.workers[name].handle.lease.remote(self._token, share + self.options.grace_s + 60.0, self.keep_s)
                running[self.workers[name].handle.search.remote(job.with_budget(share))] = _Running(name, job, tries,
                                                                                                     deadline)
            if not running:
                raise SearchError(f"every Ray worker was lost, {len(queue)} region(s) left unsearched: "
                                  + "; ".join(self.events))
            next_deadline = min(r.deadline for r in running.values())
            ready, _ = self.ray.wait(list(running), num_returns=1,
                                     timeout=max(min(next_deadline - time.perf_counter(), 5.0), 0.01))
            for ref in ready:
                job_run = running.pop(ref)
                outcome = self._outcome(ref, job_run, queue)
                if outcome is None:
                    continue
                idle.append(job_run.worker)
                done, due = after(outcome) if after is not None else (outcome, [])
                queue.extendleft((job, 0) for job in reversed(due))  # a region's final first: it completes one
                if done is not None:
                    budget.done()
                    yield done
            now = time.perf_counter()
            for ref, job_run in [(ref, r) for ref, r in running.items() if r.deadline < now]:
                del running[ref]
                idle.append(self._replace_hung(job_run, queue))

    def _outcome(self, ref: Any, job_run: _Running, queue: deque[tuple[RegionJob, int]]) -> RegionOutcome | None:
        """The region's outcome; None where its worker died (the region re-queued). An error the search itself
        raised (no candidate verified, bad input) is raised here, as the serial search raises it."""
        try:
            outcome: RegionOutcome = self.ray.get(ref)
            outcome.worker = job_run.worker  # this search's name of it (a kept worker's actor name is its kind's)
            return outcome
        except self.ray.exceptions.RayTaskError as exc:
            raise exc.cause if isinstance(exc.cause, Exception) else exc from None
        except self.ray.exceptions.RayActorError as exc:
            self.workers.pop(job_run.worker, None)
            self.died += 1
            self._note(f"{job_run.worker} died searching {_what(job_run.job)} ({_cause(exc)}): re-queued, "
                       f"{len(self.workers)} of {self.size} workers left")
            self._requeue(job_run, queue)
            return None

    def _replace_hung(self, job_run: _Running, queue: deque[tuple[RegionJob, int]]) -> str:
        """Kill a worker whose region ran past its deadline, start another in its place; returns the new one."""
        hung = self.workers.pop(job_run.worker)
        self.ray.kill(hung.handle, no_restart=True)
        self.hung += 1
        name = self._new_name()
        self._note(f"{job_run.worker} hung searching {_what(job_run.job)} (past its budget + {self.options.grace_s:g}s "
                   f"grace): killed, {name} started in its place, re-queued")
        self._requeue(job_run, queue)
        self._start([name])
        return name

    def _requeue(self, job_run: _Running, queue: deque[tuple[RegionJob, int]]) -> None:
        tries = job_run.tries + 1
        if tries >= MAX_TRIES:
            raise SearchError(f"{_what(job_run.job)}: {tries} workers died or hung searching it; "
                              + "; ".join(self.events))
        queue.appendleft((job_run.job, tries))

    def summary(self) -> str:
        """Where the search ran and what befell the workers, once it is over."""
        lost = [f"{n} {what}" for n, what in ((self.died, "died"), (self.hung, "hung and replaced")) if n]
        tail = f" ({', '.join(lost)}); finished with {self.size - self.died}" if lost else ""
        return f"searched on {self.where}{tail}"

    @property
    def where(self) -> str:
        each = "one GPU each" if self.device == "gpu" else f"{self.threads} core{'s' * (self.threads > 1)} each"
        cluster = f"the Ray cluster at {self.options.address}" if self.options.address else "a local Ray cluster"
        return f"{self.size} workers ({each}) of {cluster}"


def _reachable(address: str, timeout_s: float = 10.0) -> None:
    """Refuse at once a ``host:port`` nothing answers on (Ray itself would retry for minutes); ``auto`` and other
    forms are Ray's to resolve."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise UsageError(f"cannot join the Ray cluster at {address}: {exc.strerror or exc}") from None


def _what(job: RegionJob) -> str:
    return job.title if job.stage == "whole" else f"{job.title} ({job.stage})"


def _cause(exc: BaseException) -> str:
    """What went wrong, in one line: a worker's own exception (the last line of Ray's report of a failed start),
    else the first line of Ray's message."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    return lines[-1] if "creation task" in lines[0] else lines[0]
