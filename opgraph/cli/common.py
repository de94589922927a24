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

import argparse
import contextlib
import math
import os
import sys
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


def fmt_bytes(n: int) -> str:
    """A byte count for people: ``'512 B'``, ``'1.5 KiB'``, ``'768.0 GiB'``, ``'over 1 ZiB'``.

    >>> fmt_bytes(512), fmt_bytes(1536), fmt_bytes(768 * 2**30), fmt_bytes(10**400)
    ('512 B', '1.5 KiB', '768.0 GiB', 'over 1 ZiB')
    """
    if n < 1024:
        return f"{n} B"
    if n >= 2**70:
        return "over 1 ZiB"
    units = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    power = min((n.bit_length() - 1) // 10, len(units))
    return f"{n / 2**(10 * power):.1f} {units[power - 1]}"


# --- memory: refuse, before allocating, what would not fit ------------------------------------
MEMORY_SHARE = 8  # a command's arrays may take 1/8 of physical memory; the rest is for temporaries
FALLBACK_MEMORY = 16 * 2**30  # assumed where os.sysconf cannot tell


def physical_memory() -> int:
    """Bytes of physical memory (``SC_PHYS_PAGES * SC_PAGE_SIZE``; 16 GiB where unknown)."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return FALLBACK_MEMORY
    return total if total > 0 else FALLBACK_MEMORY


def check_memory(shape: tuple[int, ...], nbytes: int, what: str) -> None:
    """CliError naming --shape when ``what`` would take more than 1/MEMORY_SHARE of memory.

    >>> check_memory((2, 3), 96, "the inputs and output")
    >>> check_memory((2**40, 3), 12 * 2**42, "the inputs and output")
    Traceback (most recent call last):
    ...
    opgraph.cli.common.CliError: --shape 1099511627776,3: the inputs and output need 48.0 TiB, ...
    """
    total = physical_memory()
    limit = total // MEMORY_SHARE
    if nbytes > limit:
        need, allowed = fmt_bytes(nbytes), fmt_bytes(limit)
        if need == allowed:  # too close to tell apart when rounded
            need, allowed = f"{nbytes} B", f"{limit} B"
        raise CliError(f"--shape {','.join(map(str, shape))}: {what} need {need}, more than the "
                       f"limit of {allowed} (1/{MEMORY_SHARE} of the {fmt_bytes(total)} of "
                       f"physical memory)", code=2)


# --- argument types (raise ArgumentTypeError: argparse turns it into one line) ------------------
MAX_ELEMENTS = 2**60  # numpy's size limit for float64 arrays (the inputs are drawn in float64)
MAX_RANK = 32  # the most dims numpy 1.x arrays have (2.x: 64)


def parse_shape(text: str) -> tuple[int, ...]:
    """``"2,3,1,4"`` → ``(2, 3, 1, 4)``; at most 32 non-negative integer dims. An empty shape's
    non-zero dims must multiply to less than 2**60, or numpy cannot describe it (the memory a
    non-empty shape needs is checked by the command).

    >>> parse_shape("2, 3,1,4")
    (2, 3, 1, 4)
    >>> parse_shape(f"{2**40},{2**20},0")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: bad shape '1099511627776,1048576,0': ...below 2**60...
    """
    parts = [p.strip() for p in text.split(",")]
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        dims = ()
    if not dims or any(d < 0 for d in dims):
        raise argparse.ArgumentTypeError(
            f"bad shape {text!r}: expected comma-separated non-negative integers, e.g. 2,3,1,4")
    if len(dims) > MAX_RANK:
        raise argparse.ArgumentTypeError(
            f"bad shape: {len(dims)} dims, numpy arrays have at most {MAX_RANK}")
    if 0 in dims and math.prod(d for d in dims if d) >= MAX_ELEMENTS:
        raise argparse.ArgumentTypeError(
            f"bad shape {text!r}: the non-zero dims of an empty shape must multiply to below "
            f"2**60, numpy's array size limit")
    return dims


def _int_at_least(text: str, low: int) -> int:
    try:
        n = int(text)
    except ValueError:
        n = low - 1
    if n < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
    return n


def non_negative_int(text: str) -> int:
    """An integer >= 0 (``--seed``, ``--embed-limit``)."""
    return _int_at_least(text, 0)


def positive_int(text: str) -> int:
    """An integer >= 1 (``--cores``, ``--ub``)."""
    return _int_at_least(text, 1)


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
    array_bytes: Callable[[argparse.Namespace], int]  # what make_arrays would allocate
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


def bn_elemt_backward_bytes(args: argparse.Namespace) -> int:
    """Bytes of the arrays :func:`bn_elemt_backward_arrays` makes, computed without making them."""
    d = args.dtype
    out_dtype = d if args.grad_input_dtype is None else args.grad_input_dtype
    per_channel = (4 if args.no_weight else 5) * d.itemsize + args.counter_dtype.itemsize
    numel, channels = math.prod(args.shape), args.shape[1]
    return numel * (2 * d.itemsize + out_dtype.itemsize) + channels * per_channel


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
        array_bytes=bn_elemt_backward_bytes,
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
        p.add_argument("--seed", type=non_negative_int, default=0, metavar="N",
                       help="random seed of the inputs, an integer >= 0 (default: 0)")


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
    check_memory(args.shape, spec.array_bytes(args),
                 f"the {args.dtype.short} inputs and output")
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


def write_output(text: "str | bytes", path: "str | None", summary: "str | None" = None,
                 option: str = "-o/--output") -> int:
    """Write ``text`` to stdout (``path`` None or '-') or to ``path`` (bytes: binary), then
    print ``summary`` when a file was written; a failed write is a CliError naming ``option``."""
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
        raise CliError(f"{option}: cannot write {path!r}: {e.strerror or e}") from None
    if summary:
        print(f"wrote {path}: {summary}")
    return 0
