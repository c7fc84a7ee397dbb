"""``fusion-planner``: a thin command line over the Python API.

Each subcommand lives in its own module with a ``register(subparsers)``
function; the registered handler returns an exit code.  Bad input (a known
error class) prints one line on stderr and exits 2, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import NoReturn

from planner.commands import cache, calibrate, check_rules, explain, plan, plot, run
from planner.commands.common import CliPlanning
from planner.core import limits
from planner.errors import USER_ERRORS, UsageError
from planner.registry import plugins

#: the planner's own subcommands, in --help order; each backend plugin adds its own after them
COMMAND_MODULES = (explain, plan, run, plot, cache, calibrate, check_rules)


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse exits 2 on usage errors; keep its message short
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="fusion-planner",
        description="Plan operator fusion with an e-graph and a three-ledger cost model.",
    )
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    p.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    for mod in COMMAND_MODULES:
        mod.register(sub)
    for backend in plugins().values():
        for added in backend.commands:
            added.register(sub, CliPlanning())
    for parser in sub.choices.values():  # every subcommand reads some input file
        limits.add_flags(parser)
    return p


def package_version() -> str:
    """The installed distribution's version (a checkout that was never installed says so)."""
    try:
        return metadata.version("fusion-planner")
    except metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def _allow_torch_ops(names: Sequence[str]) -> None:
    if not names:
        return
    try:
        from planner.torch.ops import allow_torch_ops
    except ImportError as exc:  # torch is optional
        raise UsageError(f"--allow-torch-op needs torch, which is not importable here ({exc})") from None
    allow_torch_ops(names)


def _quiet_openmp() -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` unless the user chose a policy, before torch can start its pool: its
    OpenMP workers otherwise spin after each call and take the cores a plan's own workers need (a plan with
    torch-backed kernels under ``run`` measured 24 ms against 0.76 ms).  The variable is read only when
    the pool starts, so it is set here, first thing, for every subcommand."""
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


#: ``FUSION_PLANNER_LOGS=+egglog``: egglog's own log (its whole program, a line per declaration) at -v; otherwise
#: only its warnings, so -v shows the planner's lines
LOGS_ENV = "FUSION_PLANNER_LOGS"


def _egglog_logging() -> None:
    switches = os.environ.get(LOGS_ENV, "").replace(",", " ").split()
    logging.getLogger("egglog").setLevel(logging.NOTSET if "+egglog" in switches else logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    _quiet_openmp()
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
        format="%(levelname)s %(name)s: %(message)s",
    )
    _egglog_logging()
    try:
        _allow_torch_ops(getattr(args, "allow_torch_op", None) or [])
        with limits.input_limits(limits.from_flags(args)):
            return int(args.handler(args) or 0)
    except USER_ERRORS as exc:
        print(f"fusion-planner {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into head & co.
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
