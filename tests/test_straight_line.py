"""The generated straight-line run of a fused body (l0ops.straight_line) against the same steps
run in a plain loop: long programs (step numbers past 32, where a name in the generated
function's namespace once shadowed a step), narrow inputs widened first, the last step into
``out`` or not, and a program of no steps."""
from __future__ import annotations

import numpy as np
import pytest

from l0ops.straight_line import straight_line

UFUNCS = (np.add, np.subtract, np.multiply)


def loop(steps, narrow, result, inputs):
    regs = [x.astype(np.float32) if wide else x for x, wide in zip(inputs, narrow)]
    for fn, args in steps:
        regs.append(fn(*[regs[i] for i in args]))
    return regs[result]


def program(seed: int, n_steps: int, n_inputs: int):
    rng = np.random.default_rng(seed)
    steps = []
    for k in range(n_steps):
        reads = tuple(int(i) for i in rng.integers(0, n_inputs + k, 2))
        steps.append((UFUNCS[k % 3], reads))
    steps.append((lambda a, b, c: a * b - c, (n_inputs + len(steps) - 1, 1, 0)))  # three operands
    steps.append((np.multiply, (n_inputs + len(steps) - 1, 1)))
    return steps


@pytest.mark.parametrize("n_steps", [1, 31, 40, 120])
@pytest.mark.parametrize("store", [False, True])
def test_the_generated_run_gives_the_loops_bits(n_steps, store):
    rng = np.random.default_rng(n_steps)
    narrow = [True, False, True]
    inputs = [rng.standard_normal(6).astype(np.float16), rng.standard_normal(6).astype(np.float32),
              rng.standard_normal((2, 1)).astype(np.float16)]
    steps = program(n_steps, n_steps, len(inputs))
    result = len(inputs) + len(steps) - 1
    run = straight_line(steps, narrow, result, store)
    want = loop(steps, narrow, result, inputs)
    got = run(*inputs, None)
    assert got.dtype == want.dtype and np.array_equal(got.view(np.uint32), want.view(np.uint32))
    out = np.full(want.shape, np.nan, np.float32)
    back = run(*inputs, out)
    if store:  # computed straight into out
        assert back is None and np.array_equal(out.view(np.uint32), want.view(np.uint32))
    else:  # out untouched: the caller places the result
        assert np.array_equal(back.view(np.uint32), want.view(np.uint32)) and np.isnan(out).all()


def test_a_program_of_no_steps_returns_its_input_register():
    x = np.float16([1.5, 2.0])
    got = straight_line([], [True, False], 0, False)(x, np.float32([3.0]), None)
    assert got.dtype == np.float32 and got.tolist() == [1.5, 2.0]


def marked(name, arg):
    """A step marked as the method call ``x.name(arg)`` whose callable must not run (the
    generated code makes the call itself)."""
    def never(x):
        raise AssertionError("the generated run called a marked step's callable")
    never.method = (name, arg)
    return never


def test_marked_steps_run_as_method_calls():
    x = np.int32([[1, 2, 3], [4, 5, 6]])
    steps = [(marked("astype", np.float32), (0,)), (marked("reshape", (3, 2)), (1,)),
             (np.multiply, (2, 2))]
    got = straight_line(steps, [False], 3, True)(x, None)
    assert got.dtype == np.float32 and got.tolist() == [[1, 4], [9, 16], [25, 36]]


def test_a_marked_last_step_is_not_given_out_and_unknown_methods_are_called():
    x = np.float32([1, 2, 3, 4])

    def flip(y):
        return y[::-1]
    flip.method = ("__class__", None)  # not a method the generator writes: called as a function
    steps = [(flip, (0,)), (marked("reshape", (2, 2)), (1,))]
    out = np.zeros((2, 2), np.float32)
    got = straight_line(steps, [False], 2, True)(x, out)  # a reshape takes no out=: returned
    assert got.tolist() == [[4, 3], [2, 1]] and not out.any()
