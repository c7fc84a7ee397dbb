"""Running a compiler (the C compiler, nvcc) as a child process that can never hang the planner.

A compiler's driver starts children of its own (gcc runs cc1, as and ld; nvcc runs cicc and ptxas). Each
run here gets a process group of its own; on a timeout the whole group is killed and the pipes are closed,
never read again: a grandchild holding them must not keep the planner waiting."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Finished:
    returncode: int
    stdout: str
    stderr: str


class Running:
    """A compiler run started in its own process group; :meth:`finish` waits for it within a timeout."""

    def __init__(self, cmd: Sequence[str], what: str, error: type[Exception]) -> None:
        self.what, self.error = what, error
        try:
            self.proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                         start_new_session=True)
        except OSError as exc:
            raise error(f"{what} could not run: {exc}") from None

    def finish(self, timeout: float, hint: str = "") -> Finished:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise self.error(f"{self.what} did not finish within {timeout:g} s{hint}") from None
        return Finished(self.proc.returncode, out, err)

    def kill(self) -> None:
        """Kill the run's whole process group, close its pipes and reap it."""
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone already
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
        self.proc.wait()


def run(cmd: Sequence[str], timeout: float, what: str, error: type[Exception], hint: str = "") -> Finished:
    """Run ``cmd`` to its end, or kill its process group after ``timeout`` seconds (``error`` naming ``what``)."""
    return Running(cmd, what, error).finish(timeout, hint)
