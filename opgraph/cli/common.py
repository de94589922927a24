"""What every CLI command shares: the one-line error convention, the op table, the
op/shape/dtype/platform options, input construction and the two aclnn phases.

A new command (``tiling``, ``plan``, ``emit-cpp`` ...) typically does:

    >>> import argparse
    >>> p = Parser(prog="opgraph demo-cmd")
    >>> add_op_options(p)
    >>> args = p.parse_args(["aclnnBatchNormElemtBackward", "--shape", "2,3,4", "--dtype", "f16"])
    >>> case = build_case(args, seed=0)
    >>> rec = record(case)
    >>> rec.status, case.tensors["gradInput"].dtype.name, len(rec.executor.graph.nodes) > 0
    (<Status.ACLNN_SUCCESS: 0>, 'FLOAT16', True)
"""
from __future__ import annotations

import sys

import argparse
import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import numpy as np

from ..aclnn import aclGetRecentErrMsg
from ..aclnn.batch_norm_elemt_backward import (aclnnBatchNormElemtBackward,
                                               aclnnBatchNormElemtBackwardGetWorkspaceSize)
from ..config import OPT_LEVELS, get_opt_level, opt_level, use_backend
from ..dtypes import DataType, dtype_of
from ..executor import Executor
from ..platform import DEFAULT as DEFAULT_PLATFORM
from ..platform import PRESETS, lookup, platform
from ..status import Status
from ..tensor import Tensor, tensor


class CliError(Exception):
    """A user-facing failure: ``main`` prints ``opgraph: error: <message>`` and exits ``code``."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are ONE line on stderr (exit status 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"opgraph: error: {message} (see '{self.prog} --help')\n")


def fmt_status(status: Status) -> str:
    """``'0 (ACLNN_SUCCESS)'``: the C return value and its name."""
    return f"{int(status)} ({Status(status).name})"


def fmt_type(a: "np.ndarray | Tensor | None") -> str:
    """``'f16[2,3,1,4]'`` like the graph dumps (``'NULL'`` for None)."""
    if a is None:
        return "NULL"
    return f"{dtype_of(a.dtype).short}[{','.join(map(str, a.shape))}]"


def fmt_values(a: np.ndarray, n: int = 6) -> str:
    """The first ``n`` values of ``a`` as floats, e.g. ``'[0.5, -1.25, ...] (24 values)'``."""
    flat = np.asarray(a).reshape(-1)
    head = ", ".join(f"{float(v):.6g}" for v in flat[:n])
    more = ", ..." if flat.size > n else ""
    return f"[{head}{more}] ({flat.size} values)"


# --- argument types (raise ArgumentTypeError: argparse turns it into one line) ------------------
def parse_shape(text: str) -> tuple[int, ...]:
    """``"2,3,1,4"`` → ``(2, 3, 1, 4)``; dims are non-negative integers.

    >>> parse_shape("2, 3,1,4")
    (2, 3, 1, 4)
    """
    parts = [p.strip() for p in text.split(",")]
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        dims = ()
    if not dims or any(d < 0 for d in dims):
        raise argparse.ArgumentTypeError(
            f"bad shape {text!r}: expected comma-separated non-negative integers, e.g. 2,3,1,4")
    return dims


def parse_dtype(text: str) -> DataType:
    """A dtype name opgraph understands (``float16``, ``f16``, ``bfloat16``, ``int32`` ...)."""
    try:
        d = dtype_of(text)
        d.np  # noqa: B018  (must be holdable by numpy)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return d


def parse_platform(text: str) -> str:
    """A SoC preset name (``Ascend910B``, ``Ascend950`` ...)."""
    try:
        return lookup(text).soc
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_backend(text: str) -> str:
    """A backend that is registered and available here."""
    import backends
    try:
        backends.get(text)
    except backends.BackendUnavailable as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


Arrays = dict[str, Optional[np.ndarray]]  # op argument name -> array (None = NULL)


# --- the op table -------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpSpec:
    """How the CLI drives one op_api: its two phases, argument order, output argument,
    input construction and a float64 reference of its formula."""

    name: str
    get_workspace_size: Callable[..., tuple[Status, int, Optional[Executor]]]
    run: Callable[..., Status]
    args: tuple[str, ...]
    output: str
    make_arrays: Callable[[argparse.Namespace, np.random.Generator], Arrays]
    reference: Callable[[Arrays], np.ndarray]
    min_rank: int = 1
    summary: str = ""


def _cast(a: np.ndarray, d: DataType) -> np.ndarray:
    return np.asarray(a).astype(d.np)


def bn_elemt_backward_arrays(args: argparse.Namespace, rng: np.random.Generator) -> Arrays:
    """Random inputs for aclnnBatchNormElemtBackward: invstd in [0.5, 2), counter in 1..8."""
    shape, d = args.shape, args.dtype
    out_dtype = d if args.grad_input_dtype is None else args.grad_input_dtype
    C = shape[1]
    out = {
        "gradOut": _cast(rng.standard_normal(shape), d),
        "input": _cast(rng.standard_normal(shape), d),
        "mean": _cast(rng.normal(0.0, 0.5, C), d),
        "invstd": _cast(rng.uniform(0.5, 2.0, C), d),
        "weight": None if args.no_weight else _cast(rng.uniform(0.5, 1.5, C), d),
        "sumDy": _cast(rng.standard_normal(C), d),
        "sumDyXmu": _cast(rng.standard_normal(C), d),
        "counter": _cast(rng.integers(1, 9, C), args.counter_dtype),
        "gradInput": np.zeros(shape, out_dtype.np),
    }
    return out


def bn_elemt_backward_reference(a: Arrays) -> np.ndarray:
    """The formula in float64 on the (already rounded) inputs; channel = dim 1.

    ``((gradOut − sumDy/Σcnt) − (input − mean)·invstd²·(sumDyXmu/Σcnt))·invstd·weight``
    """
    f = {k: np.asarray(v).astype(np.float64) for k, v in a.items() if v is not None}
    x = f["input"]
    bshape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
    ch = {k: f[k].reshape(bshape)
          for k in ("mean", "invstd", "weight", "sumDy", "sumDyXmu") if k in f}
    total = f["counter"].sum()
    weight = ch.get("weight", 1.0)
    return (((f["gradOut"] - ch["sumDy"] / total)
             - (x - ch["mean"]) * ch["invstd"] ** 2 * (ch["sumDyXmu"] / total))
            * ch["invstd"] * weight)


OPS: dict[str, OpSpec] = {
    "aclnnBatchNormElemtBackward": OpSpec(
        name="aclnnBatchNormElemtBackward",
        get_workspace_size=aclnnBatchNormElemtBackwardGetWorkspaceSize,
        run=aclnnBatchNormElemtBackward,
        args=("gradOut", "input", "mean", "invstd", "weight", "sumDy", "sumDyXmu", "counter",
              "gradInput"),
        output="gradInput",
        make_arrays=bn_elemt_backward_arrays,
        reference=bn_elemt_backward_reference,
        min_rank=2,
        summary="SyncBatchNorm element-wise input gradient, channel = dim 1",
    ),
}


def add_op_options(p: argparse.ArgumentParser, *, level_default: Optional[int] = None,
                   backend: bool = False, seed: bool = False) -> None:
    """The shared positional OP and ``--shape --dtype --no-weight --counter-dtype
    --grad-input-dtype --platform --level`` (plus ``--backend``/``--seed`` on request)."""
    p.add_argument("op", metavar="OP", choices=sorted(OPS),
                   help="the op_api to record (one of: %(choices)s)")
    p.add_argument("--shape", type=parse_shape, default=(2, 3, 1, 4), metavar="N,C,...",
                   help="input shape, channel is dim 1 (default: 2,3,1,4)")
    p.add_argument("--dtype", type=parse_dtype, default=DataType.FLOAT, metavar="DTYPE",
                   help="dtype of the data and channel tensors: float32, float16, bfloat16 "
                        "(default: float32)")
    p.add_argument("--no-weight", action="store_true",
                   help="pass weight as NULL (filled with ones)")
    p.add_argument("--counter-dtype", type=parse_dtype, default=DataType.FLOAT, metavar="DTYPE",
                   help="dtype of counter: float32, float16, int32 (default: float32)")
    p.add_argument("--grad-input-dtype", type=parse_dtype, default=None, metavar="DTYPE",
                   help="dtype of the output gradInput (default: --dtype)")
    p.add_argument("--platform", type=parse_platform, default=DEFAULT_PLATFORM, metavar="SOC",
                   help=f"SoC preset: {', '.join(PRESETS)} (default: {DEFAULT_PLATFORM})")
    shown = "the library default" if level_default is None else level_default
    p.add_argument("--level", type=int, choices=OPT_LEVELS, default=level_default,
                   help="optimisation level: 0 as recorded, 1 what CANN launches, 2 fused "
                        f"(default: {shown})")
    if backend:
        p.add_argument("--backend", type=parse_backend, default="numpy", metavar="NAME",
                       help="backend phase 2 runs on (default: numpy)")
    if seed:
        p.add_argument("--seed", type=int, default=0, help="random seed of the inputs (default: 0)")


@dataclass
class Case:
    """One op call ready to record: spec, numpy arrays (None = NULL) and tensors over them."""

    spec: OpSpec
    arrays: Arrays
    platform: str
    level: int
    backend: str = "numpy"
    tensors: dict[str, Optional[Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tensors = {k: None if a is None else tensor(a) for k, a in self.arrays.items()}

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """Platform, opt level and backend of this case, for the duration of a block."""
        with platform(self.platform), opt_level(self.level), use_backend(self.backend):
            yield

    @property
    def output(self) -> np.ndarray:
        return self.arrays[self.spec.output]


def build_case(args: argparse.Namespace, seed: "int | None" = None) -> Case:
    """Random inputs for ``args.op`` from the shared options (``seed`` or args.seed or 0)."""
    spec = OPS[args.op]
    if len(args.shape) < spec.min_rank:
        raise CliError(f"--shape: {spec.name} needs rank >= {spec.min_rank} (N, C, ...), "
                       f"got {list(args.shape)}", code=2)
    seed = getattr(args, "seed", 0) if seed is None else seed
    arrays = spec.make_arrays(args, np.random.default_rng(seed))
    backend = getattr(args, "backend", "numpy")
    level = args.level
    if level is None:  # ascend-sim simulates CANN's kernel, which exists up to level 1
        level = 1 if backend == "ascend-sim" else get_opt_level()
    return Case(spec, arrays, args.platform, level, backend)


@dataclass
class Recorded:
    """The result of phase 1: status, workspace size and executor (None on failure)."""

    status: Status
    workspace_size: int
    executor: Optional[Executor]


def check(status: Status, what: str) -> None:
    """CHECK_RET: raise CliError quoting aclGetRecentErrMsg() unless ``status`` is success."""
    if status != Status.ACLNN_SUCCESS:
        raise CliError(f"{what} failed: {aclGetRecentErrMsg() or fmt_status(status)}")


def record(case: Case) -> Recorded:
    """Phase 1 on the case's tensors (platform and level of the case). Never raises."""
    with case.context():
        status, ws, ex = case.spec.get_workspace_size(*(case.tensors[k] for k in case.spec.args))
    return Recorded(Status(status), ws, ex)


def recorded_executor(case: Case):
    """Phase 1 that must succeed: the executor, or a CliError quoting the op's message."""
    rec = record(case)
    check(rec.status, f"{case.spec.name}GetWorkspaceSize")
    return rec.executor


def execute(case: Case, rec: Recorded) -> Status:
    """Phase 2 with a fresh workspace of the size phase 1 reported."""
    with case.context():
        workspace: Any = bytearray(rec.workspace_size) if rec.workspace_size else None
        return Status(case.spec.run(workspace, rec.workspace_size, rec.executor))


def write_output(text: "str | bytes", path: "str | None", summary: "str | None" = None) -> int:
    """Write ``text`` to stdout (``path`` None or '-') or to ``path`` (bytes: binary), then
    print ``summary`` when a file was written."""
    if path in (None, "-"):
        sys.stdout.write(text)
        return 0
    try:
        if isinstance(text, bytes):
            with open(path, "wb") as f:
                f.write(text)
        else:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
    except OSError as e:
        raise CliError(f"cannot write {path}: {e.strerror or e}") from None
    if summary:
        print(f"wrote {path}: {summary}")
    return 0
