"""On-disk cache of chosen region plans.

Keyed by the region's structural hash, the device spec, the backend and the hash
of the rule set (and the cache format version).  Each entry carries a checksum of
its payload; an entry that does not parse, has another version or key, or fails
its checksum is reported and rebuilt, never trusted.  Entries are plan files (``planner.core.planfile``):
data only, checked on load; loading one executes nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from planner.core.cost import DeviceSpec
from planner.core.files import read_json, untrusted_dir
from planner.core.graph import Graph
from planner.core.planfile import PLAN_FORMAT, PlanFileError, plan_document, plan_from_document
from planner.core.plans import Plan

log = logging.getLogger(__name__)

CACHE_VERSION = 1


def default_cache_dir() -> Path:
    """``$FUSION_PLANNER_PLAN_CACHE``, else ``$XDG_CACHE_HOME/fusion-planner/plans``."""
    if os.environ.get("FUSION_PLANNER_PLAN_CACHE"):
        return Path(os.environ["FUSION_PLANNER_PLAN_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fusion-planner" / "plans"


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


class PlanCache:
    def __init__(self, root: str | Path | None = None, *, read: bool = True) -> None:
        """``read=False``: store fresh choices but never answer from the cache."""
        self.root = Path(root) if root else default_cache_dir()
        self.read = read
        self.rebuilt: list[str] = []  # keys of entries found corrupt or stale
        self._refused: str | None = None  # why the folder is not trusted ("" once checked and fine)

    @staticmethod
    def key(region_key: str, spec: DeviceSpec, backend: str, rules: str) -> str:
        return _digest([CACHE_VERSION, region_key, spec.to_json(), backend, rules])[:32]

    def path(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def load(self, key: str, region: Graph, spec: DeviceSpec) -> Plan | None:
        p = self.path(key)
        if not self.read or not p.exists() or not self._trusted():
            return None
        try:
            doc = read_json(p, PlanFileError, "plan cache entry")
            plan, _, cached_spec, meta = plan_from_document(doc, p.name, expect_graph=region)
            if meta.get("cache_key") != key or meta.get("cache_version") != CACHE_VERSION:
                raise PlanFileError("cache key or version mismatch")
            if cached_spec != spec:
                raise PlanFileError("device spec mismatch")
            return plan
        except (PlanFileError, ValueError, OSError) as exc:
            log.warning("plan cache entry %s is corrupt or stale (%s); rebuilding it", p.name, exc)
            self.rebuilt.append(key)
            return None

    def store(self, key: str, plan: Plan, region: Graph, spec: DeviceSpec) -> bool:
        """Keep a chosen plan; a cache that cannot be written (read-only, full, a file) only warns:
        the caller's result stands either way."""
        doc = plan_document(plan, region, spec, {"cache_key": key, "cache_version": CACHE_VERSION})
        tmp: str | None = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            # a unique temporary name per writer: two processes storing one key never share a file
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f"{key}.", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(doc))
            os.replace(tmp, self.path(key))
            return True
        except OSError as exc:
            log.warning("could not store the plan in the plan cache %s (%s); the result is kept, not cached",
                        self.root, exc.strerror or exc)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            return False

    def _trusted(self) -> bool:
        """Entries are trusted code paths' data (docs/security.md): a cache folder another user owns or
        may write to is not read from, with one warning."""
        if self._refused is None:
            self._refused = untrusted_dir(self.root)
            if self._refused:
                log.warning("not reading the plan cache %s: %s", self.root, self._refused)
        return not self._refused

    def entries(self) -> list[Path]:
        """The files this cache wrote: ``<32 hex>.json`` plan files whose meta carries that key, and
        leftover ``<32 hex>.<random>.tmp`` files of interrupted writes; regular files only, never symlinks."""
        if not self.root.is_dir():
            return []
        out = []
        for p in sorted(self.root.iterdir()):
            if p.is_symlink() or not p.is_file() or not _ENTRY_NAME.match(p.name):
                continue
            if p.suffix == ".tmp" or _is_entry(p):
                out.append(p)
        return out

    def clear(self, *, force: bool = False) -> int:
        """Remove this cache's own entries; the number removed.

        Anything else in the folder (another file, a folder, a symlink) is never touched, and
        unless ``force`` its presence refuses the whole clear with :class:`CacheClearRefused`.
        """
        if not self.root.exists():
            return 0
        if not self.root.is_dir():
            raise CacheClearRefused(f"{self.root} is not a folder; nothing removed")
        own = self.entries()
        foreign = sorted(set(self.root.iterdir()) - set(own))
        if foreign and not force:
            names = ", ".join(p.name for p in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise CacheClearRefused(
                f"{self.root} holds {len(foreign)} item(s) the plan cache did not write ({names}); nothing removed. "
                "Pass --force (force=True) to remove only the cache's own entries and leave the rest"
            )
        for p in own:
            p.unlink()
        return len(own)


class CacheClearRefused(ValueError):
    """``cache clear`` would have to touch files the plan cache did not write."""


_ENTRY_NAME = re.compile(r"^[0-9a-f]{32}(\.json|\.[A-Za-z0-9_]+\.tmp)$")


def _is_entry(p: Path) -> bool:
    """Is ``p`` a plan file written by this cache (its meta names the key in its file name)?"""
    try:
        doc = read_json(p, PlanFileError, "plan cache entry", limit=64 * 2**20)
    except PlanFileError:  # not a regular file, too large, not JSON: not one the cache wrote
        return False
    meta = doc.get("meta") if isinstance(doc, dict) else None
    return (
        isinstance(meta, dict)
        and doc.get("format") == PLAN_FORMAT
        and meta.get("cache_key") == p.stem
        and "cache_version" in meta
    )
