"""The backend protocol, lowering tables and the backend registry.

A backend compiles a planned graph once and returns an :class:`Executable`; phase 2 runs that
executable on the user's tensors and the caller's workspace (the arena the memory plan lays out):

    >>> class Echo(Backend):
    ...     name = "echo"
    ...     def compile(self, graph, memory_plan, platform):
    ...         return Echo.Run()
    ...     class Run(Executable):
    ...         def run(self, bindings, workspace=None):
    ...             print(sorted(bindings))
    >>> register("echo", Echo)
    >>> get("echo").compile(None, None, None).run({"x": 1})
    ['x']

Built-in and third-party backends are found the same way: entry points of the group
``opgraph.backends`` naming a Backend class or a zero-argument factory.
"""
from __future__ import annotations

from importlib import metadata
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, Union

from .ir import Graph, Node
from .memory import MemoryPlan, plan_memory
from .platform import Platform, get_platform
from .tensor import Tensor

GROUP = "opgraph.backends"
# The built-in backends, by the same entry-point mechanism third-party ones use (pyproject.toml
# declares the same entries; these keep a source checkout that is not installed working).
BUILTIN = {
    "numpy": "backends.numpy_backend:NumpyBackend",
    "native": "backends.native:NativeBackend",
    "ascend-sim": "backends.ascend_sim:AscendSimBackend",
    "aclnn": "backends.aclnn.runtime:AclnnBackend",
}


class BackendUnavailable(RuntimeError):
    """A backend is unknown or cannot run on this machine (one clear line says why)."""


class Addressed(Protocol):
    """What :meth:`Executable.run_direct` reads of a bound tensor: its first element's address
    and a numpy view of its elements (an :class:`opgraph.Tensor` is one; so is a caller's light
    wrapper of another library's tensor of the recorded layout)."""

    @property
    def data_address(self) -> int:
        """The address of the first element (the view's offset included), as an int."""

    def view(self) -> Any:
        """A numpy array over the elements, in the recorded shape and strides (writes reach them)."""


def data_addresses(bindings: Mapping[str, Addressed], names: Sequence[str]) -> list[int]:
    """The ``data_address`` of each named binding: ``bindings.data_addresses(names)`` when the
    mapping offers one (a direct call's bindings read the addresses straight off its arguments,
    with no binding object made per name), else binding by binding.

        >>> import numpy as np, opgraph
        >>> t = opgraph.tensor(np.zeros(3, np.float32))
        >>> data_addresses({"x": t}, ["x"]) == [t.data_address]
        True
    """
    fast = getattr(bindings, "data_addresses", None)
    if fast is not None:
        return fast(names)
    return [bindings[n].data_address for n in names]


class Executable:
    """A graph compiled by a backend. :meth:`run` binds graph input ``%name`` to
    ``bindings[name]`` (an :class:`opgraph.Tensor`), uses ``workspace`` (a writable buffer of at
    least the memory plan's size, or None when it is 0) as the arena for intermediates, and
    writes the user tensors the graph writes.

    ``quiet`` is True when :meth:`run` keeps numpy's floating-point warnings off itself
    (``np.errstate``, only where it runs numpy); otherwise phase 2 wraps the run in it."""

    quiet = False
    # True when :meth:`run_direct` runs this program although its memory plan has a workspace
    # (it does without the arena: native's 950 gather casts its counts itself)
    direct_without_workspace = False

    def run(self, bindings: Mapping[str, Tensor], workspace: Any = None) -> Any:
        """Run the program once on ``bindings`` and ``workspace``, as the class describes; what it
        returns is the backend's (the numpy family: the graph outputs by value name)."""
        raise NotImplementedError

    def run_direct(self, bindings: Mapping[str, Addressed]) -> bool:
        """:meth:`run` without a workspace, reading of each binding only its ``data_address``
        and ``view()``, for a caller that has checked everything else phase 1 checks (the
        bindings have the layouts the program was compiled for, the outputs are writable and
        share no memory with another tensor); True when it ran, False when nothing ran (the
        program needs a workspace, or the backend does not run so: the default). The numpy
        family runs any program without a workspace so; native runs its one-kernel programs
        straight from the addresses."""
        return False

    def run_repeatable(self, bindings: Mapping[str, Tensor], workspace: Any = None) -> Any:
        """:meth:`run`, for a caller that runs the program again and again in one workspace (a
        captured program's replay), on the same tensors or new ones of the same layouts: a
        backend may prepare once for them and keep them (the native backend binds its kernels'
        pointers). The default runs."""
        return self.run(bindings, workspace)

    def release(self, bindings: Mapping[str, Tensor]) -> None:
        """Forget ``bindings`` if :meth:`run_repeatable` kept them (their tensors, prepared
        state); the default keeps nothing."""

    def resized(self, graph: Graph, memory_plan: MemoryPlan) -> "Executable | None":
        """This executable for ``graph`` — the graph it was compiled from at other sizes: the
        same nodes, value names and ops in the same order, as
        :class:`opgraph.core.resize.Resizer` builds it — with ``memory_plan``; or None (the
        default), and the backend compiles ``graph`` afresh. Shares what does not depend on
        sizes (the lowering of each node, which values die where)."""
        return None


class Backend:
    """Base class of backends: set ``name``, implement :meth:`compile`."""

    name: str = "backend"

    def availability(self) -> tuple[bool, str]:
        """``(True, "")`` or ``(False, reason)``."""
        return True, ""

    def compile(self, graph: Graph, memory_plan: MemoryPlan, platform: Platform) -> Executable:
        """An :class:`Executable` of ``graph`` (already optimised) for ``platform``, its
        intermediates laid out by ``memory_plan``; called once per program, through
        :meth:`compile_checked`."""
        raise NotImplementedError

    def compile_checked(self, graph: Graph, memory_plan: MemoryPlan, platform: Platform) -> Executable:
        """:meth:`compile`, checked: what opgraph calls. A plugin whose compile returns
        anything but an :class:`Executable` is named here (TypeError), not at its first run."""
        built = self.compile(graph, memory_plan, platform)
        if not isinstance(built, Executable):
            raise TypeError(f"backend {self.name!r}: compile() returned {type(built).__name__}, "
                            "not an opgraph.core.backend.Executable")
        return built

    def run(self, graph: Graph, bindings: Mapping[str, Tensor], workspace: Any = None) -> Any:
        """Compile and run once (for ad-hoc graphs): plans memory, allocates the arena if
        ``workspace`` is None, runs on the current platform; returns what the executable's run
        returns (the numpy-family backends: the graph outputs by value name)."""
        plan = plan_memory(graph)
        if workspace is None and plan.size:
            workspace = bytearray(plan.size)
        return self.compile_checked(graph, plan, get_platform()).run(bindings, workspace)

    def __repr__(self) -> str:
        return f"<backend {self.name}>"


Lowering = Callable[..., Any]


class LoweringTable:
    """Per-backend lowering: l0 op name → function. Tables extend one another (native = numpy's
    table plus FusedElementwise); ``fallback(node)`` covers ops with no entry, or None.

    >>> base = LoweringTable({"Cast": "cast-fn"}, fallback=lambda node: "generic")
    >>> derived = base.extend({"Fill": "fill-fn"})
    >>> derived.lookup("Cast"), derived.lookup("Fill"), derived.lookup("Mul")
    ('cast-fn', 'fill-fn', 'generic')
    """

    def __init__(self, entries: Optional[Mapping[str, Lowering]] = None, *,
                 fallback: Optional[Callable[[str], Lowering]] = None):
        self.entries: dict[str, Lowering] = dict(entries or {})
        self.fallback = fallback

    def register(self, op: str, fn: Optional[Lowering] = None) -> Any:
        """``table.register("Op", fn)`` or ``@table.register("Op")``."""
        if fn is None:
            return lambda f: self.register(op, f)
        self.entries[op] = fn
        return fn

    def extend(self, entries: Mapping[str, Lowering]) -> "LoweringTable":
        """A new table: these entries plus ``entries`` (``entries`` win), with the same fallback;
        this table is not changed."""
        return LoweringTable({**self.entries, **entries}, fallback=self.fallback)

    def lookup(self, op: str) -> Optional[Lowering]:
        """The lowering of ``op``: its entry, else the fallback's, else None."""
        fn = self.entries.get(op)
        if fn is None and self.fallback is not None:
            fn = self.fallback(op)
        return fn

    def lower(self, node: Node) -> Lowering:
        """:meth:`lookup` for a node; a missing lowering raises quoting the node's dump line."""
        fn = self.lookup(node.op)
        if fn is None:
            raise NotImplementedError(f"no lowering for {node.op}: {node.header()}")
        return fn


# --- the registry ---------------------------------------------------------------------------
Factory = Callable[[], Backend]
_FACTORIES: dict[str, Factory] = {}
_INSTANCES: dict[str, Backend] = {}
_DISCOVERED = False


def register(name: str, factory: Union[Factory, Backend], *, replace: bool = False) -> None:
    """Register a backend class / zero-argument factory (called on first use) or an instance.
    The built-in and installed backends count as registered whether or not they were looked up
    yet: replacing one needs ``replace``."""
    _discover()
    if name in _FACTORIES and not replace:
        raise ValueError(f"backend {name!r} is already registered (pass replace=True)")
    if isinstance(factory, Backend):
        inst = factory
        factory = lambda: inst  # noqa: E731
    elif not callable(factory):
        raise TypeError(f"backend {name!r}: the factory must be a Backend instance, a Backend "
                        f"class or a zero-argument callable, got {type(factory).__name__}")
    _INSTANCES.pop(name, None)
    _FACTORIES[name] = factory


def _entry_point_factory(ep: metadata.EntryPoint) -> Factory:
    return lambda: ep.load()()


def _discover() -> None:
    """Built-in and entry-point backends, registered once (explicit registrations win)."""
    global _DISCOVERED
    if _DISCOVERED:
        return
    _DISCOVERED = True
    eps = {name: metadata.EntryPoint(name, value, GROUP) for name, value in BUILTIN.items()}
    eps.update({ep.name: ep for ep in metadata.entry_points(group=GROUP)})
    for name, ep in eps.items():
        _FACTORIES.setdefault(name, _entry_point_factory(ep))


def names() -> list[str]:
    """Every registered backend name, available or not."""
    _discover()
    return sorted(_FACTORIES)


def get(name: Union[str, Backend]) -> Backend:
    """The backend named ``name`` (or ``name`` itself when it is a Backend); unknown or
    unavailable → BackendUnavailable with one clear line."""
    if isinstance(name, Backend):
        backend = name
    else:
        if name not in _INSTANCES:
            _discover()
            try:
                factory = _FACTORIES[name]
            except KeyError:
                raise BackendUnavailable(
                    f"unknown backend {name!r} (registered: {', '.join(names())})") from None
            try:
                inst = factory()
            except Exception as e:  # a plugin that does not import or construct: named
                raise BackendUnavailable(f"backend {name!r} failed to load: "
                                         f"{type(e).__name__}: {e}") from e
            if not isinstance(inst, Backend):
                raise BackendUnavailable(f"backend {name!r}: its factory returned "
                                         f"{type(inst).__name__}, not a Backend")
            _INSTANCES[name] = inst
        backend = _INSTANCES[name]
    try:
        ok, why = backend.availability()
    except Exception as e:  # its probe failed: unavailable, named
        ok, why = False, f"its availability() raised {type(e).__name__}: {e}"
    if not ok:
        raise BackendUnavailable(f"backend {backend.name!r} is unavailable: {why}")
    return backend


def made(ref: Union[str, Backend]) -> Optional[Backend]:
    """The instance ``ref`` names if it has been made (``ref`` itself if it is a Backend), with
    no availability check; None otherwise. Phase 2 uses it to find an executable it built
    before (a backend that compiled a program can run it)."""
    return ref if isinstance(ref, Backend) else _INSTANCES.get(ref)


def status() -> dict[str, str]:
    """``{name: "ok" or the reason it is unavailable}`` for every registered backend."""
    out = {}
    for n in names():
        try:
            get(n)
            out[n] = "ok"
        except BackendUnavailable as e:
            out[n] = str(e)
    return out


def available() -> list[str]:
    """Names of the backends that can run here."""
    return [n for n, why in status().items() if why == "ok"]
