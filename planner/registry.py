"""The backend registry: each backend is a plugin, found through the ``planner.backends`` entry-point group.

``pyproject.toml`` registers the shipped backends there (reference, model, cpu, cupy, measured); a backend in
another distribution registers the same way, or at run time with :func:`register_backend`.  The planner asks
this registry for a backend by name and never imports one by its module path, so a machine without a C
compiler or a GPU still uses the others: a backend that cannot run here raises ``BackendUnavailable`` when
it is created or compiles.
"""

from __future__ import annotations

import logging
from importlib import metadata
from typing import Any

from planner.backend import Backend, BackendPlugin, BackendUnavailable
from planner.core.cost import DeviceSpec, load_device
from planner.core.errors import UsageError

log = logging.getLogger(__name__)

#: the entry-point group a backend plugin registers under; the entry point names a BackendPlugin object
ENTRY_POINT_GROUP = "planner.backends"

#: how an error names a keyword option of a backend
OPTION_WORDS = {"threads": "a thread count", "source": "a measured-results file"}

_discovered: dict[str, BackendPlugin] | None = None
_registered: dict[str, BackendPlugin] = {}


def _discover() -> dict[str, BackendPlugin]:
    """The plugins of the installed distributions' entry points, loaded once per process."""
    global _discovered
    if _discovered is None:
        found: dict[str, BackendPlugin] = {}
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            plugin = ep.load()
            if not isinstance(plugin, BackendPlugin) or plugin.name != ep.name:
                raise UsageError(f"entry point {ep.name!r} of group {ENTRY_POINT_GROUP} ({ep.value}) must name a "
                                 f"BackendPlugin called {ep.name!r}")
            found[ep.name] = plugin
        _discovered = found
    return _discovered


def rediscover() -> None:
    """Read the entry points again on next use (after installing a distribution into the running process)."""
    global _discovered
    _discovered = None


def register_backend(plugin: BackendPlugin, *, replace: bool = False) -> BackendPlugin:
    """Register a backend at run time (as an entry point does for an installed distribution)."""
    if plugin.name in plugins() and not replace:
        raise UsageError(f"a backend named {plugin.name!r} is already registered")
    _registered[plugin.name] = plugin
    return plugin


def unregister_backend(name: str) -> None:
    """Forget a backend registered at run time (entry-point backends stay)."""
    _registered.pop(name, None)


def plugins() -> dict[str, BackendPlugin]:
    """Every registered backend by name: the entry points', then the run-time registrations."""
    found = {**_discover(), **_registered}
    if not found:
        raise UsageError(f"no backend is registered under the {ENTRY_POINT_GROUP!r} entry points: install the "
                         "fusion-planner distribution (pip install -e . in a checkout)")
    return found


def plugin(name: str) -> BackendPlugin:
    try:
        return plugins()[name]
    except KeyError:
        raise UsageError(f"unknown backend {name!r}; choose one of {', '.join(backend_names())}") from None


def backend_names() -> list[str]:
    return list(plugins())


def get_backend(name: str, spec: DeviceSpec, **options: Any) -> Backend:
    """The backend ``name`` on ``spec``; ``options`` (``threads``, ``source``) only those it takes, None ones
    left out."""
    p = plugin(name)
    given = {k: v for k, v in options.items() if v is not None}
    for key in given.keys() - p.options:
        takers = [q.name for q in plugins().values() if key in q.options]
        raise UsageError(f"{OPTION_WORDS.get(key, key)} applies to the {', '.join(takers) or 'no'} backend, "
                         f"not {name!r}")
    try:
        return p.create(spec, **given)
    except ImportError as exc:
        raise BackendUnavailable(f"backend {name!r} is not available on this machine ({exc}); try 'reference'") from exc


def device_for(device: str | DeviceSpec | None, backend: str) -> DeviceSpec:
    """The device spec a search on ``backend`` is costed with: ``device`` (a spec, a built-in name or a spec file)
    when given, else the backend's own default (the cpu backend: this machine, calibrated once), else the
    planner's default."""
    if isinstance(device, DeviceSpec):
        return device
    if device is None:
        default = plugin(backend).default_device
        if default is not None:
            return default()
    return load_device(device)


def auto_backend() -> str:
    """The backend a caller that names none gets: the usable one of lowest ``auto_rank`` (cupy on a GPU
    machine, else the generated-C cpu backend, else the numpy reference)."""
    ranked = sorted((p for p in plugins().values() if p.auto_rank is not None), key=lambda p: p.auto_rank or 0)
    for p in ranked:
        if p.usable():
            return p.name
        log.debug("backend %s is not usable here", p.name)
    raise UsageError("no registered backend is usable on this machine")


__all__ = ["ENTRY_POINT_GROUP", "auto_backend", "backend_names", "get_backend", "plugin", "plugins", "rediscover",
           "register_backend", "unregister_backend"]
