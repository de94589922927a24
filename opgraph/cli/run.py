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

from opgraph.core.platform import lookup
from .cases import add_op_subparsers, build_case, check, execute, record
from .common import fmt_status, fmt_type, fmt_values
from .tiling import trace_report


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
    written = case.outputs
    ins = ", ".join(f"{p.name} {fmt_type(case.tensors.get(p.name))}" if p.kind == "tensor"
                    else f"{p.name}={case.arrays.get(p.name)}"
                    for p in spec.params if p.name not in written or p.role == "inout")
    print(f"inputs:        {ins}")
    ref = spec.reference(case.arrays)  # on the inputs as given (in-out tensors before the call)
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
    for name, out in written.items():
        print(f"output:        {name} {fmt_type(out)}")
        print(f"values:        {fmt_values(out)}")
        if name not in ref:
            print("reference:     none for this output")
            continue
        abs_err, rel_err = errors(out, ref[name])
        print(f"reference:     {fmt_values(ref[name])} (float64 formula)")
        print(f"max abs error: {abs_err:.3e}")
        print(f"max rel error: {rel_err:.3e}  (max abs error / max |reference|)")
    return 0


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", action="store_true",
                   help="print the backend's kernel trace after phase 2 (ascend-sim: tiling, "
                        "per-core work, findings)")
    p.set_defaults(func=run)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "run", help="run an op_api on random inputs and check it against float64",
        description="Random valid inputs, phase 1 + phase 2 on --backend, a summary, and the max "
                    "abs / relative error of every output against the op's formula evaluated in "
                    "float64 on the same (rounded) inputs.",
        epilog="example: opgraph run aclnnBatchNormElemtBackward --shape 8,16,7,7 --dtype "
               "bfloat16 --platform Ascend950 --seed 1")
    add_op_subparsers(p, _options, backend=True, seed=True)  # --level: 1 for ascend-sim
    return p
