"""The op_api protocol and registry: what opgraph knows about an op_api besides its compose
function — its parameters and their roles, the SoCs with its kernels, the dtypes it takes, how
to make random inputs, its float64 reference and the public aclnn API that runs it whole.

Op_apis register themselves when their module is imported (``opgraph.aclnn`` imports the
built-in ones); modules named by the entry-point group ``opgraph.op_apis`` are imported by
:func:`load_entry_points`.

    >>> spec = OpApiSpec("aclnnDemo", params=(Param("x", "tensor", "input"),
    ...                                       Param("out", "tensor", "output")))
    >>> [p.name for p in spec.tensor_params("output")], spec.aclnn_api
    (['out'], 'aclnnDemo')
"""
from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable, Literal, Mapping, Optional

import numpy as np

from .dtypes import DataType
from .platform import PRESETS, Platform

GROUP = "opgraph.op_apis"
Arrays = dict[str, Any]  # parameter name -> numpy array, Python scalar / bool, or None (NULL)


@dataclass(frozen=True)
class Param:
    """One parameter of the C prototype (workspaceSize/executor excluded).

    ``kind``: tensor, or the C type of a scalar: double / float / int (int64_t) / bool. ``role``: input, output (written by phase 2), inout
    (read and updated in place, e.g. running statistics) or attr (a scalar or mask).
    ``optional``: the tensor may be NULL (None)."""

    name: str
    kind: Literal["tensor", "double", "float", "int", "bool"]
    role: Literal["input", "output", "inout", "attr"]
    optional: bool = False


@dataclass(frozen=True)
class Option:
    """An op-specific knob of the input generator, also a CLI option (``--no-weight``).

    ``type``: ``flag`` (bool, default False), ``dtype``, ``float`` or ``int``."""

    name: str
    type: Literal["flag", "dtype", "float", "int"]
    default: Any = None
    help: str = ""

    @property
    def flag(self) -> str:
        """The CLI spelling: ``no_weight`` → ``--no-weight``."""
        return "--" + self.name.replace("_", "-")


@dataclass(frozen=True)
class InputConfig:
    """What :attr:`OpApiSpec.make_inputs` builds inputs for: the data shape, the data dtype and
    the op's own options (by :class:`Option` name)."""

    shape: tuple[int, ...]
    dtype: DataType
    options: Mapping[str, Any] = field(default_factory=dict)

    def option(self, name: str) -> Any:
        """The value of the op's option ``name`` (KeyError when the config does not set it)."""
        return self.options[name]


def _no_reference(arrays: Arrays) -> dict[str, np.ndarray]:
    return {}


def _full_size_bytes(spec: "OpApiSpec", cfg: InputConfig) -> int:
    """An upper bound: every tensor parameter full-size, in the data dtype (≥ 4 bytes)."""
    numel = 1
    for n in cfg.shape:
        numel *= n
    return numel * max(cfg.dtype.itemsize, 4) * len(spec.tensor_params())


@dataclass(frozen=True)
class OpApiSpec:
    """A registered op_api.

    ``get_workspace_size`` / ``run``: the two phases. ``platforms``: SoCs with its kernels.
    ``dtypes(platform)``: the data dtypes it accepts there. ``make_inputs(cfg, rng)``: random
    valid arguments by parameter name (None: the op_api cannot be run from the CLI or the kit). ``reference(arrays)``: its outputs computed in float64 on
    the same (already rounded) inputs, by parameter name. ``options``: op-specific generator
    options. ``formats(cfg)``: the format tag of each generated tensor that is not ND (e.g. an
    NCHW-tagged x). ``input_bytes(cfg)``: what ``make_inputs`` allocates (default: an upper bound), so
    the CLI can refuse a shape before allocating. ``rank``: (min, max) rank of the data tensor. ``aclnn_api``: the public aclnn API
    that runs the whole op with these arguments (how the aclnn backend lowers its fused form;
    None if there is none); ``aclnn_header``: its header under ``aclnnop/`` (default: the API's
    name in snake case). ``in_place``: element-wise, so an output may be the very view of an
    input (each element read before it is written) and keep its optimised program."""

    name: str
    params: tuple[Param, ...]
    get_workspace_size: Callable[..., Any] = None  # type: ignore[assignment]
    run: Callable[..., Any] = None  # type: ignore[assignment]
    platforms: tuple[str, ...] = tuple(PRESETS)
    dtypes: Callable[[Platform], tuple[DataType, ...]] = lambda p: (DataType.FLOAT,)
    make_inputs: Optional[Callable[[InputConfig, np.random.Generator], Arrays]] = None
    reference: Callable[[Arrays], dict[str, np.ndarray]] = _no_reference
    options: tuple[Option, ...] = ()
    input_bytes: Optional[Callable[[InputConfig], int]] = None
    formats: Callable[[InputConfig], Mapping[str, str]] = lambda cfg: {}
    rank: tuple[int, int] = (1, 8)
    default_shape: tuple[int, ...] = (2, 3, 1, 4)
    aclnn_api: Optional[str] = ""
    aclnn_header: str = ""
    summary: str = ""
    in_place: bool = False

    def __post_init__(self) -> None:
        unknown = [soc for soc in self.platforms if soc not in PRESETS]
        if unknown or not self.platforms:
            raise ValueError(f"op_api {self.name}: platforms {list(self.platforms)}: "
                             f"{'unknown ' + ', '.join(map(repr, unknown)) if unknown else 'none'} "
                             f"(the presets: {', '.join(PRESETS)})")
        if not 0 <= self.rank[0] <= self.rank[1]:
            raise ValueError(f"op_api {self.name}: rank {self.rank} is not (min, max) with "
                             "0 <= min <= max")
        if self.aclnn_api == "":
            object.__setattr__(self, "aclnn_api", self.name)
        if not self.aclnn_header and self.aclnn_api:  # aclnnBatchNormStats -> aclnn_batch_norm_stats.h
            snake = re.sub(r"(?<!^)(?=[A-Z])", "_", self.aclnn_api.removeprefix("aclnn")).lower()
            object.__setattr__(self, "aclnn_header", f"aclnn_{snake}.h")

    def param(self, name: str) -> Param:
        """The parameter called ``name`` (StopIteration when the op_api has none)."""
        return next(p for p in self.params if p.name == name)

    def tensor_params(self, *roles: str) -> list[Param]:
        """Tensor parameters with one of ``roles`` (all tensors when none are given)."""
        return [p for p in self.params if p.kind == "tensor" and (not roles or p.role in roles)]

    def bytes_for(self, cfg: InputConfig) -> int:
        """Bytes :attr:`make_inputs` would allocate for ``cfg`` (computed, not allocated)."""
        return self.input_bytes(cfg) if self.input_bytes is not None else _full_size_bytes(self, cfg)

    def supports(self, platform: Platform) -> bool:
        """True when ``platform``'s SoC is one of :attr:`platforms` (the op_api has kernels there)."""
        return platform.soc in self.platforms

    def args_of(self, arrays: Arrays, wrap: Callable[[Any, str], Any], cfg: InputConfig) -> list[Any]:
        """Phase-1 arguments in prototype order from ``arrays``: tensors through
        ``wrap(array, format)`` with the formats of ``cfg``, scalars and None as they are."""
        fmts = self.formats(cfg)
        return [wrap(arrays[p.name], fmts.get(p.name, "ND"))
                if p.kind == "tensor" and arrays.get(p.name) is not None
                else arrays.get(p.name) for p in self.params]


_REGISTRY: dict[str, OpApiSpec] = {}
_ENTRY_POINTS_LOADED = False


def register_op_api(spec: OpApiSpec, *, replace: bool = False) -> OpApiSpec:
    """Add ``spec`` to the registry; a second op_api of the same name needs ``replace``."""
    if spec.name in _REGISTRY and not replace:
        raise ValueError(f"op_api {spec.name!r} is already registered (pass replace=True)")
    _REGISTRY[spec.name] = spec
    return spec


@dataclass(frozen=True)
class EntryPointLoad:
    """One ``opgraph.op_apis`` entry point imported by :func:`load_entry_points`: its ``name``,
    ``module`` and, when importing it failed, the exception (``error``; the plugin is skipped)."""

    name: str
    module: str
    error: Optional[Exception] = None

    @property
    def failure(self) -> str:
        """What went wrong, in one line ("" when it imported)."""
        if self.error is None:
            return ""
        why = " ".join(f"{type(self.error).__name__}: {self.error}".split())
        return f"the op_api entry point {self.name!r} ({self.module}) failed to import, skipped: {why}"


def load_entry_points() -> list[EntryPointLoad]:
    """Import the modules of the ``opgraph.op_apis`` entry points (the first call; later calls
    return []). A plugin that fails to import is skipped, its exception returned: one broken
    package must not break every other op_api."""
    global _ENTRY_POINTS_LOADED
    loaded = []
    if not _ENTRY_POINTS_LOADED:
        _ENTRY_POINTS_LOADED = True
        for ep in metadata.entry_points(group=GROUP):
            try:
                ep.load()
            except Exception as e:  # (not KeyboardInterrupt and the like)
                loaded.append(EntryPointLoad(ep.name, ep.module, e))
            else:
                loaded.append(EntryPointLoad(ep.name, ep.module))
    return loaded


def load_module(name: str) -> None:
    """Import a user module that registers op_apis (``opgraph --load MODULE``)."""
    importlib.import_module(name)


def get_op_api(name: str) -> OpApiSpec:
    """The op_api registered as ``name``; KeyError names the registered ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown op_api {name!r} (registered: {', '.join(sorted(_REGISTRY))})") from None


def op_api_specs() -> dict[str, OpApiSpec]:
    """Every registered op_api by name."""
    return dict(_REGISTRY)


def op_apis() -> list[str]:
    """Names of every registered op_api (built-in and user), sorted."""
    return sorted(_REGISTRY)
