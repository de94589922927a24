"""``opgraph ops``: the registered op_apis (platforms, dtypes, parameters) and the l0 ops with
the fidelity of their numerics per arch.

    >>> from opgraph.cli import main
    >>> main(["ops"])  # doctest: +ELLIPSIS
    op_apis:
    ...
      aclnnBatchNormElemtBackward  SyncBatchNorm element-wise input gradient, channel = dim 1
    ...
    l0 ops:
    ...
    0
"""
from __future__ import annotations

import argparse
from typing import Any

from opgraph.core.opapi import op_api_specs
from opgraph.core.opdef import all_ops
from opgraph.core.platform import lookup


def describe_op_api(name: str) -> list[str]:
    """Lines describing one op_api: summary, parameters with roles, platforms and dtypes."""
    spec = op_api_specs()[name]
    params = ", ".join(f"{p.name}{'?' if p.optional else ''}:{p.kind}"
                       + ("" if p.role == "input" else f"[{p.role}]") for p in spec.params)
    dtypes = {soc: "/".join(d.short for d in spec.dtypes(lookup(soc))) for soc in spec.platforms}
    lines = [f"  {name}  {spec.summary}", f"      ({params})",
             "      platforms: " + ", ".join(f"{soc} {d}" for soc, d in dtypes.items())]
    if spec.aclnn_api is None:
        lines.append("      no public aclnn API runs it whole (aclnn backend: levels 0-1 only)")
    return lines


def run(args: argparse.Namespace) -> int:
    """``opgraph ops``: print every op_api (``-v``: with parameters, platforms, dtypes) and every
    l0 op with its fidelity; returns 0."""
    print("op_apis:")
    for name in sorted(op_api_specs()):
        print("\n".join(describe_op_api(name)) if args.verbose else
              f"  {name}  {op_api_specs()[name].summary}")
    print("l0 ops:")
    for name, op in sorted(all_ops().items()):
        fid = "; ".join(str(f) for f in op.fidelity) or "fidelity not stated"
        extra = " (fusable)" if op.expand is not None else ""
        print(f"  {name} [{op.kind}]{extra}: {fid}")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``opgraph ops`` (``-v/--verbose``) on ``subparsers``; returns its parser."""
    p = subparsers.add_parser(
        "ops", help="list the op_apis and l0 ops (with the fidelity of their numerics)",
        description="The registered op_apis (built-in, from entry points and --load) and every "
                    "l0 op: its kind, whether level 2 can fuse it, and how faithful its numpy "
                    "semantics are to the NPU kernel (bit-faithful to public kernel source, or a "
                    "stated formula where no source is public).")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also list each op_api's parameters, platforms and dtypes")
    p.set_defaults(func=run)
    return p
