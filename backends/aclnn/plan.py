"""The *call plan* data model: a graph lowered to public aclnn C API calls (:mod:`.lower`).

A plan is plain data (pydantic, JSON round-trippable): the user buffers, the workspace arena (its
size is exactly the memory plan's — what phase 1 reported), buffers the plan itself owns (small
constants), every aclTensor to create (dtype, format, view dims/strides/offset, storage dims and
the buffer it lives in) and the aclnn calls in order, each run with the two-phase pattern
``<api>GetWorkspaceSize(args..., &ws, &executor)`` → allocate ``ws`` → ``<api>(ws, executor)``.

    >>> p = CallPlan(op="demo", users=[UserBuffer(name="x", dtype="ACL_FLOAT", elems=2)],
    ...              workspace_size=0, tensors=[], calls=[])
    >>> CallPlan.from_json(p.to_json()) == p
    True
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, Field

from opgraph.core.dtypes import DataType, Format


# --- the plan data model -----------------------------------------------------------------------
class UserBuffer(BaseModel):
    """A user tensor's memory: ``elems`` elements of ``dtype``; ``written`` if a call writes it."""

    name: str
    dtype: str
    elems: int
    written: bool = False


class PlanBuffer(BaseModel):
    """Device memory the plan owns (outside the workspace arena): ``nbytes`` bytes."""

    name: str
    nbytes: int


class TensorDesc(BaseModel):
    """One ``aclCreateTensor``: buffer is ``user`` (named user buffer), ``workspace`` (byte
    offset into the arena) or ``plan`` (a plan-owned buffer, named by ``user``)."""

    id: str
    dtype: str                      # aclDataType enumerator, e.g. "ACL_FLOAT16"
    format: str = "ACL_FORMAT_ND"   # aclFormat enumerator
    dims: list[int]
    strides: list[int]
    offset: int = 0                 # element offset of the view
    storage_dims: list[int]
    buffer: Literal["user", "workspace", "plan"]
    user: Optional[str] = None
    ws_offset: int = 0


class Arg(BaseModel):
    """One argument of a phase-1 call: an aclTensor (``tensor`` id, None = NULL), an aclIntArray,
    an aclScalar, an aclDataType, a bool, or a plain C ``double`` / ``float`` / ``int64_t``
    (``value``)."""

    kind: Literal["tensor", "int_array", "scalar", "dtype", "bool", "double", "float", "int64"]
    name: str
    tensor: Optional[str] = None
    ints: list[int] = Field(default_factory=list)
    value: float = 0.0
    dtype: str = ""
    flag: bool = False


class Call(BaseModel):
    """One aclnn API used in the two-phase pattern; ``source`` is the lowered node's dump line."""

    api: str
    args: list[Arg]
    source: str = ""

    @property
    def phase1(self) -> str:
        """The phase-1 API's name: ``<api>GetWorkspaceSize``."""
        return self.api + "GetWorkspaceSize"


class CallPlan(BaseModel):
    """Everything a host program or runtime needs to run the graph with real aclnn calls."""

    op: str
    level: Optional[int] = None
    users: list[UserBuffer]
    workspace_size: int
    plan_buffers: list[PlanBuffer] = Field(default_factory=list)
    tensors: list[TensorDesc]
    calls: list[Call]

    def to_json(self, indent: Optional[int] = 1) -> str:
        """The plan as JSON (pydantic's dump); ``indent=None`` writes one line."""
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: "str | bytes") -> "CallPlan":
        """A plan from :meth:`to_json` output (validated)."""
        return cls.model_validate_json(text)

    def tensor(self, tid: str) -> TensorDesc:
        """The tensor description of id ``tid`` (StopIteration when there is none)."""
        return next(t for t in self.tensors if t.id == tid)

    def listing(self) -> str:
        """A readable listing: buffers, tensors and the calls in order."""
        out = [f"plan {self.op} (level {self.level}): {len(self.calls)} calls, "
               f"workspace arena {self.workspace_size} B"]
        for u in self.users:
            out.append(f"  user {u.name}: {u.dtype}[{u.elems}]{' (written)' if u.written else ''}")
        for b in self.plan_buffers:
            out.append(f"  plan buffer {b.name}: {b.nbytes} B")
        for t in self.tensors:
            where = f"ws+{t.ws_offset}" if t.buffer == "workspace" else f"{t.buffer} {t.user}"
            out.append(f"  tensor {t.id}: {t.dtype} dims={t.dims} strides={t.strides} "
                       f"offset={t.offset} storage={t.storage_dims} @ {where}")
        for i, c in enumerate(self.calls):
            out.append(f"  [{i}] {c.api}({', '.join(fmt_arg(a) for a in c.args)})")
        return "\n".join(out)


def fmt_arg(a: Arg) -> str:
    """How an argument prints in :meth:`CallPlan.listing`."""
    if a.kind == "tensor":
        return a.tensor or "NULL"
    if a.kind == "int_array":
        return "[" + ",".join(map(str, a.ints)) + "]"
    if a.kind == "scalar":
        return f"{a.value!r}:{a.dtype}"
    if a.kind in ("double", "float", "int64"):
        return f"{a.kind} {int(a.value) if a.kind == 'int64' else a.value!r}"
    return a.dtype if a.kind == "dtype" else str(a.flag).lower()


def acl_dtype(d: DataType) -> str:
    """The aclDataType enumerator of ``d`` (a DataType or its number).

        >>> acl_dtype(DataType.BF16), acl_dtype(DataType.FLOAT)
        ('ACL_BF16', 'ACL_FLOAT')
    """
    return DataType(d).acl_name


def dtype_from_acl(name: str) -> DataType:
    """``"ACL_FLOAT16"`` → ``DataType.FLOAT16``."""
    return DataType[name[4:]]


def format_from_acl(name: str) -> Format:
    """``"ACL_FORMAT_NCHW"`` → ``Format.NCHW``."""
    return Format[name.replace("ACL_FORMAT_", "").replace("ACL_", "")]


def acl_format(f: Format) -> str:
    """``Format.ND`` → ``"ACL_FORMAT_ND"``."""
    return Format(f).acl_name
