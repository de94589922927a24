"""The numpy interpreter of a fused body (:class:`~l0ops.primitives.FusedAttrs`): a
:class:`Program` per body and operand (dtype, shape)s, run straight through for small tensors
and chunk by chunk otherwise — broadcast inputs read by stride, the per-channel part hoisted and
computed once, blocks of rows or chunks within one channel (:mod:`.chunking`), temporaries kept
per thread, and the chunks of a large body shared among worker threads (:mod:`.workers`). A
program for new sizes of a body seen before is renamed from the last one, not checked and
compiled again (:meth:`Program.resized`). Results are bit-identical whatever the chunking and
thread count (tests/test_fused_chunks.py, tests/test_row_blocks.py, tests/test_numpy_workers.py).

    >>> import numpy as np
    >>> from opgraph.core.dtypes import DataType as D
    >>> body = (Instr(op="sub", args=("in0", "in1"), dtype=D.FLOAT16),)
    >>> a = FusedAttrs(shape=(2, 2), body=body, result="t0", out_dtype=D.FLOAT16)
    >>> run_fused(a, [np.float16([[1, 2], [3, 4]]), np.float16([[1], [1]])]).tolist()
    [[0.0, 1.0], [2.0, 3.0]]
"""
from __future__ import annotations

import math
import threading
from typing import Any, Callable, Sequence

import numpy as np

from opgraph.core.dtypes import DataType, dtype_of
from .chunking import chunks, expand_part, part_shape, per_block_dims, picker, row_blocks
from .primitives import (ARITH, BF16, F16, F32, FusedAttrs, IdentityMemo, Instr, Sig, cast_array,
                         compile_instr, reg_types)
from .rounding import widen
from .straight_line import straight_line
from .workers import PARALLEL_ELEMS, run_split

CHUNK_ELEMS = 1 << 15  # 128 KiB float32 chunks: fewer Python steps, still cache-resident
# chunks within one channel: bigger, as numpy's per-call set-up on strided blocks outweighs what
# cache residency saves (32x64x56x56 fp32 ElemtBackward: 16.1 ms at 2**15, 11.2 ms at 2**17)
CHANNEL_CHUNK_ELEMS = 1 << 17
# blocks of rows (chunking.row_blocks): at most ROW_CHUNK_ELEMS elements, within parts of a row of
# at most ROW_PART_ELEMS (32x64x56x56 fp32 ElemtBackward on 2 threads: 5.1 ms, 5.9 within channels)
ROW_CHUNK_ELEMS = 1 << 18
ROW_PART_ELEMS = 1 << 18
WHOLE_ELEMS = 1 << 19  # up to this many elements a body runs as one chunk (8x64x28x28: 0.74 ms, not 1.1)
FLAT_ELEMS = 4096  # at most this many elements: the body runs straight through (run_flat)
_NARROW = frozenset({F16, BF16})  # held as float32 registers
IN_PLACE = frozenset({F32, F16})  # arithmetic that writes a given float32 buffer (f16: rounded there)


_PLAN_LOCK = threading.Lock()


def renaming(old: Sequence[tuple[int, ...]], new: Sequence[tuple[int, ...]],
             fixed: "frozenset[int]" = frozenset()) -> "dict[int, int] | None":
    """The one-to-one renaming of dim values taking the shapes ``old`` to ``new`` (0 and 1 only
    to themselves, every value in ``fixed`` to itself), or None when there is none. Checks of a
    body on broadcasting come out the same on both sides of such a renaming.

        >>> renaming([(2, 3), (3,)], [(5, 3), (3,)]), renaming([(2, 3)], [(3, 3)])
        ({2: 5, 3: 3}, None)
    """
    if len(old) != len(new):
        return None
    rename: dict[int, int] = {}
    for a, b in set(zip(old, new)):  # operands often share shapes: each pair once
        if len(a) != len(b):
            return None
        for n, m in zip(a, b):
            if ((n <= 1 or m <= 1) and n != m) or rename.setdefault(n, m) != m:
                return None
    if len(set(rename.values())) != len(rename) or any(rename.get(n, n) != n for n in fixed):
        return None
    return rename


class Program:
    """A fused body compiled for given operand (dtype, shape)s: every instruction as a numpy
    callable, split into the ``hoisted`` part (does not vary over the iteration space: small
    inputs, per-channel terms) and the ``live`` part run per element. Built once and cached."""

    def __init__(self, a: FusedAttrs, sigs: Sequence["Sig"]):
        self.types = reg_types(a, sigs)
        self.full = tuple(a.shape)
        self.result, self.result_dtype, self.out_dtype = a.result, self.types[a.result][0], a.out_dtype
        fns = [compile_instr(ins, self.types) for ins in a.body]  # shared by both run paths
        self._plan_flat(a, sigs, fns)
        self._body, self._fns = a.body, fns
        self._pending = (a, sigs)  # the chunked path's plan: built on first use
        self.dtypes = tuple(sg.dtype for sg in sigs)
        self.shapes = tuple(sg.shape for sg in sigs) + (self.full,)
        self._family: list = []  # the first chunk plan of this program or one resized from it
        # sizes the body fixes: its constant shapes, and what view and sum instructions read
        fixed = [ins.shape or () for ins in a.body] + [ins.over or () for ins in a.body]
        fixed += [self.types[ins.args[0]][1] for ins in a.body if ins.op in ("view", "sum")]
        self.pinned = frozenset(n for shape in fixed for n in shape)

    def resized(self, a: FusedAttrs, shapes: Sequence[tuple[int, ...]]) -> "Program | None":
        """This program for the same body and operand dtypes at operand ``shapes``, or None
        unless they are this one's with each dim value renamed one to one (0, 1 staying) and
        every size the body fixes unchanged. Then every check of the body gives what it gave
        here and every compiled instruction is the same: only the register shapes are renamed
        (when first read). A new batch size of a known structure skips type check and compile."""
        shapes = (*shapes, tuple(a.shape))
        if a.body is not self._body or a.result != self.result or a.out_dtype != self.out_dtype:
            return None
        rename = renaming(self.shapes, shapes, self.pinned)
        if rename is None:
            return None
        made = object.__new__(Program)
        made.__dict__.update(
            full=shapes[-1], result=self.result, result_dtype=self.result_dtype,
            out_dtype=self.out_dtype, flat=self.flat, flat_result=self.flat_result,
            flat_store=self.flat_store,
            narrow_inputs=self.narrow_inputs, dtypes=self.dtypes, shapes=shapes,
            pinned=self.pinned, _body=self._body, _fns=self._fns, _pending=(a, None),
            _renamed=(self.types, rename), _family=self._family)
        if "flat_call" in self.__dict__:  # generated already: the same steps
            made.flat_call = self.flat_call
        if self._family:  # a chunk plan made at another size: the same but for the shapes
            plan, align = self._family[0]
            made.__dict__.update(plan)
            made.align = [(r, tuple([rename.get(n, n) for n in shape])) for r, shape in align]
            made._pending = None
        return made

    def __getattr__(self, name: str) -> Any:
        """What is built when first asked for: the straight run's generated function
        (``flat_call``), a renamed program's register ``types``, and the chunked path's plan
        (:meth:`_plan_chunks`) — a small tensor (a new size of a known structure, say) only ever
        runs :meth:`run_flat`, a large one never. The plan is made on a staging object and
        published at once, so another thread never reads it half built."""
        if name == "flat_call":  # generated on the first straight run (~0.2 ms: not for chunked runs)
            self.flat_call = straight_line(self.flat, self.narrow_inputs, self.flat_result, self.flat_store)
            return self.flat_call
        if name == "types" and "_renamed" in self.__dict__:
            types, rename = self._renamed
            self.types = {r: (d, tuple([rename.get(n, n) for n in shape]))
                          for r, (d, shape) in types.items()}
            return self.types
        if name.startswith("__"):
            raise AttributeError(name)
        if self.__dict__.get("_pending") is None:  # no plan to build: built, maybe just now
            if name in self.__dict__:  # (another thread published it after this lookup missed)
                return self.__dict__[name]
            raise AttributeError(name)
        with _PLAN_LOCK:
            pending = self.__dict__.get("_pending")
            if pending is not None:
                a, sigs = pending
                if sigs is None:
                    sigs = [Sig(d, s) for d, s in zip(self.dtypes, self.shapes)]
                staged = object.__new__(Program)
                staged.__dict__.update(self.__dict__)
                staged._plan_chunks(a, sigs, self._fns)
                plan = {k: v for k, v in staged.__dict__.items() if k not in self.__dict__}
                self.__dict__.update(plan)
                self.__dict__["_pending"] = None
                if not self._family:  # the plan in the family's first dims, for resized()
                    renamed = self.__dict__.get("_renamed")
                    back = {m: n for n, m in renamed[1].items()} if renamed else {}
                    align = [(r, tuple([back.get(n, n) for n in shape])) for r, shape in self.align]
                    self._family.append(({k: v for k, v in plan.items()
                                          if k not in ("align", "types")}, align))
        return getattr(self, name)

    def _plan_chunks(self, a: FusedAttrs, sigs: Sequence["Sig"], fns: Sequence[Callable]) -> None:
        full = self.full
        self.big = [k for k, sg in enumerate(sigs) if sg.shape == full]
        self.small = [(k, sg.dtype in _NARROW) for k, sg in enumerate(sigs) if sg.shape != full]
        self.big_narrow = [(k, sigs[k].dtype in _NARROW) for k in self.big]
        varying = {f"in{k}" for k in self.big}
        self.hoisted: list[tuple[str, Callable, tuple[str, ...]]] = []
        self.live: list[tuple[str, Instr]] = []
        self.live_steps: list[tuple[str, Callable, tuple[str, ...]]] = []
        for k, ins in enumerate(a.body):
            name, fn = f"t{k}", fns[k]
            if ins.op != "fill" and (any(r in varying for r in ins.args) or self._spreads(name)):
                varying.add(name)
                self.live.append((name, ins))
                self.live_steps.append((name, fn, ins.args))
            else:
                self.hoisted.append((name, fn, ins.args))
        self._plan_in_place(a)
        # hoisted registers the live steps read (everything else they read is live or big)
        self.live_reads = sorted({r for _, ins in self.live for r in ins.args}
                                 - {name for name, _ in self.live} - {f"in{k}" for k in self.big})
        rank = len(full)
        hoisted_names = [f"in{k}" for k, _ in self.small] + [name for name, _, _ in self.hoisted]
        self.align = [(n, (1,) * (rank - len(self.types[n][1])) + self.types[n][1])
                      for n in hoisted_names if 0 < len(self.types[n][1]) < rank]
        # chunks slice the registers of the iteration space's rank; one of a higher rank (a big
        # input the body views into this space), a view per element (a chunk of its source is
        # not the source of the chunk) or a sum of per-element values (it needs them all) cannot
        # be sliced: run those bodies whole
        self.chunkable = (all(len(self.types[r][1]) <= rank for r in self.live_reads)
                          and not any(ins.op in ("view", "sum") for _, ins in self.live))

    def _spreads(self, name: str) -> bool:
        """Whether register ``name``, made from per-channel values only, would be a full-size
        temporary if hoisted: it has the iteration space's shape, and that space has more than
        one dim above 1. A space of one line (every dim but C of size 1, e.g. [1, 64, 1]) holds
        nothing large: its per-channel work is hoisted even where it fills the space."""
        full = self.full
        return self.types[name][1] == full and sum(n > 1 for n in full) > 1

    def _plan_flat(self, a: FusedAttrs, sigs: Sequence["Sig"], fns: Sequence[Callable]) -> None:
        """The whole body as one straight line over a register list (inputs first, then t0,
        t1, ...): what :meth:`run_flat` runs when the iteration space is one chunk."""
        index = {f"in{k}": k for k in range(len(sigs))}
        index.update({f"t{k}": len(sigs) + k for k in range(len(a.body))})
        self.narrow_inputs = tuple(sg.dtype in _NARROW for sg in sigs)
        self.flat = tuple((fn, tuple(index[r] for r in ins.args)) for fn, ins in zip(fns, a.body))
        self.flat_result = index[a.result]
        last = a.body[-1] if a.body else None
        # the last step makes the result, a float32 ufunc over the whole space: run_flat may
        # compute it straight into the output (nothing runs after it, so no operand changes)
        self.flat_store = (last is not None and self.flat_result == len(index) - 1
                           and last.op in ARITH and last.dtype == F32 and a.out_dtype == F32
                           and self.types[a.result][1] == self.full)

    def straight(self) -> bool:
        """Whether :func:`run_fused` runs this program straight through (:meth:`run_flat`): a
        small iteration space, or a body whose chunks cannot be sliced."""
        return math.prod(self.full) <= FLAT_ELEMS or not self.chunkable

    def run_flat(self, inputs: Sequence[np.ndarray], out: "np.ndarray | None" = None) -> "np.ndarray | None":
        """The result of the whole body, instruction by instruction on whole arrays (numpy
        broadcasting right-aligns the per-channel terms): the fast path for small tensors.
        With ``out`` (the full shape and the output dtype) the result is written there and None
        returned: its last step computed straight into it when it can (:attr:`flat_store`),
        as :meth:`run_live` does. The steps run as one generated function
        (:func:`.straight_line.straight_line`, made on the first such run)."""
        res = self.flat_call(*inputs, out)
        if res is None:  # computed in out
            return None
        res = _finish(res, self.result_dtype, self.out_dtype)
        if out is not None:
            out[...] = res
            return None
        return res

    def _plan_in_place(self, a: FusedAttrs) -> None:
        """Per live step, an operand temporary that dies there (its buffer takes the result),
        and whether the result step can write straight into the output chunk."""
        last: dict[str, int] = {}
        for i, (_, ins) in enumerate(self.live):
            for r in ins.args:
                last[r] = i
        temps = {name for name, ins in self.live if ins.op in ARITH}  # fresh buffers (casts may alias)
        self.reuse: list["str | None"] = []
        for i, (name, ins) in enumerate(self.live):
            dying = [r for r in ins.args if r in temps and last.get(r) == i and r != self.result
                     and ins.op in ARITH and ins.dtype in IN_PLACE and self.types[r][0] in IN_PLACE
                     and self.types[r][1] == self.types[name][1]]
            self.reuse.append(dying[0] if dying else None)
        res = self.live[-1] if self.live else None
        self.store_direct = (res is not None and res[0] == self.result and res[1].op in ARITH
                             and res[1].dtype == F32 and self.out_dtype == F32
                             and self.types[self.result][1] == self.full)
        self.fresh_f32 = {name for (name, ins), reuse in zip(self.live, self.reuse)
                          if reuse is None and ins.op in ARITH and ins.dtype in IN_PLACE
                          and self.types[name][1] == self.full}
        self.into_out = self._result_buffer() if self.store_direct else None
        n = len(self.live_steps)
        self.steps = [(fn, args, name, reuse, i == n - 1)
                      for i, ((name, fn, args), reuse) in enumerate(zip(self.live_steps, self.reuse))]

    def _result_buffer(self) -> "str | None":
        """The fresh float32 temporary whose buffer the steps making the result reuse, down to
        an operand of the last step: :meth:`run_live` may compute it in the output chunk itself
        (the result's chain then runs in place there, one temporary less in cache)."""
        made = {name: reuse for (name, _), reuse in zip(self.live, self.reuse)}
        for r in self.live[-1][1].args:
            while made.get(r) is not None:
                r = made[r]  # type: ignore[assignment]
            if r in self.fresh_f32:
                return r
        return None

    def hoist(self, inputs: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        """Evaluate the hoisted part; low-rank values are right-aligned to the full rank."""
        values = {f"in{k}": np.asarray(inputs[k]).astype(np.float32) if narrow else np.asarray(inputs[k])
                  for k, narrow in self.small}
        for name, fn, args in self.hoisted:
            values[name] = fn(*[values[r] for r in args])
        for name, shape in self.align:
            values[name] = values[name].reshape(shape)
        return values

    def load_big(self, inputs: Sequence[np.ndarray], idx: "tuple | None" = None) -> dict[str, np.ndarray]:
        """Full-size inputs (or their chunk ``idx``) as registers."""
        out = {}
        for k, narrow in self.big_narrow:
            x = inputs[k] if idx is None else inputs[k][idx]
            out[f"in{k}"] = widen(x) if narrow else x
        return out

    def run_live(self, regs: dict[str, np.ndarray], out: "np.ndarray | None" = None,
                 scratch: "dict[str, np.ndarray] | None" = None,
                 out_apart: bool = False) -> "np.ndarray | None":
        """Run the live steps on chunk registers. float32 arithmetic reuses dying temporaries'
        buffers, and with ``scratch`` (buffers this thread keeps from chunk to chunk) writes its
        other full-size temporaries there; with ``out`` (the output chunk) the result is written
        there and None returned. ``out_apart``: ``out`` shares no memory with any operand, so
        the result's chain (:attr:`into_out`) may run in it."""
        direct = out is not None and self.store_direct
        into_out = self.into_out if direct and out_apart else None
        for fn, args, name, reuse, last in self.steps:
            operands = [regs[r] for r in args]
            if last and direct:
                fn(*operands, out=out)
                return None
            if reuse is not None:
                regs[name] = fn(*operands, out=regs[reuse])
            elif name == into_out:
                regs[name] = fn(*operands, out=out)
            elif scratch is not None and out is not None and name in self.fresh_f32:
                # chunks of two shapes (a remainder) keep one each
                regs[name] = fn(*operands, out=kept(scratch, (name, out.shape), np.float32))
            else:
                regs[name] = fn(*operands)
        res = _finish(regs[self.result], self.result_dtype, self.out_dtype)
        if out is not None:
            out[...] = res
            return None
        return res


_PROGRAMS = IdentityMemo(limit=1024)
_BY_BODY = IdentityMemo(limit=256)  # the last program made per body object and operand dtypes


def program(a: FusedAttrs, inputs: Sequence[np.ndarray]) -> Program:
    """The cached :class:`Program` of ``a`` for these operands' dtypes and shapes: made anew,
    or renamed from the last one of the same body (:meth:`Program.resized`)."""
    key = tuple([(x.dtype, x.shape) for x in inputs])
    hit = _PROGRAMS.peek(a, key)  # a hit makes no maker closure (~1 µs a cached numpy call)
    return hit if hit is not None else _PROGRAMS.get(a, key, lambda: _make(a, inputs))


def _make(a: FusedAttrs, inputs: Sequence[np.ndarray]) -> Program:
    dtypes = tuple([x.dtype for x in inputs])
    last = _BY_BODY.peek(a.body, dtypes)  # made for these dtypes: only the shapes may differ
    made = last.resized(a, [x.shape for x in inputs]) if last is not None else None
    if made is None:
        made = Program(a, [Sig(dtype_of(x.dtype), x.shape) for x in inputs])
        _BY_BODY.put(a.body, dtypes, made)
    return made


class Hoisted:
    """The per-channel part of a fused body, evaluated once: ``values`` holds every register that
    does not vary over the iteration space; ``live`` lists the instructions left to run per
    element, ``big`` the full-size inputs by register name."""

    def __init__(self, a: FusedAttrs, inputs: Sequence[np.ndarray]):
        prog = program(a, inputs)
        self.types, self.live = prog.types, prog.live
        self.values = prog.hoist(inputs)
        self.big = {f"in{k}": inputs[k] for k in prog.big}


def run_fused(a: FusedAttrs, inputs: Sequence[np.ndarray], out: "np.ndarray | None" = None,
              limit: int = CHUNK_ELEMS, channel_limit: int = CHANNEL_CHUNK_ELEMS,
              whole_limit: int = WHOLE_ELEMS, row_limit: int = ROW_CHUNK_ELEMS,
              part_limit: int = ROW_PART_ELEMS) -> np.ndarray:
    """Evaluate the body chunk by chunk. Instructions on smaller-than-full shapes (per-channel
    terms) are hoisted and computed once; the rest never allocates a full-size temporary.
    Up to ``whole_limit`` elements run as one chunk; otherwise, where the output is apart from
    the inputs and their rows lie in one run each, blocks of rows of at most ~``row_limit``
    elements within row parts of ~``part_limit`` (``row_limit=0``: never); else chunks of at
    most ~``limit`` elements, or ~``channel_limit`` when each lies in one channel (its
    per-channel terms then single values). See :mod:`.chunking`."""
    prog = program(a, inputs)
    full = prog.full
    if prog.straight():  # small: no hoisting, no chunks
        if out is None:  # (not ascontiguousarray, which makes a 0-d result 1-d)
            return np.asarray(np.broadcast_to(prog.run_flat(inputs), full), order="C")
        prog.run_flat(inputs, out)
        return out
    values = prog.hoist(inputs)
    if out is None:
        out = np.empty(full, dtype=a.out_dtype.np)
    if a.result in values:
        out[...] = _finish(values[a.result], prog.result_dtype, a.out_dtype)
        return out
    apart = not any(np.may_share_memory(out, x) for x in inputs)
    if math.prod(full) <= max(limit, whole_limit):  # one chunk: no slicing
        regs = dict(values)
        regs.update(prog.load_big(inputs))
        prog.run_live(regs, out, out_apart=apart)  # the last step straight into out when it can
        return out
    whole = {name: values[name] for name in prog.live_reads if values[name].ndim != len(full)}
    sliced = {name: values[name] for name in prog.live_reads if values[name].ndim == len(full)}
    big = [inputs[k] for k in prog.big] + [out]
    rows = (row_blocks(full, list(sliced.values()), big, row_limit, part_limit)
            if row_limit and apart else None)
    pickers: list = []
    if rows is not None:  # blocks of rows, a part of the row at a time (chunking.row_blocks)
        start, blocks = rows
    else:
        fixed = per_block_dims(full, list(sliced.values()), big)
        blocks = [(idx, None) for idx in chunks(full, channel_limit if fixed else limit, fixed)]
        pickers = [(name, x, *picker(x.shape, blocks[0][0])) for name, x in sliced.items()]

    def run_blocks(part: Sequence[tuple]) -> None:
        scratch = _thread_scratch()
        held_row, held = None, {}  # the row part last written out on this thread, its registers
        for idx, row in part:
            regs = dict(whole)
            if row is None:
                for name, x, base, vary in pickers:
                    sel = list(base)
                    for d in vary:
                        sel[d] = idx[d]
                    regs[name] = x[tuple(sel)]
            else:
                if row != held_row:  # this part's registers, in buffers the thread keeps
                    held_row, shape = row, part_shape(full[start:], row)
                    for name, x in sliced.items():
                        buf = kept(scratch, ("row part", name, shape), x.dtype)
                        held[name] = expand_part(x, full, start, row, buf)
                regs.update(held)
            regs.update(prog.load_big(inputs, idx))
            prog.run_live(regs, out[idx], scratch, apart)
    # blocks write disjoint parts of out: threads may share them unless out overlaps an input
    # (then the blocks' order matters)
    if math.prod(full) >= PARALLEL_ELEMS and not any(
            np.may_share_memory(out, inputs[k]) for k in prog.big):
        run_split(run_blocks, blocks)
    else:
        run_blocks(blocks)
    return out


_SCRATCH = threading.local()


SCRATCH_BYTES = 32 << 20  # a thread's kept buffers, at most: past it they are dropped


def _thread_scratch() -> dict[str, np.ndarray]:
    """This thread's temporaries and written-out row parts, kept from chunk to chunk by register
    name and chunk shape (a fresh 128 KiB array per step and chunk costs about as much as the
    step's arithmetic; when the chunks of a body come in two shapes, a remainder, each shape
    keeps its own). Dropped, to be made again, once they hold more than 64 buffers or
    :data:`SCRATCH_BYTES` (many bodies and shapes in one process)."""
    scratch = getattr(_SCRATCH, "buffers", None)
    if (scratch is None or len(scratch) > 64
            or sum(b.nbytes for b in scratch.values()) > SCRATCH_BYTES):
        scratch = _SCRATCH.buffers = {}
    return scratch


def kept(scratch: dict, key: tuple, dtype: Any) -> np.ndarray:
    """The buffer this thread keeps under ``key`` (whose last item is its shape), made on first
    use: a fresh 128 KiB-plus array per step and chunk costs about what the step computes."""
    buf = scratch.get(key)
    if buf is None or buf.dtype != dtype:
        buf = scratch[key] = np.empty(key[-1], dtype)
    return buf


def _finish(res: np.ndarray, rd: DataType, out_dtype: DataType) -> np.ndarray:
    """Register value of dtype ``rd`` → an array of ``out_dtype`` (exact for rd == out_dtype)."""
    if rd in (F16, BF16):
        res = res.astype(rd.np)
    return cast_array(res, out_dtype)


__all__ = ["CHUNK_ELEMS", "FLAT_ELEMS", "Hoisted", "Program", "chunks", "program", "renaming",
           "run_fused"]
