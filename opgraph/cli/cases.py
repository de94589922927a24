"""Op_api cases for the CLI: every command that takes an OP gets one sub-parser per registered
op_api (its own options and help, user op_apis included), and builds a :class:`Case` — random
valid arguments from the op_api's generator, tensors over them — to record and run.

    >>> p = Parser(prog="opgraph demo-cmd")
    >>> add_op_subparsers(p)
    >>> args = p.parse_args(["aclnnBatchNormElemtBackward", "--shape", "2,3,4", "--dtype", "f16"])
    >>> case = build_case(args, seed=0)
    >>> rec = record(case)
    >>> rec.status, case.tensors["gradInput"].dtype.name, len(rec.executor.graph.nodes) > 0
    (<Status.ACLNN_SUCCESS: 0>, 'FLOAT16', True)
"""
from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import numpy as np

from opgraph.aclnn.twophase import aclGetRecentErrMsg
from opgraph.core.config import OPT_LEVELS, fast_math, get_opt_level, opt_level, use_backend
from opgraph.core.dtypes import DataType
from opgraph.core.executor import Executor
from opgraph.core.opapi import Arrays, InputConfig, OpApiSpec, Option, get_op_api, op_api_specs
from opgraph.core.platform import DEFAULT as DEFAULT_PLATFORM
from opgraph.core.platform import PRESETS, platform
from opgraph.core.status import Status
from opgraph.core.tensor import Tensor, tensor
from .common import (CliError, Parser, check_fast_math_level, check_memory, fmt_status,
                     integer_option, parse_backend, parse_dtype, parse_platform, parse_seed,
                     parse_shape)

OPTION_TYPES: dict[str, Callable[[str], Any]] = {"dtype": parse_dtype, "float": float,
                                                 "int": integer_option}


def _add_option(p: argparse.ArgumentParser, o: Option) -> None:
    if o.type == "flag":
        p.add_argument(o.flag, dest=o.name, action="store_true", help=o.help)
    else:
        shown = o.default.np.name if isinstance(o.default, DataType) else o.default
        p.add_argument(o.flag, dest=o.name, type=OPTION_TYPES[o.type], default=o.default,
                       metavar=o.type.upper(), help=o.help + (f" (default: {shown})"
                                                              if o.default is not None else ""))


def add_common_options(p: argparse.ArgumentParser, spec: OpApiSpec, *,
                       level_default: Optional[int] = None, backend: bool = False,
                       seed: bool = False, level_shown: Optional[str] = None) -> None:
    """``--shape --dtype --platform --level`` (+ ``--backend``/``--seed``) and ``spec``'s own;
    ``level_shown``: --level's default as its help says it (a command resolving None itself)."""
    shape = ",".join(map(str, spec.default_shape))
    p.add_argument("--shape", type=parse_shape, default=spec.default_shape, metavar="N,C,...",
                   help=f"data shape, channel is dim 1 (default: {shape})")
    p.add_argument("--dtype", type=parse_dtype, default=DataType.FLOAT, metavar="DTYPE",
                   help="dtype of the data tensors: float32, float16, bfloat16 (default: float32)")
    for o in spec.options:
        _add_option(p, o)
    soc = DEFAULT_PLATFORM if DEFAULT_PLATFORM in spec.platforms else spec.platforms[0]
    p.add_argument("--platform", type=parse_platform, default=soc, metavar="SOC",
                   help=f"SoC preset: {', '.join(PRESETS)} (default: {soc})")
    shown = (level_shown if level_shown is not None else
             "the library default, 1 on --backend ascend-sim, whose kernels exist up to it"
             if level_default is None and backend else
             "the library default" if level_default is None else level_default)
    p.add_argument("--level", type=integer_option, choices=OPT_LEVELS, default=level_default,
                   help="optimisation level: 0 as recorded, 1 what CANN launches, 2 fused "
                        f"(default: {shown})")
    if backend:
        p.add_argument("--backend", type=parse_backend, default="numpy", metavar="NAME",
                       help="backend phase 2 runs on (default: numpy)")
    if seed:
        p.add_argument("--seed", type=parse_seed, default=0, metavar="N",
                       help="random seed of the inputs, 0 to 2**63-1 (default: 0)")


def add_op_subparsers(p: argparse.ArgumentParser,
                      command_options: Optional[Callable[[argparse.ArgumentParser], None]] = None,
                      **common: Any) -> None:
    """One sub-parser per registered op_api under ``p`` (``args.op`` names the chosen one), each
    with the common options, the op_api's own and the command's (``command_options``)."""
    sub = p.add_subparsers(dest="op", metavar="OP", required=True, parser_class=Parser,
                           help="the op_api (opgraph ops lists them; --load adds yours)")
    for name, spec in sorted(op_api_specs().items()):
        sp = sub.add_parser(name, help=spec.summary, description=f"{name}: {spec.summary}")
        add_common_options(sp, spec, **common)
        if command_options is not None:
            command_options(sp)


@dataclass
class Case:
    """One op call ready to record: spec, arguments by parameter name (arrays, scalars, None =
    NULL) and tensors over the arrays, plus the platform, level, backend and fast-math setting
    to use."""

    spec: OpApiSpec
    arrays: Arrays
    platform: str
    level: int
    backend: str = "numpy"
    formats: dict[str, str] = field(default_factory=dict)
    tensors: dict[str, Optional[Tensor]] = field(default_factory=dict)
    fast_math: bool = False

    def __post_init__(self) -> None:
        self.tensors = {k: tensor(a, self.formats.get(k, "ND")) for k, a in self.arrays.items()
                        if isinstance(a, np.ndarray)}

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """Platform, opt level, backend and fast-math of this case, for the duration of a block."""
        with platform(self.platform), opt_level(self.level), use_backend(self.backend), \
                fast_math(self.fast_math):
            yield

    @property
    def args(self) -> list[Any]:
        """Phase-1 arguments in prototype order."""
        return [self.tensors.get(p.name) if p.kind == "tensor" else self.arrays.get(p.name)
                for p in self.spec.params]

    @property
    def outputs(self) -> dict[str, np.ndarray]:
        """The arrays phase 2 writes (outputs and in-out tensors that are not NULL)."""
        return {p.name: self.arrays[p.name] for p in self.spec.tensor_params("output", "inout")
                if self.arrays.get(p.name) is not None}


def input_config(args: argparse.Namespace, spec: OpApiSpec) -> InputConfig:
    """The :class:`InputConfig` of the parsed options: ``--shape``, ``--dtype`` and the op's own
    options (by :class:`Option` name)."""
    return InputConfig(tuple(args.shape), args.dtype,
                       {o.name: getattr(args, o.name) for o in spec.options})


def build_case(args: argparse.Namespace, seed: "int | None" = None, peak: int = 1) -> Case:
    """Random inputs for ``args.op`` from the parsed options (``seed`` or args.seed or 0).
    ``peak``: what the command will hold at once, in multiples of the inputs and outputs (the
    memory limit applies to that)."""
    spec = get_op_api(args.op)
    low, high = spec.rank
    if not low <= len(args.shape) <= high:
        need = f"rank >= {low}" if len(args.shape) < low else f"rank <= {high}"
        raise CliError(f"--shape: {spec.name} needs {need} (N, C, ...), "
                       f"got {list(args.shape)}", code=2)
    if spec.make_inputs is None:
        raise CliError(f"{spec.name} has no input generator (make_inputs), so the CLI cannot "
                       "make its arguments")
    cfg = input_config(args, spec)
    seed = getattr(args, "seed", 0) if seed is None else seed
    sizing = "".join(f" {o.flag} {cfg.option(o.name)}" for o in spec.options
                     if o.type == "int" and cfg.option(o.name) != o.default)
    try:  # the generator refuses a shape or option combination it cannot build
        what = f"the {args.dtype.short} inputs and outputs" + (
            f" and running and checking them (~{peak}x their size)" if peak > 1 else "")
        check_memory(args.shape, spec.bytes_for(cfg) * peak, what, sizing)
        arrays = spec.make_inputs(cfg, np.random.default_rng(seed))
    except ValueError as e:
        raise CliError(f"{_blamed(spec, str(e))}: {spec.name}: {e}", code=2) from None
    backend = getattr(args, "backend", "numpy")
    level = args.level
    if level is None:  # ascend-sim simulates CANN's kernels, which exist up to level 1
        level = 1 if backend == "ascend-sim" else get_opt_level()
    fast = bool(getattr(args, "fast_math", False))
    check_fast_math_level(fast, level, "" if args.level is not None else
                          f" (--backend {backend}'s default)" if backend == "ascend-sim" else
                          " (the library default)")
    return Case(spec, arrays, args.platform, level, backend, dict(spec.formats(cfg)),
                fast_math=fast)



def _blamed(spec: OpApiSpec, error: str) -> str:
    """The option an input generator's error is about: the one whose name starts the message
    (``'ranks: -1 is negative'``), else --shape."""
    return next((o.flag for o in spec.options if error.startswith(o.name + ":")), "--shape")


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
    """Phase 1 on the case's arguments (platform and level of the case). Never raises."""
    with case.context():
        status, ws, ex = case.spec.get_workspace_size(*case.args)
    return Recorded(Status(status), ws, ex)


def recorded_executor(case: Case) -> Executor:
    """Phase 1 that must succeed: the executor, or a CliError quoting the op's message."""
    rec = record(case)
    check(rec.status, f"{case.spec.name}GetWorkspaceSize")
    assert rec.executor is not None
    return rec.executor


def execute(case: Case, rec: Recorded) -> Status:
    """Phase 2 with a fresh workspace of the size phase 1 reported."""
    with case.context():
        workspace: Any = bytearray(rec.workspace_size) if rec.workspace_size else None
        return Status(case.spec.run(workspace, rec.workspace_size, rec.executor))

