"""On-disk cache of chosen region plans.

Keyed by the region's structural hash, the device spec, the backend and the hash
of the rule set (and the cache format version).  Each entry carries a checksum of
its payload; an entry that does not parse, has another version or key, or fails
its checksum is reported and rebuilt, never trusted.  Entries hold data only
(op names, attributes, shapes): loading one executes nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from planner.cost import DeviceSpec, KernelCost
from planner.egraph import RuleFile
from planner.graph import Graph
from planner.plans import Expr, Kernel, Plan, expr_from_json, expr_to_json

log = logging.getLogger(__name__)

CACHE_VERSION = 1


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fusion-planner" / "plans"


def rules_hash(rules: Sequence[RuleFile]) -> str:
    h = hashlib.sha256()
    for rf in rules:
        h.update(rf.text.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


class PlanCache:
    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root else default_cache_dir()
        self.rebuilt: list[str] = []  # keys of entries found corrupt or stale

    @staticmethod
    def key(region_key: str, spec: DeviceSpec, backend: str, rules: str) -> str:
        return _digest([CACHE_VERSION, region_key, spec.to_json(), backend, rules])[:32]

    def path(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def load(self, key: str, region: Graph) -> Plan | None:
        p = self.path(key)
        if not p.exists():
            return None
        try:
            data = json.loads(p.read_text())
            if data.get("version") != CACHE_VERSION or data.get("key") != key:
                raise ValueError("version or key mismatch")
            if data.get("checksum") != _digest(data["plan"]):
                raise ValueError("checksum mismatch")
            return plan_from_json(data["plan"], region)
        except (ValueError, KeyError, TypeError, OSError) as exc:
            log.warning("plan cache entry %s is corrupt or stale (%s); rebuilding it", p.name, exc)
            self.rebuilt.append(key)
            return None

    def store(self, key: str, plan: Plan) -> None:
        payload = plan_to_json(plan)
        data = {"version": CACHE_VERSION, "key": key, "plan": payload, "checksum": _digest(payload)}
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.path(key).with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(self.path(key))

    def clear(self) -> int:
        n = len(list(self.root.glob("*.json"))) if self.root.exists() else 0
        shutil.rmtree(self.root, ignore_errors=True)
        return n


def plan_to_json(plan: Plan) -> dict[str, Any]:
    return {
        "key": plan.key,
        "outputs": list(plan.outputs),
        "partition": list(plan.partition) if plan.partition is not None else None,
        "kernels": [
            {
                "kind": k.kind,
                "epilogue": k.epilogue,
                "out": k.out,
                "reads": list(k.reads),
                "body": expr_to_json(k.body),
                "cost": asdict(k.cost),
            }
            for k in plan.kernels
        ],
    }


def plan_from_json(data: dict[str, Any], graph: Graph) -> Plan:
    """Rebuild a plan for ``graph``; every tensor it names must be one of the graph's."""
    tensors = {n.id: n.type for n in graph.nodes}
    kernels = []
    for i, kd in enumerate(data["kernels"]):
        body = expr_from_json(kd["body"], f"kernel {i}")
        if not isinstance(body, Expr):
            raise ValueError(f"kernel {i}: body must be an op")
        for name in [kd["out"], *kd["reads"]]:
            if name not in tensors:
                raise ValueError(f"kernel {i} names tensor {name!r}, not in graph {graph.name!r}")
        kernels.append(
            Kernel(kd["kind"], body, kd["out"], tuple(kd["reads"]), KernelCost(**kd["cost"]), kd.get("epilogue"))
        )
    outputs = tuple(data["outputs"])
    if outputs != tuple(graph.outputs):
        raise ValueError("plan outputs do not match the graph's")
    part = data.get("partition")
    return Plan(graph.name, tuple(kernels), outputs, tensors, str(data["key"]), tuple(part) if part else None)
