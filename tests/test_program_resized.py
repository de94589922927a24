"""A new batch size reuses what was built for a fused body at another size: the structure cache's
mapping keeps a body whose own sizes did not change as the same object, and the numpy
interpreter renames that body's program (``Program.resized``) instead of checking and compiling
it again — only when every check would come out the same. Results are checked against float32
numpy written out here."""
from __future__ import annotations

import numpy as np
import pytest

import opgraph
from l0ops import interpreter as P
from opgraph.aclnn import aclnnBatchNormElemtBackwardGetWorkspaceSize as elemt_backward
from opgraph.core.dtypes import DataType as D
from opgraph.core.opdef import L0Error, get_op
from l0ops.interpreter import FLAT_ELEMS, program, run_fused
from l0ops.primitives import FusedAttrs, Instr, Sig, reg_types

C, W, K = 3, 4, 6  # channels, inner size, counter length
BODY = (
    Instr(op="sum", args=("in2",), dtype=D.FLOAT),            # t0: the counter total
    Instr(op="div", args=("in0", "t0"), dtype=D.FLOAT),       # t1: [C]
    Instr(op="view", args=("t1",), dtype=D.FLOAT, shape=(1, C, 1)),
    Instr(op="sub", args=("in1", "t2"), dtype=D.FLOAT),       # t3: [N, C, W]
    Instr(op="mul", args=("t3", "t3"), dtype=D.FLOAT),
)


BASE = FusedAttrs(shape=(1, C, W), body=BODY, result="t4", out_dtype=D.FLOAT)


def attrs(shape: tuple[int, ...]) -> FusedAttrs:
    """The body at another iteration space, the body object kept (as the structure cache does)."""
    return BASE.model_copy(update={"shape": shape})


def operands(n: int, c: int = C, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(c).astype(np.float32),
            rng.standard_normal((n, c, W)).astype(np.float32),
            rng.integers(1, 9, K).astype(np.float32)]  # whole numbers: any summing order is exact


def expected(ins: list[np.ndarray]) -> np.ndarray:
    per_channel = ins[0] / np.float32(ins[2].sum(dtype=np.float64))
    d = ins[1] - per_channel[None, :, None]
    return d * d


def test_a_new_batch_size_renames_the_program_and_keeps_the_bits():
    program(attrs((2, C, W)), operands(2))  # the program later sizes are renamed from
    for n in (5, 7, 2 * FLAT_ELEMS):  # the last one runs the chunked path on renamed types
        a, ins = attrs((n, C, W)), operands(n, seed=n)
        prog = program(a, ins)
        assert "_renamed" in prog.__dict__, n
        assert prog.types == reg_types(a, [Sig(D.FLOAT, x.shape) for x in ins])
        got = run_fused(a, ins)
        assert np.array_equal(got.view(np.uint32), expected(ins).view(np.uint32)), n


@pytest.mark.parametrize("n, c, why", [
    (1, C, "a dim becomes 1"),
    (0, C, "a dim becomes 0"),
    (C, C, "two different dims become equal"),
    (9, 5, "a size the body's view fixes changes"),
])
def test_a_program_is_made_anew_when_the_checks_could_differ(n, c, why):
    program(attrs((2, C, W)), operands(2))
    a, ins = attrs((n, c, W)), operands(n, c=c, seed=1)
    if c != C:
        with pytest.raises(L0Error, match="view must keep the element count"):
            run_fused(a, ins)
        return
    prog = program(a, ins)
    assert "_renamed" not in prog.__dict__, why
    assert np.array_equal(run_fused(a, ins).view(np.uint32), expected(ins).view(np.uint32))


def test_operands_that_do_not_broadcast_still_fail_the_check():
    program(attrs((2, C, W)), operands(2))
    ins = operands(4)
    ins[1] = ins[1][:, :, :3].copy()  # W no longer matches the iteration space
    with pytest.raises(L0Error):
        run_fused(attrs((4, C, W)), ins)


def _elemt_backward_body(n: int, c: int):
    rng = np.random.default_rng(n)
    big = lambda: opgraph.tensor(rng.standard_normal((n, c, 4)).astype(np.float32))  # noqa: E731
    small = lambda: opgraph.tensor(rng.uniform(0.5, 2, c).astype(np.float32))  # noqa: E731
    args = (big(), big(), small(), small(), small(), small(), small(),
            opgraph.tensor(np.full(c, 3, np.int32)), opgraph.tensor(np.zeros((n, c, 4), np.float32)))
    with opgraph.opt_level(2):
        status, _, ex = elemt_backward(*args)
    assert status == 0
    return ex.program.compiled.nodes[0].attrs


def test_the_structure_cache_keeps_a_body_whose_sizes_did_not_change():
    _elemt_backward_body(3, 2)  # recorded; the structure's template is made
    first = _elemt_backward_body(5, 2)  # from the template
    again = _elemt_backward_body(7, 2)  # a new batch size: only the iteration space changes
    other = _elemt_backward_body(7, 6)  # new channels: the body's views change
    assert again.shape == (7, 2, 4) and again.body is first.body
    assert other.body is not first.body and other.body[4].shape == (1, 6, 1)


SCALE = FusedAttrs(shape=(1, 1, 1), result="t1", out_dtype=D.FLOAT, body=(
    Instr(op="mul", args=("in0", "in0"), dtype=D.FLOAT),  # hoisted: a [W] register
    Instr(op="mul", args=("in1", "t0"), dtype=D.FLOAT),
))


def test_a_chunk_plan_made_at_one_size_serves_the_next_renamed():
    """Sizes past FLAT_ELEMS run in chunks: the plan made at one size is taken over, its
    per-channel registers' shapes renamed (here the inner size W changes too)."""
    rng = np.random.default_rng(5)
    program(SCALE.model_copy(update={"shape": (2, 3, 5)}),
            [np.ones(5, np.float32), np.ones((2, 3, 5), np.float32)])
    for k, (n, w) in enumerate([(700, 11), (900, 13), (1100, 17)]):
        a = SCALE.model_copy(update={"shape": (n, 3, w)})
        ins = [rng.standard_normal(w).astype(np.float32),
               rng.standard_normal((n, 3, w)).astype(np.float32)]
        prog = program(a, ins)
        assert "_renamed" in prog.__dict__
        if k:  # the plan came with the program
            assert prog.__dict__["_pending"] is None and prog.align == [("in0", (1, 1, w)), ("t0", (1, 1, w))]
        got = run_fused(a, ins)
        assert prog.align == [("in0", (1, 1, w)), ("t0", (1, 1, w))]
        assert np.array_equal(got.view(np.uint32), (ins[1] * (ins[0] * ins[0])).view(np.uint32))


def test_an_ops_numpy_semantics_compile_its_body_once(monkeypatch):
    """An l0 op whose numpy semantics interpret its expansion (Sub, Mul, ... at levels 0 and 1)
    builds the interpreter program once per input types, not on every call: the FusedAttrs of a
    call is kept with its memoised body (pydantic copies the body tuple, so a fresh attrs object
    per call missed every cache keyed by identity); and equal bodies are one object, so a new
    size renames the program made at another."""
    built = []
    init = P.Program.__init__
    monkeypatch.setattr(P.Program, "__init__", lambda self, *a: (built.append(1), init(self, *a))[1])
    sub = get_op("Sub")
    x, y = np.float32([[1, 2, 3]]), np.float32([[0.5], [1]])
    first = [sub.compute([x, y], sub.attrs()) for _ in range(3)]
    assert all(np.array_equal(r[0], x - y) for r in first)
    assert len(built) == 1
    y4 = np.float32([[0.5], [1], [2], [4]])  # a new size of the same body: renamed, not built
    assert np.array_equal(sub.compute([x, y4], sub.attrs())[0], x - y4) and len(built) == 1
    sub.compute([x, y[:1]], sub.attrs())  # a dim becomes 1: checked and compiled anew
    assert len(built) == 2
