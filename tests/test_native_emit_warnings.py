"""The C the native backend renders for a FusedElementwise kernel (what ``opgraph emit-c``
prints) compiles without a warning at ``-Wall -Wextra``: as a user compiles the printed file,
and with the backend's own flags for each instruction set the kernel has a branch for (scalar
C, AVX2 + F16C, AVX-512, AVX-512 FP16). It had unused variables in the scalar build (the
operands' strides, the table's period, bf16's ``quiet_row``) and ``#pragma omp simd`` warned
as unknown without ``-fopenmp``."""
from __future__ import annotations

import platform
import subprocess

import numpy as np
import pytest

from backends.native import build, compiler, render
from l0ops.interpreter import Hoisted
from l0ops.primitives import FusedAttrs, Instr
from opgraph.cli import main
from opgraph.core.dtypes import DataType as D

pytestmark = pytest.mark.skipif(not build.availability()[0], reason=build.availability()[1])

# (op_api, dtype, platform, options): bf16 has quiet_row, the 950 its own step order, no weight
# one operand fewer
CASES = [("aclnnBatchNormElemtBackward", "bfloat16", "Ascend910B", []),
         ("aclnnBatchNormElemtBackward", "float32", "Ascend950", ["--no-weight"]),
         ("aclnnBatchNormElemt", "float16", "Ascend910B", [])]
X86_ISAS = ["-march=x86-64", "-march=haswell", "-march=skylake-avx512", "-march=sapphirerapids"]


def gcc() -> list[str]:
    cc = build.find_compiler()[0]
    if cc is None or "Free Software Foundation" not in compiler.run(cc, ["--version"]).stdout:
        pytest.skip("the warning flags and -march names are GCC's")
    return list(cc)


def warnings_of(cc: list[str], path, flags: list[str]) -> str:
    proc = subprocess.run([*cc, *flags, "-Wall", "-Wextra", "-c", str(path), "-o", f"{path}.o"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stderr


def emitted(tmp_path, op: str, dtype: str, soc: str, options: list[str]):
    path = tmp_path / f"{op}_{dtype}_{soc}.c"
    assert main(["emit-c", op, "--shape", "2,3,4,5", "--dtype", dtype, "--platform", soc,
                 *options, "-o", str(path)]) == 0
    return path


def no_hoisted(tmp_path):
    """A kernel of two full-size inputs: no per-channel registers (no table)."""
    body = (Instr(op="sub", args=("in0", "in1"), dtype=D.FLOAT),)
    a = FusedAttrs(shape=(4, 8), body=body, result="t0", out_dtype=D.FLOAT)
    ones = np.ones((4, 8), np.float32)
    path = tmp_path / "no_hoisted.c"
    path.write_text(render.render(render.plan(a, Hoisted(a, [ones, ones]))))
    return path


@pytest.mark.parametrize("case", CASES + ["no hoisted"], ids=lambda c: c if isinstance(c, str) else "-".join(c[:3]))
def test_the_rendered_kernel_compiles_without_warnings(tmp_path, case):
    cc = gcc()
    path = no_hoisted(tmp_path) if case == "no hoisted" else emitted(tmp_path, *case)
    assert warnings_of(cc, path, []) == ""  # gcc -Wall -Wextra -c emitted.c
    own = [f for f in build.flags(cc) if f != "-shared"]
    assert warnings_of(cc, path, own) == ""  # as the backend builds it here
    # every instruction set's branch: the front end's warnings (unused variables, pragmas)
    own = [f for f in own if f != "-march=native"] + ["-fsyntax-only"]
    for isa in X86_ISAS if platform.machine() in ("x86_64", "AMD64") else []:
        assert warnings_of(cc, path, [*own, isa]) == "", isa
