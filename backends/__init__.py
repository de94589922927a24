"""Backend registry: ``backends.get(name)``, ``backends.register(...)``, ``backends.available()``.

Third-party backends register through the entry-point group ``opgraph.backends`` (the entry
point names a Backend class or a zero-argument factory).

    >>> import backends
    >>> backends.get("numpy").name
    'numpy'
"""
from __future__ import annotations

from importlib import metadata
from typing import Callable, Union

from .base import Backend, BackendUnavailable

_FACTORIES: dict[str, Callable[[], Backend]] = {}
_INSTANCES: dict[str, Backend] = {}
_ENTRY_POINTS_LOADED = False


def register(name: str, factory: Union[Callable[[], Backend], Backend], *, replace: bool = False) -> None:
    """Register a backend class/factory (called lazily) or instance under ``name``."""
    if name in _FACTORIES and not replace:
        raise ValueError(f"backend {name!r} is already registered (pass replace=True)")
    _INSTANCES.pop(name, None)
    if isinstance(factory, Backend):
        inst = factory
        _FACTORIES[name] = lambda: inst
    else:
        _FACTORIES[name] = factory


def _load_entry_points() -> None:
    global _ENTRY_POINTS_LOADED
    if _ENTRY_POINTS_LOADED:
        return
    _ENTRY_POINTS_LOADED = True
    for ep in metadata.entry_points(group="opgraph.backends"):
        if ep.name not in _FACTORIES:
            _FACTORIES[ep.name] = lambda ep=ep: ep.load()()


def names() -> list[str]:
    """Every registered backend name, available or not."""
    _load_entry_points()
    return sorted(_FACTORIES)


def get(name: str) -> Backend:
    """The backend instance named ``name``; unknown or unavailable → BackendUnavailable with
    one clear line."""
    if name not in _INSTANCES:
        _load_entry_points()
        try:
            factory = _FACTORIES[name]
        except KeyError:
            raise BackendUnavailable(f"unknown backend {name!r} (registered: {', '.join(names())})") from None
        _INSTANCES[name] = factory()
    backend = _INSTANCES[name]
    ok, why = backend.availability()
    if not ok:
        raise BackendUnavailable(f"backend {name!r} is unavailable: {why}")
    return backend


def available() -> list[str]:
    """Names of the backends that can run here."""
    return [n for n, why in status().items() if why == "ok"]


def status() -> dict[str, str]:
    """``{name: "ok" or the reason it is unavailable}`` for every registered backend."""
    out = {}
    for n in names():
        try:
            get(n)
            out[n] = "ok"
        except BackendUnavailable as e:
            out[n] = str(e)
        except Exception as e:  # a broken third-party plugin must not break the listing
            out[n] = f"failed to load: {e}"
    return out


def _register_builtins() -> None:
    from .numpy_backend import NumpyBackend
    register("numpy", NumpyBackend)
    register("native", lambda: __import__("backends.native", fromlist=["_"]).NativeBackend())
    register("aclnn", lambda: __import__("backends.aclnn.runtime", fromlist=["_"]).AclnnBackend())
    register("ascend-sim", lambda: __import__("backends.ascend_sim", fromlist=["_"]).AscendSimBackend())


_register_builtins()

__all__ = ["Backend", "BackendUnavailable", "register", "get", "available", "status", "names"]
