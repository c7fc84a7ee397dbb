"""Size limits on what the planner reads: input files, graphs and plan bodies (docs/security.md).

Each limit has a default, an environment variable that overrides it and a command-line flag
that overrides both (every subcommand has them).  They hold for one call: the CLI sets them
around its handler, a Python caller with :func:`input_limits`::

    with input_limits(InputLimits(graph_nodes=400_000)):
        graph = load_graph("huge.json")

Anything past a limit is refused with the error of the file kind, naming the file, the node
and the limit; nothing is truncated.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field, fields, replace

from planner.core.errors import UsageError


def _from_env(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise UsageError(f"${name} must be a positive integer, got {raw[:40]!r}") from None
    if value < 1:
        raise UsageError(f"${name} must be a positive integer, got {value}")
    return value


def _env_default(name: str, default: int) -> int:
    return field(default_factory=lambda: _from_env(name, default), metadata={"env": name, "default": default})


@dataclass(frozen=True)
class InputLimits:
    """What one input may hold; ``docs/security.md`` says what happens at each."""

    #: bytes in one input file (graph, plan, bundle, measured results, plan-cache entry)
    file_bytes: int = _env_default("FUSION_PLANNER_MAX_FILE_BYTES", 256 * 2**20)
    #: nodes in one graph; a 100,000-node graph file is ~20 MB
    graph_nodes: int = _env_default("FUSION_PLANNER_MAX_NODES", 200_000)
    #: dimensions of one tensor
    rank: int = _env_default("FUSION_PLANNER_MAX_RANK", 8)
    #: elements of one tensor: every tensor must fit in memory to be verified (2^28 fp32 is 1 GiB)
    elements: int = _env_default("FUSION_PLANNER_MAX_ELEMENTS", 2**28)
    #: levels of one kernel body in a plan file or bundle (a fused kernel holds at most
    #: ``--max-region-ops`` ops, so its body is never deeper than that)
    depth: int = _env_default("FUSION_PLANNER_MAX_DEPTH", 256)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"input limit {f.name} must be a positive integer, got {value!r}")


#: (attribute, flag, help) of each limit's command-line flag
FLAGS = (
    ("file_bytes", "--max-file-bytes", "bytes in one input file"),
    ("graph_nodes", "--max-graph-nodes", "nodes in one graph"),
    ("rank", "--max-rank", "dimensions of one tensor"),
    ("elements", "--max-elements", "elements of one tensor"),
    ("depth", "--max-depth", "levels of one kernel body in a plan file or bundle"),
)

_current: ContextVar[InputLimits | None] = ContextVar("input_limits", default=None)
_ENV_NAMES = tuple(f.metadata["env"] for f in fields(InputLimits))


def current() -> InputLimits:
    """The limits in force: those set by :func:`input_limits`, else the defaults with the environment as
    it is now (a changed variable counts; each graph node and plan body asks)."""
    held = _current.get()
    return held if held is not None else _defaults(tuple(os.environ.get(name) for name in _ENV_NAMES))


@functools.lru_cache(maxsize=8)
def _defaults(environment: tuple[str | None, ...]) -> InputLimits:
    """The defaults under ``environment`` (the variables' values: the cache key, read by the factories)."""
    return InputLimits()


@contextlib.contextmanager
def input_limits(limits: InputLimits) -> Iterator[InputLimits]:
    """Hold ``limits`` for what runs inside the block, in this thread (a pool's worker threads see the
    defaults: the planner reads no input file in one)."""
    token = _current.set(limits)
    try:
        yield limits
    finally:
        _current.reset(token)


def flag_of(attribute: str) -> str:
    """The command-line flag and environment variable that set a limit, for error messages."""
    env = next(f.metadata["env"] for f in fields(InputLimits) if f.name == attribute)
    flag = next(flag for name, flag, _ in FLAGS if name == attribute)
    return f"{flag} or ${env}"


def int_arg(least: int) -> Callable[[str], int]:
    """argparse type of an integer flag of at least ``least`` (a bad value exits 2 with argparse's usage)."""
    what = {0: "a non-negative integer", 1: "a positive integer"}.get(least, f"an integer of at least {least}")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text[:40]!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value

    return parse


#: argparse type of each limit's flag and of ``--threads``
positive_arg = int_arg(1)


def add_flags(p: argparse.ArgumentParser) -> None:
    """The flags of every limit, on a command that reads input files."""
    g = p.add_argument_group("input limits (docs/security.md; each defaults to its environment variable)")
    for f in fields(InputLimits):
        flag = next(flag for name, flag, _ in FLAGS if name == f.name)
        text = next(text for name, _, text in FLAGS if name == f.name)
        g.add_argument(flag, dest=f"limit_{f.name}", type=positive_arg, default=None, metavar="N",
                       help=f"{text} (default ${f.metadata['env']}, else {f.metadata['default']:,})")


def from_flags(args: argparse.Namespace) -> InputLimits:
    """The limits a command's flags give; an unset flag keeps the environment's or the default."""
    chosen = {f.name: getattr(args, f"limit_{f.name}", None) for f in fields(InputLimits)}
    return replace(InputLimits(), **{k: v for k, v in chosen.items() if v is not None})
