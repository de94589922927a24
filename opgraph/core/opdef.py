"""The l0 op protocol and registry: one :class:`OpDef` per op holds everything opgraph knows
about it — attributes, type inference, effects, when it is free, its numpy semantics, its
expansion into elementwise primitives (which makes it fusable), op-specific rewrite rules and
the fidelity of its numerics.

    >>> class ScaleAttrs(OpAttrs):
    ...     factor: float
    >>> Scale = register(OpDef("DocScale", ScaleAttrs, infer=lambda ts, a: [ts[0].with_()],
    ...                        compute=lambda xs, a: [xs[0] * xs[0].dtype.type(a.factor)]))
    >>> get_op("DocScale") is Scale, Scale.kind
    (True, 'elementwise')

Calling an OpDef records a node: ``y = Scale(executor, x, factor=2.0)``. Library and user ops are
normally defined with :func:`l0ops.define_op`, which also derives the numpy semantics of an op
defined by its expansion.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Literal, Optional, Sequence

from pydantic import BaseModel, BeforeValidator, ConfigDict, PlainSerializer, ValidationError

from .dtypes import DataType, dtype_of
from .rules import Rule
from .types import TensorType

Node = Any  # an opgraph.core.ir.Node (ir imports this module, so it is not imported here)


class L0Error(ValueError):
    """An l0 builder rejected its inputs (CANN's l0 APIs return nullptr here)."""


class OpAttrs(BaseModel):
    """Base of every op's attribute model: frozen, no unknown fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @property
    def exact(self) -> tuple:
        """A key equal only for attributes that compute the same bits (:func:`exact_key`):
        ``==`` takes ``-0.0`` for ``0.0``, which a division or a sign tells apart."""
        return exact_key(self)


def exact_key(value: Any) -> Any:
    """``value`` as a hashable key that tells apart what ``==`` identifies: a float by its sign
    too (-0.0 is not 0.0), numbers by their type; tuples, lists and attribute models item by
    item. NaNs stay unequal to everything, as they are.

    >>> exact_key(-0.0) == exact_key(0.0), exact_key((1, 2.0)) == exact_key((1, 2.0))
    (False, True)
    """
    if isinstance(value, float):
        return (float, value, math.copysign(1.0, value))
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(exact_key(v) for v in value))
    if isinstance(value, BaseModel):
        return (type(value), tuple((k, exact_key(v)) for k, v in value.__dict__.items()))
    return (type(value), value)


# A DataType attribute: accepts DataType, numbers or names; serialises as the enum name.
DType = Annotated[DataType, BeforeValidator(lambda v: dtype_of(v) if isinstance(v, str) else v),
                  PlainSerializer(lambda d: d.name, return_type=str)]

InferFn = Callable[[list, Any], list]                   # (input TensorTypes, attrs) -> output types
ComputeFn = Callable[[list, Any], list]                 # (input arrays, attrs) -> output arrays
Emit = Callable[..., str]                               # emit(op, args, dtype, shape=, value=) -> reg
ExpandFn = Callable[[Emit, list, Any, list], str]       # (emit, arg regs, attrs, in types) -> reg

KINDS = ("elementwise", "movement", "view", "reduce", "copy", "source", "kernel")


@dataclass(frozen=True)
class Fidelity:
    """How faithful an op's numpy semantics are to the NPU kernel on some archs.

    ``kind``: ``bit-faithful`` (follows public kernel source, or exact IEEE semantics),
    ``formula`` (no public source: the documented formula in float32, in a stated order) or
    ``no arithmetic`` (views, copies, fills). ``archs`` limits it to NpuArch numbers (empty: all).

    >>> str(Fidelity("formula", "no public 910B source", (2201,)))
    'DAV_2201: formula: no public 910B source'
    """

    kind: Literal["bit-faithful", "formula", "no arithmetic"]
    source: str
    archs: tuple[int, ...] = ()

    def __str__(self) -> str:
        where = "/".join(f"DAV_{a}" for a in self.archs)
        return (f"{where}: " if where else "") + f"{self.kind}: {self.source}"


@dataclass(frozen=True)
class OpDef:
    """Everything opgraph knows about an l0 op.

    ``kind``: elementwise / movement / view / reduce / copy / source / kernel (fused kernels).
    ``writes``: operand indices the op writes in place (ViewCopy's destination), or
    ``writes_fn(node)`` when that depends on attrs; such nodes are effects that DCE and CSE never
    drop or merge. ``expandable(node)`` limits ``expand`` to some calls. ``free(node)``: True when CANN launches no kernel for the node. ``redirect(node)``: True
    when the node copies operand 0 into its written operand by having operand 0's producer write
    there directly (ViewCopy into a contiguous user tensor). ``expand``: the
    op as elementwise primitives (makes it fusable). ``format_body``: extra dump lines for attrs
    holding a body (fused kernels). ``rewrites``: bit-exact rules the level-2 pipeline applies;
    ``fast_math``: opt-in rules that change bits.
    """

    name: str
    attrs: type[OpAttrs]
    infer: InferFn
    compute: ComputeFn
    kind: str = "elementwise"
    num_inputs: Optional[int] = None
    writes: tuple[int, ...] = ()
    writes_fn: Optional[Callable[[Node], Sequence[int]]] = None
    free: Optional[Callable[[Node], bool]] = None
    redirect: Optional[Callable[[Node], bool]] = None
    expand: Optional[ExpandFn] = None
    expandable: Optional[Callable[[Node], bool]] = None
    format_body: Optional[Callable[[Any], list[str]]] = None
    rewrites: tuple[Rule, ...] = ()
    fast_math: tuple[Rule, ...] = ()
    fidelity: tuple[Fidelity, ...] = ()
    doc: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"op {self.name}: kind must be one of {KINDS}, got {self.kind!r}")

    def make_attrs(self, **kwargs: Any) -> OpAttrs:
        """Validated attrs; frozen, so equal arguments share one instance (memoised)."""
        try:
            key = (self.name, tuple(sorted((k, exact_key(v)) for k, v in kwargs.items())))
            hit = _ATTRS_CACHE.get(key)
        except TypeError:  # unhashable attribute values: validate every time
            key = hit = None
        if hit is not None:
            return hit
        try:
            attrs = self.attrs(**kwargs)
        except ValidationError as e:
            raise self._invalid(e) from None
        if key is not None:
            if len(_ATTRS_CACHE) > 8192:
                _ATTRS_CACHE.clear()
            _ATTRS_CACHE[key] = attrs
        return attrs

    def attrs_from_json(self, text: "str | bytes") -> OpAttrs:
        """Attrs from a JSON object, strictly: each value must already have its field's type
        (an int passes for a float), so ``"false"`` is no bool and ``["0"]`` no axes.

        >>> class FactorAttrs(OpAttrs):
        ...     factor: float
        >>> OpDef("DocFactor", FactorAttrs, None, None).attrs_from_json('{"factor": 2}').factor
        2.0
        """
        try:
            return self.attrs.model_validate_json(text, strict=True)
        except ValidationError as e:
            raise self._invalid(e) from None

    def _invalid(self, e: ValidationError) -> L0Error:
        msgs = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'attrs'}: {err['msg']}"
                         + (f" (got {err['input']!r:.60})" if err["type"].endswith("_type") else "")
                         for err in e.errors())
        return L0Error(f"{self.name}: invalid attributes: {msgs}")

    def infer_types(self, types: Sequence[TensorType], attrs: OpAttrs) -> list[TensorType]:
        """The output types of a call on operands of ``types`` with ``attrs``; L0Error when the
        operand count is not :attr:`num_inputs`, and whatever the op's own check raises."""
        if self.num_inputs is not None and len(types) != self.num_inputs:
            raise L0Error(f"{self.name} takes {self.num_inputs} inputs, got {len(types)}")
        return list(self.infer(list(types), attrs))

    def is_free(self, node: Node) -> bool:
        """True when CANN launches no kernel for this node (an identity or a pure view)."""
        return bool(self.free(node)) if self.free is not None else False

    def redirects(self, node: Node) -> bool:
        """True when operand 0 is produced straight into the written operand (no copy runs)."""
        return bool(self.redirect(node)) if self.redirect is not None else False

    def written(self, node: Node) -> tuple[int, ...]:
        """Operand indices ``node`` writes in place."""
        return tuple(self.writes_fn(node)) if self.writes_fn is not None else self.writes

    @property
    def has_effects(self) -> bool:
        """True when the op writes an operand in place (a user tensor), so it is never swept as dead."""
        return bool(self.writes) or self.writes_fn is not None

    def can_expand(self, node: Node) -> bool:
        """True when ``node`` can be written as primitives (``expand``, if ``expandable``)."""
        return self.expand is not None and (self.expandable is None or bool(self.expandable(node)))

    def fidelity_for(self, arch: Optional[int] = None) -> list[Fidelity]:
        """The fidelity statements that apply on NpuArch ``arch`` (all of them for None)."""
        return [f for f in self.fidelity if arch is None or not f.archs or arch in f.archs]

    def __call__(self, ex: Any, *inputs: Any, **attrs: Any):
        """Record one call on an executor (or graph); returns the output value (or a tuple)."""
        graph = getattr(ex, "graph", ex)
        for i, v in enumerate(inputs):
            if v is None:
                raise L0Error(f"{self.name}: input {i} is NULL")
        node = graph.add_node(self.name, list(inputs), self.make_attrs(**attrs),
                              source=caller_source())
        return node.outputs[0] if len(node.outputs) == 1 else tuple(node.outputs)


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def caller_source(depth: int = 2) -> Optional[str]:
    """``"path:line"`` of the frame ``depth`` levels up (for :meth:`OpDef.__call__`: the op_api
    line recording a node), the path relative to the project root when inside it."""
    try:
        f = sys._getframe(depth)
    except ValueError:
        return None
    path = f.f_code.co_filename
    if path.startswith(_ROOT):
        path = path[len(_ROOT) + 1:]
    return f"{path}:{f.f_lineno}"


_REGISTRY: dict[str, OpDef] = {}
_ATTRS_CACHE: dict[tuple, OpAttrs] = {}


def register(op: OpDef, *, replace: bool = False) -> OpDef:
    """Add ``op`` to the registry and return it; a second op of the same name needs ``replace``."""
    if op.name in _REGISTRY and not replace:
        raise ValueError(f"l0 op {op.name!r} is already defined (pass replace=True to redefine it)")
    _REGISTRY[op.name] = op
    for key in [k for k in _ATTRS_CACHE if k[0] == op.name]:  # a redefined op validates anew
        del _ATTRS_CACHE[key]
    return op


def get_op(name: str) -> OpDef:
    """The OpDef registered under ``name``; KeyError names the known ops."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown l0 op {name!r} (known: {', '.join(sorted(_REGISTRY))})") from None


def all_ops() -> dict[str, OpDef]:
    """Every registered op by name."""
    return dict(_REGISTRY)


def require(cond: bool, op: str, msg: str) -> None:
    """Raise L0Error(``op: msg``) unless ``cond``."""
    if not cond:
        raise L0Error(f"{op}: {msg}")

