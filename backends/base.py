"""The backend protocol: run a graph with its inputs bound to user tensors.

    >>> class Echo(Backend):
    ...     name = "echo"
    ...     def run(self, graph, bindings, workspace=None):
    ...         print(len(graph.nodes))
    >>> Echo().availability()
    (True, '')
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from opgraph.ir import Graph
    from opgraph.tensor import Tensor


class BackendUnavailable(RuntimeError):
    """A backend is unknown or cannot run on this machine (one clear line says why)."""


class Backend:
    """Base class of backends. Subclasses set ``name`` and implement :meth:`run`.

    ``run`` executes every node of ``graph`` with graph input ``%name`` bound to
    ``bindings[name]`` (an :class:`opgraph.Tensor`); effects (ViewCopy) write user tensors.
    ``workspace`` is the caller's scratch buffer (bytes-like) or None.
    """

    name: str = "backend"

    def availability(self) -> tuple[bool, str]:
        """``(True, "")`` or ``(False, reason)``."""
        return True, ""

    def run(self, graph: "Graph", bindings: "Mapping[str, Tensor]", workspace: Any = None) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<backend {self.name}>"
