"""The hoisted (per-channel) part of a FusedElementwise body in C, run by the same call as the
kernel: phase 2 on the native backend then makes one C call and no numpy calls.

:class:`Prologue` takes the registers the kernel reads and every hoisted instruction they depend
on, and renders ``static void opg_prologue(const int64_t *tab, void *const *small, float *scr)``.
Register values live in a float32 scratch block: small float inputs are copied in (exact
widening), ``fill`` is one element read with stride 0 (a per-channel one is written out, so the
kernel reads it by the strides of the other per-channel registers), ``view`` aliases its
(contiguous) source;
``add``/``sub``/``mul``/``div``/``sqrt`` (correctly rounded, as numpy's) and float casts round
to their dtype after every instruction like the numpy reference, ``cast`` of an int32/int64
input to f32 is C's (round to nearest even, as numpy), ``max``/``fma``/``eq``/``where`` are
numpy's (the arch35 kernels' reciprocal square root refinement), ``pow`` by a constant
exponent the 950 kernel special-cases is computed as it does (−0.5: 1/sqrt), and ``sum`` follows
:mod:`l0ops.ordered` (64 lanes, 32768-element blocks, tree folds; a sum over at most 64
elements, one in each lane, is folded for 64 kept indices at a time). An instruction's loop
leaves out its size-1 dims and takes each row ``OPG_W`` elements at a time where the operands
are rows or constants (the same correctly rounded operation on every lane). Sizes and strides
are run-time values in ``tab`` (:attr:`Prologue.table`): a new size of the same structure
reuses the compiled code. Anything else raises :class:`Unsupported` and the backend evaluates
the hoisted part in numpy instead.

    >>> import numpy as np
    >>> from l0ops.interpreter import program
    >>> from l0ops.primitives import FusedAttrs, Instr
    >>> from opgraph.core.dtypes import DataType as D
    >>> body = (Instr(op="cast", args=("in0",), dtype=D.FLOAT), Instr(op="sum", args=("t0",), dtype=D.FLOAT),
    ...         Instr(op="div", args=("in1", "t1"), dtype=D.FLOAT), Instr(op="mul", args=("in2", "t2"), dtype=D.FLOAT))
    >>> a = FusedAttrs(shape=(2, 3), body=body, result="t3", out_dtype=D.FLOAT)
    >>> ins = [np.int32([2, 2]), np.float32([1, 2, 3]), np.ones((2, 3), np.float32)]
    >>> pro = Prologue(body, program(a, ins).types, ins, ("t2",))
    >>> pro.small, pro.regs["t2"][1], pro.scratch
    ((0, 1), (3,), 9)
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from l0ops.ordered import BLOCK, LANES
from l0ops.primitives import Instr
from opgraph.core.dtypes import DataType
from opgraph.core.tensor import row_major_strides
from .c_text import C_OP, FLOATS, LOAD, ROUND, V_FOLD_COLS, V_LOAD, V_OP, V_ROUND
from .render import Plan, render
from .unsupported import Unsupported

INT_C = {DataType.INT32: "int32_t", DataType.INT64: "int64_t"}
# numpy's semantics of the other per-channel instructions, on float registers: np.maximum (a
# NaN operand wins, the first when both are; a tie gives the second, so max(-0, +0) = +0 —
# what numpy does on every path here, checked by the tests against numpy itself), fma in
# double rounded once to float32 (f32 only: a narrow fma rounds from double straight to its
# dtype), a bool register held as 1.0f / 0.0f
_SCALAR = {"cast": "{}", "sqrt": "sqrtf({})", "max": "(({0}) != ({0}) || ({0}) > ({1}) ? ({0}) : ({1}))",
           "fma": "(float)((double)({0}) * (double)({1}) + (double)({2}))",
           "eq": "(({0}) == ({1}) ? 1.0f : 0.0f)", "where": "(({0}) != 0.0f ? ({1}) : ({2}))"}
# pow by a one-element constant: the exponents the 950 kernel special-cases (l0ops pow_array),
# each in float as it computes them; any other exponent stays in numpy
_POW = {-0.5: "(1.0f / sqrtf({0}))", 0.5: "sqrtf({0})", 2.0: "(({0}) * ({0}))", -1.0: "(1.0f / ({0}))",
        1.0: "({0})", 0.0: "1.0f"}
IN_C = {DataType.FLOAT: "float", DataType.FLOAT16: "uint16_t", DataType.BF16: "uint16_t", **INT_C}

HELPERS = V_FOLD_COLS + f"""#include <math.h>

static float opg_tree(float *a, int64_t m) {{  /* l0ops.ordered.tree_fold (m >= 1) */
    while (m > 1) {{
        const int64_t n = (m + 1) / 2;
        for (int64_t j = 0; j < m - n; ++j) a[j] += a[j + n];
        m = n;
    }}
    return a[0];
}}

/* next index of an odometer over dims [0, r) of sizes sh, moving offsets o[k] by strides st[k] */
static inline void opg_step(int r, const int64_t *sh, int64_t *idx, int nk, int64_t *o,
                            const int64_t *const *st) {{
    for (int d = r - 1; d >= 0; --d) {{
        if (++idx[d] < sh[d]) {{ for (int k = 0; k < nk; ++k) o[k] += st[k][d]; return; }}
        idx[d] = 0;
        for (int k = 0; k < nk; ++k) o[k] -= (sh[d] - 1) * st[k][d];
    }}
}}

/* ordered sum of x over the dims where rsh > 1 (kept dims: ksh), for every kept index: the
   reduced elements in row-major order, the last reduced dim of more than one element as an
   inner run (stride t), an odometer over the others */
static void opg_osum(int r, const float *x, const int64_t *ksh, const int64_t *rsh,
                     const int64_t *xs, float *out, int rnd) {{
    int64_t K = 1, R = 1, rs[r > 0 ? r : 1], rt[r > 0 ? r : 1];
    int nr = 0;
    for (int d = 0; d < r; ++d) {{
        K *= ksh[d]; R *= rsh[d];
        if (rsh[d] > 1) {{ rs[nr] = rsh[d]; rt[nr] = xs[d]; ++nr; }}
    }}
    const int64_t m = nr ? rs[nr - 1] : 1, t = nr ? rt[nr - 1] : 0;
    const int64_t nb = (R + {BLOCK} - 1) / {BLOCK};
    float part[nb > 0 ? nb : 1], acc[{LANES}];
    int64_t kidx[r > 0 ? r : 1], ko = 0;
    for (int d = 0; d < r; ++d) kidx[d] = 0;
    const int64_t *kst[1] = {{xs}}, *rst[1] = {{rt}};
    if (R >= 1 && R <= {LANES}) {{  /* each element in a lane of its own: the sum is the lanes'
        tree, folded for 64 kept indices at a time in vector registers (not a tree per index) */
        float a[{LANES}][64];
        int64_t roff[{LANES}], ridx[r > 0 ? r : 1], ro = 0, g = 0;
        for (int d = 0; d < nr; ++d) ridx[d] = 0;
        while (g < R) {{  /* the reduced elements' offsets, in the order the lanes take them */
            for (int64_t j = 0; j < m; ++j) roff[g++] = ro + j * t;
            opg_step(nr > 1 ? nr - 1 : 0, rs, ridx, 1, &ro, rst);
        }}
        int64_t run = 1, unit = 1;  /* whether the kept indices are one run of stride 1 */
        for (int d = r - 1; d >= 0; --d)
            if (ksh[d] > 1) {{ unit &= xs[d] == run; run *= ksh[d]; }}
        for (int64_t k0 = 0; k0 < K; k0 += 64) {{
            const int64_t kn = K - k0 < 64 ? K - k0 : 64;
            for (int64_t i = 0; unit && i < R; ++i) {{  /* a row of the chunk at a time */
                const float *const xi = x + k0 + roff[i];
                int64_t c = 0;
#if defined(OPG_VEC)
                for (; c + OPG_W <= kn; c += OPG_W) opg_v_st_f32(&a[i][c], opg_v_ld_f32(xi + c));
#endif
                for (; c < kn; ++c) a[i][c] = xi[c];
                for (; c < 64; ++c) a[i][c] = 0.0f;
            }}
            for (int64_t c = 0; !unit && c < 64; ++c) {{  /* else index by index */
                for (int64_t i = 0; i < R; ++i) a[i][c] = c < kn ? x[ko + roff[i]] : 0.0f;
                if (c < kn) opg_step(r, ksh, kidx, 1, &ko, kst);
            }}
            opg_fold_cols(&a[0][0], R, 64);  /* opg_tree on every kept index's lanes */
            for (int64_t c = 0; c < kn; ++c)
                out[k0 + c] = rnd == 1 ? opg_rnd_f16(a[0][c]) : rnd == 2 ? opg_rnd_bf16(a[0][c]) : a[0][c];
        }}
        return;
    }}
    for (int64_t k = 0; k < K; ++k) {{
        int64_t ridx[r > 0 ? r : 1], ro = ko, i = 0, b = 0;
        for (int d = 0; d < nr; ++d) ridx[d] = 0;
        for (int64_t g = 0; g < R; ) {{
            for (int64_t j = 0; j < m; ++j, ++g) {{
                const float v = x[ro + j * t];
                if (i < {LANES}) acc[i] = v; else acc[i % {LANES}] += v;
                if (++i == {BLOCK} || g + 1 == R) {{
                    part[b++] = opg_tree(acc, i < {LANES} ? i : {LANES});
                    i = 0;
                }}
            }}
            opg_step(nr > 1 ? nr - 1 : 0, rs, ridx, 1, &ro, rst);
        }}
        const float s = R == 0 ? 0.0f : opg_tree(part, nb);
        out[k] = rnd == 1 ? opg_rnd_f16(s) : rnd == 2 ? opg_rnd_bf16(s) : s;
        opg_step(r, ksh, kidx, 1, &ko, kst);
    }}
}}
"""


def _contig(shape: Sequence[int]) -> list[int]:
    return list(row_major_strides(tuple(shape)))


class Prologue:
    """The instructions of ``body`` that the registers ``needed`` depend on (``types``: every
    register's dtype and shape), as C plus its run-time table.

    ``small``: indices of the inputs the prologue reads (the call passes their data pointers in
    this order); ``regs[name]``: (scratch offset, shape, element strides in the scratch);
    ``scratch``: float32 elements to allocate; ``table``: the int64 values ``tab`` holds;
    ``source``: the C function."""

    def __init__(self, body: Sequence[Instr], types: dict, inputs: Sequence[np.ndarray],
                 needed: Sequence[str]):
        want = _closure(body, needed)
        self.table: list[int] = [0]  # tab[0]: scratch size, filled in at the end
        self.regs: dict[str, tuple[int, tuple[int, ...], list[int]]] = {}
        self.small: tuple[int, ...] = ()
        self._ints: dict[str, tuple[int, DataType, int]] = {}  # name -> (pointer, dtype, strides)
        self._const: dict[str, float] = {}  # fill registers (and their views): the value
        self._scratch = 0
        lines: list[str] = []
        for name in sorted((r for r in want if r.startswith("in")), key=lambda r: int(r[2:])):
            lines += self._input(name, types[name], inputs[int(name[2:])])
        for k, ins in enumerate(body):
            if f"t{k}" in want:
                lines += self._instr(f"t{k}", ins, types)
        if any(r not in self.regs for r in needed):  # (an integer input as a result, say)
            raise Unsupported("a result is not a float register")
        self.hoisted_at = tuple(self._put([self.regs[r][0]]) for r in needed)
        self.table[0] = max(self._scratch, 1)
        self.scratch = self.table[0]
        self.source = "\n".join(["static void opg_prologue(const int64_t *tab, void *const *small, "
                                 "float *scr)", "{", "    (void)tab; (void)small; (void)scr;"]
                                + ["    " + s for s in lines] + ["}", ""])

    # --- table helpers ------------------------------------------------------------------------
    def _put(self, values: Sequence[int]) -> int:
        at = len(self.table)
        self.table += [int(v) for v in values]
        return at

    def _alloc(self, name: str, shape: tuple[int, ...]) -> int:
        off = self._scratch
        self._scratch += math.prod(shape)
        self.regs[name] = (off, shape, _contig(shape))
        return self._put([off])

    def kernel_strides(self, reg: str, shape: Sequence[int]) -> list[int]:
        """Element strides (in the scratch) of register ``reg`` broadcast to ``shape``."""
        return self._view(reg, shape)

    def _view(self, reg: str, shape: Sequence[int]) -> list[int]:
        """Element strides of register ``reg`` broadcast (right-aligned) to ``shape``."""
        _, rshape, rst = self.regs[reg]
        pad = len(shape) - len(rshape)
        return [0 if d < pad or rshape[d - pad] == 1 else rst[d - pad] for d in range(len(shape))]

    # --- code -------------------------------------------------------------------------------
    def _input(self, name: str, typ: tuple, x: np.ndarray) -> list[str]:
        dtype, shape = typ
        if any(s % x.itemsize for s in x.strides):
            raise Unsupported("a per-channel input's strides are not a multiple of its element size")
        if dtype not in FLOATS and dtype not in INT_C:
            raise Unsupported(f"per-channel input {name} is {dtype.short}")
        k = len(self.small)
        self.small += (int(name[2:]),)
        st = [s // x.itemsize for s in x.strides]
        if dtype in INT_C:
            self._ints[name] = (k, dtype, st)
            return []
        at = self._alloc(name, tuple(shape))
        vector = ([(V_LOAD[dtype].format("(x + p[0])"), f"opg_v_set1({LOAD[dtype].format('x[p[0]]')})")],
                  "opg_v_st_f32(&o[e], a0);")
        return [f"{{ /* {name}: {dtype.short}{list(shape)} */",
                f"    const {IN_C[dtype]} *x = (const {IN_C[dtype]} *)small[{k}];",
                f"    float *o = scr + tab[{at}];",
                *self._loop(shape, [st], f"o[e] = {LOAD[dtype].format(f'x[{_at(0)}]')};", vector),
                "}"]

    def _loop(self, shape: Sequence[int], views: Sequence[Sequence[int]], stmt: str,
              vector: Optional[tuple[Sequence[tuple[str, str]], str]] = None) -> list[str]:
        """A loop over ``shape`` writing ``o[e]`` row-major; operand k (element strides
        ``views[k]``) is read at :func:`_at` ``(k)``. Its size-1 dims are left out (this code
        runs only where they are 1: a plan is per layout, and a resized launch keeps every size
        of the prologue's registers), so a [1, C, 1, 1] register is one run of C. The sizes and
        strides go in the table; the last dim left is a plain inner loop (``j``, operand k
        moving by ``qk``); an odometer steps the outer dims once per row.
        ``vector``: ``(operands, statement)`` — where every operand's inner stride is 0 or 1 (a
        per-channel row, a constant), the rows go ``OPG_W`` at a time with operand k as vector
        ``a<k>``: ``operands[k]`` = (its C vector at ``j`` for stride 1, the one for stride 0),
        and the statement storing ``o[e...]``: the same correctly rounded operation on every
        lane, so the same bits (BatchNormGatherStatsWithCounts' body runs ~30 instructions on
        [W, C] rows)."""
        keep = [d for d, n in enumerate(shape) if n != 1]
        r, sh = len(keep), self._put([shape[d] for d in keep])
        strides = [self._put([v[d] for d in keep]) for v in views]
        nk = max(len(strides), 1)
        st = ", ".join(f"tab + {s}" for s in strides) or "tab"
        inner = f"tab[{sh} + {r - 1}]" if r else "1"
        steps = " ".join(f"const int64_t q{k} = {f'st[{k}][{r - 1}]' if r else '0'};" for k in range(nk))
        L = [f"    int64_t n = 1, idx[{max(r, 1)}] = {{0}}, p[{nk}] = {{0}};",
             f"    const int64_t *const st[{nk}] = {{{st}}};",
             f"    for (int d = 0; d < {r}; ++d) n *= tab[{sh} + d];",
             f"    const int64_t m = {inner}; {steps}"]
        if vector is not None:
            operands, vstmt = vector
            unit = " && ".join(f"(uint64_t)q{k} <= 1u" for k in range(len(operands))) or "1"
            L += ["#if defined(OPG_VEC)", f"    const int unit = {unit};", "#endif"]
        L += ["    for (int64_t e = 0; e < n; ) {", "        int64_t j = 0;"]
        if vector is not None:
            L += ["#if defined(OPG_VEC)",
                  "        for (; unit && j + OPG_W <= m; j += OPG_W, e += OPG_W) {"]
            L += [f"            const opg_v a{k} = q{k} ? {row} : {one};" for k, (row, one) in enumerate(operands)]
            L += [f"            {vstmt}", "        }", "#endif"]
        return L + ["        for (; j < m; ++j, ++e) {",
                    f"            {stmt}",
                    "        }",
                    f"        opg_step({max(r - 1, 0)}, tab + {sh}, idx, {nk}, p, st);",
                    "    }"]

    def _instr(self, name: str, ins: Instr, types: dict) -> list[str]:
        dtype, shape = types[name]
        shape = tuple(shape)
        if dtype not in FLOATS and not (ins.op == "eq" and dtype == DataType.BOOL):
            raise Unsupported(f"{ins.render(name)}: {dtype.short} register")
        if ins.op == "fill":
            value = np.asarray(ins.value, dtype.np).astype(np.float32)
            self._const[name] = float(value)
            bits = int(value.view(np.uint32))
            if math.prod(shape) > 1:  # every element written: the kernel reads a per-channel
                at = self._alloc(name, shape)  # constant by the strides of the other per-channel
                sh = self._put(shape)          # registers (a stride-0 one among them would put
                return [f"{{ /* {ins.render(name)} */",  # it off the vector paths)
                        f"    float *const o = scr + tab[{at}];",
                        "    int64_t n = 1;",
                        f"    for (int d = 0; d < {len(shape)}; ++d) n *= tab[{sh} + d];",
                        f"    for (int64_t e = 0; e < n; ++e) o[e] = opg_f(0x{bits:08X}u);", "}"]
            off = self._scratch
            self._scratch += 1
            self.regs[name] = (off, shape, [0] * len(shape))
            at = self._put([off])
            return [f"scr[tab[{at}]] = opg_f(0x{bits:08X}u);  /* {ins.render(name)} */"]
        if ins.op == "view":
            if ins.args[0] not in self.regs:
                raise Unsupported(f"{ins.render(name)}: view of a register not in the prologue")
            off, src_shape, src_st = self.regs[ins.args[0]]
            if ins.args[0] in self._const:
                self._const[name] = self._const[ins.args[0]]
            if not any(src_st):  # a one-element constant (fill) stays read with stride 0
                self.regs[name] = (off, shape, [0] * len(shape))
            elif src_st == _contig(src_shape):
                self.regs[name] = (off, shape, _contig(shape))
            else:
                raise Unsupported(f"{ins.render(name)}: view of a non-contiguous register")
            return []
        if ins.op == "cast" and ins.args[0] in self._ints:
            k, src, st = self._ints[ins.args[0]]
            if dtype != DataType.FLOAT:
                raise Unsupported(f"{ins.render(name)}: integer cast to {dtype.short}")
            at = self._alloc(name, shape)
            return [f"{{ /* {ins.render(name)} */",
                    f"    const {INT_C[src]} *x = (const {INT_C[src]} *)small[{k}];",
                    f"    float *o = scr + tab[{at}];",
                    *self._loop(shape, [st], f"o[e] = (float)x[{_at(0)}];"), "}"]
        if any(r not in self.regs for r in ins.args):
            raise Unsupported(f"{ins.render(name)}: operand not in the prologue")
        if ins.op == "sum":
            return self._sum(name, ins, types, dtype, shape)
        if (ins.op not in _SCALAR and ins.op not in C_OP and ins.op != "pow"
                or ins.op == "fma" and dtype != DataType.FLOAT):
            raise Unsupported(f"{ins.render(name)}: {ins.op} in the prologue")
        if ins.op == "pow" and self._const.get(ins.args[1]) not in _POW:
            raise Unsupported(f"{ins.render(name)}: pow other than by a constant " + ", ".join(map(str, _POW)))
        at = self._alloc(name, shape)
        slots = [self._put([self.regs[r][0]]) for r in ins.args]
        loads = [f"v{k}[{_at(k)}]" for k in range(len(slots))]  # v<k>: operand k's register
        power = self._const[ins.args[1]] if ins.op == "pow" else None
        expr = (_POW[power].format(loads[0]) if ins.op == "pow"
                else _SCALAR[ins.op].format(*loads) if ins.op in _SCALAR else f" {C_OP[ins.op]} ".join(loads))
        vexpr = _vector_expr(ins.op, power)
        if ins.op not in ("eq", "where"):  # where picks values that already have the dtype
            expr = ROUND[dtype].format(expr)
            vexpr = vexpr and V_ROUND[dtype].format(vexpr)
        vector = ([(f"opg_v_ld_f32(&v{k}[p[{k}] + j])", f"opg_v_set1(v{k}[p[{k}]])") for k in range(len(slots))],
                  f"opg_v_st_f32(&o[e], {vexpr});") if vexpr else None
        return [f"{{ /* {ins.render(name)} */",
                f"    float *o = scr + tab[{at}];",
                *[f"    const float *const v{k} = scr + tab[{slot}];" for k, slot in enumerate(slots)],
                *self._loop(shape, [self._view(r, shape) for r in ins.args], f"o[e] = {expr};", vector), "}"]

    def _sum(self, name: str, ins: Instr, types: dict, dtype: DataType, shape: tuple) -> list[str]:
        src = tuple(ins.over) if ins.over is not None else tuple(types[ins.args[0]][1])
        r = len(src)
        if ins.shape is None:
            kept = [1] * r
        else:
            kept = [o if o == n else 1 for o, n in zip(ins.shape, src)]
        red = [n if k == 1 else 1 for n, k in zip(src, kept)]
        at = self._alloc(name, shape)
        ks, rs = self._put(kept), self._put(red)
        xs = self._put(self._view(ins.args[0], src))
        xo = self._put([self.regs[ins.args[0]][0]])
        rnd = {DataType.FLOAT: 0, DataType.FLOAT16: 1, DataType.BF16: 2}[dtype]
        return [f"opg_osum({r}, scr + tab[{xo}], tab + {ks}, tab + {rs}, tab + {xs}, scr + tab[{at}], "
                f"{rnd});  /* {ins.render(name)} */"]


def _at(k: int) -> str:
    """The element index of operand ``k`` in :meth:`Prologue._loop`'s inner loop."""
    return f"(p[{k}] + j * q{k})"


# the vector forms of the instructions :meth:`Prologue._loop` runs OPG_W elements at a time, on
# operands a0, a1 (each correctly rounded, as the scalar forms); pow by the 950's constants
_V_SCALAR = {"cast": "a0", "sqrt": "opg_v_sqrt(a0)"}
_V_POW = {-0.5: "opg_v_div(opg_v_set1(1.0f), opg_v_sqrt(a0))", 0.5: "opg_v_sqrt(a0)",
          2.0: "opg_v_mul(a0, a0)", -1.0: "opg_v_div(opg_v_set1(1.0f), a0)", 1.0: "a0",
          0.0: "opg_v_set1(1.0f)"}


def _vector_expr(op: str, power: Optional[float]) -> str:
    """The vector form of instruction ``op`` (``power``: pow's exponent), or "" (scalar only:
    max, fma, eq, where keep numpy's scalar semantics)."""
    if op == "pow":
        return _V_POW.get(power, "")
    if op in V_OP:
        return f"{V_OP[op]}(a0, a1)"
    return _V_SCALAR.get(op, "")


def _closure(body: Sequence[Instr], needed: Sequence[str]) -> set[str]:
    """The registers ``needed`` and every register their hoisted instructions read."""
    want: set[str] = set()
    stack = list(needed)
    while stack:
        r = stack.pop()
        if r in want:
            continue
        want.add(r)
        if r.startswith("t"):
            stack += list(body[int(r[1:])].args)
    return want


def render_fused(p: Plan, prologue: str, nsmall: int, hoisted_at: Sequence[int]) -> str:
    """:func:`.render.render` plus ``prologue`` (:attr:`Prologue.source`) and the entry
    ``int opg_fused(ndim, shape, strides, block, run, tab, ptrs)``: ``ptrs`` lists the
    ``nsmall`` inputs the prologue reads, the big inputs, then the output; hoisted register k is
    read at scratch offset ``tab[hoisted_at[k]]``. Returns 1 when the scratch cannot be allocated."""
    nb, nh = len(p.big), len(p.hoisted)
    lines = [render(p), "#include <stdlib.h>", HELPERS, prologue,
             "int opg_fused(int64_t ndim, const int64_t *shape, const int64_t *st, int64_t block,",
             "              opg_run run, const int64_t *tab, void *const *ptrs)", "{",
             "    float local[256];",
             "    float *const scr = tab[0] <= 256 ? local : (float *)malloc((size_t)tab[0] * sizeof(float));",
             "    if (scr == 0) return 1;",
             "    opg_prologue(tab, ptrs, scr);",
             f"    void *kp[{nb + nh + 1}];"]
    lines += [f"    kp[{k}] = ptrs[{nsmall + k}];" for k in range(nb)]
    lines += [f"    kp[{nb + k}] = scr + tab[{at}];" for k, at in enumerate(hoisted_at)]
    lines += [f"    kp[{nb + nh}] = ptrs[{nsmall + nb}];",
              "    opg_kernel(ndim, shape, (void *const *)kp, st, block, run);",
              "    if (scr != local) free(scr);",
              "    return 0;", "}", ""]
    return "\n".join(lines)


__all__ = ["HELPERS", "Prologue", "render_fused"]
