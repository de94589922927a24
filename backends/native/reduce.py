"""FusedReduce on the native backend: the reductions run as compiled C (OpenMP over channels ×
blocks), bit-identical to numpy and the same for any thread count.

A reduction pass computes the per-element instructions its sums need and adds them into the 64
lane accumulators of each (kept index, block) — the order of :mod:`l0ops.ordered`; every work
item owns its lanes, so threads never race and never change the order. numpy then folds the
lanes and blocks (a few values per channel) with the same :func:`~l0ops.ordered.tree_fold`, and
runs the per-channel instructions between passes (a variance's mean, the epilogue). Sums that
need only inputs and finished per-channel values share one pass over the data.

    >>> import numpy as np
    >>> from l0ops.fused_reduce import FusedReduceAttrs, Instr
    >>> from opgraph.core.dtypes import DataType as D
    >>> body = (Instr(op="mul", args=("in0", "in0"), dtype=D.FLOAT),
    ...         Instr(op="sum", args=("t0",), dtype=D.FLOAT, shape=(1, 3, 1)))
    >>> a = FusedReduceAttrs(body=body, results=("t1",), out_shapes=((3,),))
    >>> x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    >>> ok = __import__("backends.native.build", fromlist=["_"]).availability()[0]
    >>> (run_fused_reduce_native(a, [x])[0] if ok else (x.astype(np.float64) ** 2).sum((0, 2))).tolist()
    [748.0, 1356.0, 2220.0]
"""
from __future__ import annotations

import ctypes
import math
from typing import Sequence

import numpy as np

from l0ops.fused_reduce import FusedReduceAttrs
from l0ops.ordered import BLOCK, LANES, tree_fold
from l0ops.primitives import Instr, body_types, cast_array, compile_instr
from opgraph.core.dtypes import DataType, dtype_of
from opgraph.core.types import TensorType
from . import build
from .render import C_OP, C_TYPE, FLOATS, HELPERS, LOAD, ROUND, Unsupported

_ARGTYPES = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]


def render_pass(big: Sequence[tuple[str, DataType]], kept: Sequence[str],
                live: Sequence[tuple[str, Instr]], sums: Sequence[str]) -> str:
    """C for one pass: ``opg_kernel(K, R, nr, rshape, ptrs, koff, rstr, lanes, nblocks)``.

    ptrs: big inputs, then per-kept float32 registers ([K] each); koff[i*K + k]: element offset of
    big input i at kept index k; rstr[i*nr + d]: its stride along reduced dim d; lanes:
    float[len(sums)][K][nblocks][64]."""
    nb, S = len(big), len(sums)
    body = []
    for i, (r, d) in enumerate(big):
        body.append(f"const float r_{r} = {LOAD[d].format(f'b{i}[o{i}]')};")
    for dst, ins in live:
        args = [f"r_{x}" for x in ins.args]
        expr = args[0] if ins.op == "cast" else f" {C_OP[ins.op]} ".join(args)
        body.append(f"const float r_{dst} = {ROUND[ins.dtype].format(expr)};")
    lines = [HELPERS, "void opg_kernel(int64_t K, int64_t R, int64_t nr, const int64_t *rshape,",
             "                void *const *ptrs, const int64_t *koff, const int64_t *rstr,",
             "                float *lanes, int64_t nblocks)", "{"]
    for i, (_, d) in enumerate(big):
        lines.append(f"    const {C_TYPE[d]} *const b{i} = (const {C_TYPE[d]} *)ptrs[{i}];")
    for j, _ in enumerate(kept):
        lines.append(f"    const float *const h{j} = (const float *)ptrs[{nb + j}];")
    lines += ["    const int64_t inner = rshape[nr - 1];",
              "    #pragma omp parallel for schedule(dynamic, 1) if (K * nblocks > 1 && K * R >= 32768)",
              "    for (int64_t w = 0; w < K * nblocks; ++w) {",
              "        const int64_t k = w / nblocks, blk = w % nblocks;",
              f"        float acc[{max(S, 1)}][64];",
              f"        for (int s = 0; s < {S}; ++s) for (int l = 0; l < 64; ++l) acc[s][l] = -0.0f;",
              f"        const int64_t r1 = (blk + 1) * {BLOCK} < R ? (blk + 1) * {BLOCK} : R;"]
    lines += [f"        const float r_{r} = h{j}[k];" for j, r in enumerate(kept)]
    lines += [f"        int64_t r = blk * {BLOCK};",
              "        while (r < r1) {",
              "            int64_t rest = r / inner, t0 = r % inner;",
              f"            int64_t {', '.join(f'p{i} = koff[{i} * K + k]' for i in range(nb)) or 'unused = 0'};",
              "            for (int64_t d = nr - 2; d >= 0; --d) {",
              "                const int64_t idx = rest % rshape[d];",
              "                rest /= rshape[d];",
              "                " + " ".join(f"p{i} += idx * rstr[{i} * nr + d];" for i in range(nb)),
              "            }",
              "            const int64_t run = inner - t0 < r1 - r ? inner - t0 : r1 - r;"]
    lines += [f"            const int64_t q{i} = rstr[{i} * nr + nr - 1];" for i in range(nb)]
    lines += ["            for (int64_t t = 0; t < run; ++t) {"]
    lines += [f"                const int64_t o{i} = p{i} + (t0 + t) * q{i};" for i in range(nb)]
    lines += ["                " + s for s in body]
    lines += ["                const int l = (int)((r + t) & 63);"]
    lines += [f"                acc[{s}][l] += r_{x};" for s, x in enumerate(sums)]
    lines += ["            }", "            r += run;", "        }"]
    lines += [f"        for (int s = 0; s < {S}; ++s) for (int l = 0; l < 64; ++l)",
              "            lanes[((s * K + k) * nblocks + blk) * 64 + l] = acc[s][l];",
              "    }", "}", ""]
    return "\n".join(lines)


def _closure(body: Sequence[Instr], reg: str, full: set[str]) -> list[int]:
    """Indices of the full-size instructions ``reg`` depends on, in body order."""
    need, stack = set(), [reg]
    while stack:
        r = stack.pop()
        if r.startswith("t") and r in full and int(r[1:]) not in need:
            need.add(int(r[1:]))
            stack.extend(body[int(r[1:])].args)
    return sorted(need)


def run_fused_reduce_native(a: FusedReduceAttrs, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The results of ``a`` on ``inputs``; :class:`Unsupported` for bodies the C pass does not
    cover (full-size results, reductions over different axes, non-float data)."""
    in_types = [TensorType(np.shape(x), dtype_of(np.asarray(x).dtype)) for x in inputs]
    types = body_types(a.body, in_types)
    sums = [(k, ins) for k, ins in enumerate(a.body) if ins.op == "sum" and ins.shape is not None]
    if not sums:
        raise Unsupported("no partial reduction")
    def summed(ins: Instr) -> tuple[int, ...]:
        return tuple(ins.over) if ins.over is not None else types[ins.args[0]][1]
    full_shape = summed(sums[0][1])
    kept_shape = tuple(sums[0][1].shape)
    if any(summed(ins) != full_shape or tuple(ins.shape) != kept_shape for _, ins in sums):
        raise Unsupported("reductions over different shapes")
    raxes = [d for d, (n, o) in enumerate(zip(full_shape, kept_shape)) if n != o]
    full = {r for r, (_, s) in types.items()
            if len(s) == len(full_shape) and any(s[d] == full_shape[d] for d in raxes)}
    if any(r in full for r in a.results):
        raise Unsupported("a full-size result")
    K, R = math.prod(kept_shape), math.prod(full_shape[d] for d in raxes)
    values: dict[str, np.ndarray] = {}
    for k, x in enumerate(inputs):
        d = in_types[k].dtype
        values[f"in{k}"] = np.asarray(x).astype(np.float32) if d in (DataType.FLOAT16, DataType.BF16) \
            else np.asarray(x)
    done: set[int] = set()
    for k, ins in enumerate(a.body):
        name = f"t{k}"
        if name in full and ins.op != "sum":
            continue  # computed inside a C pass
        if ins.op == "sum" and ins.shape is not None:
            if k not in done:  # this pass also takes every later sum whose inputs are ready
                batch = [j for j, _ in sums if j not in done
                         and all(r in values for r in _reads(a.body, j, full) if r not in full)]
                _run_pass(a.body, batch, full, values, types, inputs, full_shape, raxes, K, R)
                done.update(batch)
            continue
        values[name] = compile_instr(ins, types)(*[values[r] for r in ins.args])
    out = []
    for r, shape in zip(a.results, a.out_shapes):
        v = np.broadcast_to(cast_array(values[r].astype(types[r][0].np), types[r][0]), types[r][1])
        out.append(v.reshape(shape) if v.size == math.prod(shape) else np.array(np.broadcast_to(v, shape)))
    return out


def _reads(body: Sequence[Instr], j: int, full: set[str]) -> set[str]:
    """The registers the C pass for sum ``j`` reads: its argument and its closure's operands."""
    return {r for i in _closure(body, body[j].args[0], full) for r in body[i].args} | {body[j].args[0]}


def _run_pass(body, batch, full, values, types, inputs, full_shape, raxes, K, R) -> None:
    """One C pass over the data computing the sums ``batch``; stores their folded values."""
    live_idx = sorted({i for j in batch for i in _closure(body, body[j].args[0], full)})
    regs_used = set().union(*(_reads(body, j, full) for j in batch))
    big = sorted((r for r in regs_used if r.startswith("in") and r in full), key=lambda r: int(r[2:]))
    kept = sorted((r for r in regs_used if r not in full), key=str)
    for i in live_idx:
        ins = body[i]
        if ins.op not in C_OP and ins.op != "cast" or ins.dtype not in FLOATS:
            raise Unsupported(f"{ins.render(f't{i}')} per element")
    if any(types[r][0] not in FLOATS for r in big) or not all(r in values for r in kept):
        raise Unsupported("operand dtype or order")
    kdims = [d for d in range(len(full_shape)) if d not in raxes]
    kshape = tuple(full_shape[d] for d in kdims)
    arrays = [np.asarray(inputs[int(r[2:])]) for r in big]
    koff = np.zeros((max(len(big), 1), K), np.int64)
    rstr = np.zeros((max(len(big), 1), len(raxes)), np.int64)
    for i, x in enumerate(arrays):
        xb = np.broadcast_to(x, full_shape)
        if any(s % xb.itemsize for s in xb.strides):
            raise Unsupported("strides not in whole elements")
        st = [s // xb.itemsize for s in xb.strides]
        grid = np.indices(kshape).reshape(len(kdims), -1) if kdims else np.zeros((0, 1), np.int64)
        koff[i] = sum(grid[j] * st[d] for j, d in enumerate(kdims)) if kdims else 0
        rstr[i] = [st[d] for d in raxes]
    kept_arrays = [np.ascontiguousarray(np.broadcast_to(values[r], tuple(
        1 if d in raxes else n for d, n in enumerate(full_shape))).reshape(K), np.float32) for r in kept]
    nblocks = -(-R // BLOCK)
    lanes = np.empty((len(batch), K, nblocks, LANES), np.float32)
    src = render_pass([(r, types[r][0]) for r in big], kept,
                      [(f"t{i}", body[i]) for i in live_idx], [body[j].args[0] for j in batch])
    fn = build.load(src).fn
    if fn.argtypes is None:
        fn.argtypes, fn.restype = _ARGTYPES, None
    ptrs = np.asarray([x.__array_interface__["data"][0] for x in arrays + kept_arrays], np.uintp)
    rshape = np.asarray([full_shape[d] for d in raxes], np.int64)
    fn(K, R, len(raxes), rshape.ctypes.data, ptrs.ctypes.data, koff.ctypes.data, rstr.ctypes.data,
       lanes.ctypes.data, nblocks)
    last = R - (nblocks - 1) * BLOCK
    for s, j in enumerate(batch):
        per_block = np.empty((K, nblocks), np.float32)
        if nblocks > 1:
            per_block[:, :-1] = tree_fold(lanes[s, :, :-1, :])
        per_block[:, -1] = tree_fold(lanes[s, :, -1, :min(LANES, last)])
        total = tree_fold(per_block)
        ins = body[j]
        d = ins.dtype
        total = total.astype(d.np) if d in (DataType.FLOAT16, DataType.BF16) else total
        values[f"t{j}"] = np.asarray(total, np.float32 if d in FLOATS else d.np).reshape(ins.shape)
