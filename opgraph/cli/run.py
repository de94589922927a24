"""``opgraph run OP``: random inputs, both aclnn phases on a backend, a summary, and the error
against a float64 evaluation of the op's formula.

    >>> from opgraph.cli import main
    >>> main(["run", "aclnnBatchNormElemtBackward", "--shape", "2,3,4"])  # doctest: +ELLIPSIS
    op:            aclnnBatchNormElemtBackward ...
    max rel error: ...
    0
"""
from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from ..platform import lookup
from .tiling import trace_report
from .common import (add_op_options, build_case, check, execute, fmt_status, fmt_type,
                     fmt_values, record)


def errors(out: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """``(max |out − ref|, max |out − ref| / max |ref|)``; (0, 0) for empty arrays.

    >>> errors(np.float32([1, 2]), np.float64([1, 2.5]))
    (0.5, 0.2)
    """
    if out.size == 0:
        return 0.0, 0.0
    diff = float(np.max(np.abs(out.astype(np.float64) - ref)))
    scale = float(np.max(np.abs(ref)))
    return diff, (diff / scale if scale > 0 else diff)


def run(args: argparse.Namespace) -> int:
    case = build_case(args)
    spec, p = case.spec, lookup(case.platform)
    print(f"op:            {spec.name} ({spec.summary})")
    print(f"platform:      {p.soc} ({p.arch_name}, {p.vector_cores} vector cores)")
    print(f"backend:       {case.backend}, opt level {case.level}, seed {args.seed}")
    ins = ", ".join(f"{k} {fmt_type(t)}" for k, t in case.tensors.items() if k != spec.output)
    print(f"inputs:        {ins}")
    rec = record(case)
    print(f"phase 1:       {fmt_status(rec.status)}, workspace {rec.workspace_size} B")
    check(rec.status, f"{spec.name}GetWorkspaceSize")
    ex = rec.executor
    compiled = ex.compiled or ex.graph
    print(f"graph:         {len(ex.graph.nodes)} recorded nodes, {len(compiled.nodes)} after level "
          f"{ex.opt_level}, {ex.kernel_count} kernel launches")
    status = execute(case, rec)
    print(f"phase 2:       {fmt_status(status)}")
    check(status, spec.name)
    if args.trace:
        print(trace_report(case.backend))
    out = case.output
    print(f"output:        {spec.output} {fmt_type(out)}")
    print(f"values:        {fmt_values(out)}")
    ref = spec.reference(case.arrays)
    abs_err, rel_err = errors(out, ref)
    print(f"reference:     {fmt_values(ref)} (float64 formula)")
    print(f"max abs error: {abs_err:.3e}")
    print(f"max rel error: {rel_err:.3e}  (max abs error / max |reference|)")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "run", help="run an op_api on random inputs and check it against float64",
        description="Random inputs (invstd and counter positive), phase 1 + phase 2 on --backend, "
                    "a summary, and the max abs / relative error against the op's formula "
                    "evaluated in float64 on the same (rounded) inputs.",
        epilog="example: opgraph run aclnnBatchNormElemtBackward --shape 8,16,7,7 --dtype "
               "bfloat16 --platform Ascend950 --seed 1")
    add_op_options(p, backend=True, seed=True)  # --level defaults to 1 for ascend-sim
    p.add_argument("--trace", action="store_true",
                   help="print the backend's kernel trace after phase 2 (ascend-sim: tiling, "
                        "per-core work, findings)")
    p.set_defaults(func=run)
    return p
