"""The l0 op registry: one :class:`OpDef` per op (attrs, type inference, effects, numpy semantics).

A user adds an op without editing the library:

    >>> from l0ops.registry import define_op, OpAttrs
    >>> class ScaleAttrs(OpAttrs):
    ...     factor: float
    >>> Scale = define_op("DocScale", attrs=ScaleAttrs, kind="elementwise",
    ...                   infer=lambda ts, a: [ts[0].with_()],
    ...                   compute=lambda xs, a: [xs[0] * xs[0].dtype.type(a.factor)])
    >>> Scale.name
    'DocScale'

Calling an OpDef records a node: ``y = Scale(executor, x, factor=2.0)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Sequence

from pydantic import BaseModel, BeforeValidator, ConfigDict, PlainSerializer, ValidationError

from opgraph.dtypes import DataType, dtype_of


class L0Error(ValueError):
    """An l0 builder rejected its inputs (CANN's l0 APIs return nullptr here)."""


class OpAttrs(BaseModel):
    """Base of every op's attribute model: frozen, no unknown fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")


# A DataType attribute: accepts DataType, numbers or names; serialises as the enum name.
DType = Annotated[DataType, BeforeValidator(lambda v: dtype_of(v) if isinstance(v, str) else v),
                  PlainSerializer(lambda d: d.name, return_type=str)]

InferFn = Callable[[list, Any], list]
ComputeFn = Callable[[list, Any], list]

KINDS = ("elementwise", "movement", "view", "reduce", "copy", "source", "kernel")


@dataclass(frozen=True)
class OpDef:
    """Everything opgraph knows about an l0 op.

    ``kind``: elementwise / movement / view / reduce / copy / source / kernel (fused kernels).
    ``writes``: operand indices the op writes in place (ViewCopy's destination); ops whose
    written operands depend on attrs pass ``writes_fn=lambda node: (...)``. Such nodes are
    effects: DCE and CSE never drop or merge them. ``expand``: an optional decomposition into
    FusedElementwise primitives, which makes the op fusable. ``free_if``: a predicate on the node telling
    when CANN launches no kernel for it (used by stats and pruning).
    """

    name: str
    attrs: type[OpAttrs]
    infer: InferFn
    compute: ComputeFn
    kind: str = "elementwise"
    num_inputs: "int | None" = None
    writes: tuple[int, ...] = ()
    doc: str = ""
    extra: dict = field(default_factory=dict)

    def make_attrs(self, **kwargs: Any) -> OpAttrs:
        """Validated attrs; frozen, so equal arguments share one instance (memoised)."""
        try:
            key = (self.name, tuple(sorted(kwargs.items())))
            hit = _ATTRS_CACHE.get(key)
        except TypeError:  # unhashable attribute values: validate every time
            key = hit = None
        if hit is not None:
            return hit
        try:
            attrs = self.attrs(**kwargs)
        except ValidationError as e:
            msgs = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'attrs'}: {err['msg']}"
                             for err in e.errors())
            raise L0Error(f"{self.name}: invalid attributes: {msgs}") from None
        if key is not None:
            if len(_ATTRS_CACHE) > 8192:
                _ATTRS_CACHE.clear()
            _ATTRS_CACHE[key] = attrs
        return attrs

    def infer_types(self, types: Sequence, attrs: OpAttrs) -> list:
        if self.num_inputs is not None and len(types) != self.num_inputs:
            raise L0Error(f"{self.name} takes {self.num_inputs} inputs, got {len(types)}")
        return list(self.infer(list(types), attrs))

    def is_free(self, node: Any) -> bool:
        """True when CANN launches no kernel for this node (an identity or a pure view)."""
        pred = self.extra.get("free")
        return bool(pred(node)) if pred else False

    def written(self, node: Any) -> tuple[int, ...]:
        """Operand indices ``node`` writes in place (``writes``, or the op's ``writes_fn``)."""
        fn = self.extra.get("writes_fn")
        return tuple(fn(node)) if fn else self.writes

    @property
    def has_effects(self) -> bool:
        return bool(self.writes) or "writes_fn" in self.extra

    def __call__(self, ex: Any, *inputs: Any, **attrs: Any):
        """Record one call on an executor (or graph); returns the output value (or a tuple)."""
        graph = getattr(ex, "graph", ex)
        for i, v in enumerate(inputs):
            if v is None:
                raise L0Error(f"{self.name}: input {i} is NULL")
        node = graph.add_node(self.name, list(inputs), self.make_attrs(**attrs))
        return node.outputs[0] if len(node.outputs) == 1 else tuple(node.outputs)


_REGISTRY: dict[str, OpDef] = {}
_ATTRS_CACHE: dict[tuple, OpAttrs] = {}


def define_op(name: str, *, attrs: type[OpAttrs] = OpAttrs, infer: InferFn, compute: ComputeFn,
              kind: str = "elementwise", num_inputs: "int | None" = None,
              writes: tuple[int, ...] = (), doc: str = "", replace: bool = False,
              **extra: Any) -> OpDef:
    """Register an l0 op and return its OpDef (callable as a builder)."""
    if kind not in KINDS:
        raise ValueError(f"op {name}: kind must be one of {KINDS}, got {kind!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"l0 op {name!r} is already defined (pass replace=True to redefine it)")
    op = OpDef(name, attrs, infer, compute, kind, num_inputs, tuple(writes), doc, dict(extra))
    _REGISTRY[name] = op
    for key in [k for k in _ATTRS_CACHE if k[0] == name]:  # a redefined op validates anew
        del _ATTRS_CACHE[key]
    return op


def get_op(name: str) -> OpDef:
    """The OpDef registered under ``name``; KeyError names the known ops."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown l0 op {name!r} (known: {', '.join(sorted(_REGISTRY))})") from None


def all_ops() -> dict[str, OpDef]:
    return dict(_REGISTRY)


def require(cond: bool, op: str, msg: str) -> None:
    """Raise L0Error(``op: msg``) unless ``cond``."""
    if not cond:
        raise L0Error(f"{op}: {msg}")

