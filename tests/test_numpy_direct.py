"""The numpy backend's direct run of a level-2 element-wise program (one FusedElementwise storing
into the caller's tensor, :func:`backends.numpy_backend._fused_store`): the interpreter runs on
the bound tensors' views with no environment. Bits stay the reference's; a strided output is
stored by the kernel's own rule (computed, then copied into it); a profiled run and an unbound
input go (or fail) the node-by-node way."""
from __future__ import annotations

import numpy as np
import pytest

import opgraph
import reference as R
from backends.numpy_backend import NumpyExecutable
from opgraph.core import backend as backend_registry


def phase1(case: R.Case, out: np.ndarray, level: int = 2):
    with opgraph.use_backend("numpy"), opgraph.opt_level(level):
        st, ws, ex = opgraph.aclnn.aclnnBatchNormElemtBackwardGetWorkspaceSize(
            *R.to_tensors(case), opgraph.tensor(out))
    assert st == 0, opgraph.aclnn.aclGetRecentErrMsg()
    exe = ex.program.executable(backend_registry.get("numpy"))
    assert type(exe) is NumpyExecutable
    return ex, exe


@pytest.mark.parametrize("shape", [(2, 3, 4), (4, 8, 40, 40)], ids=["flat", "chunked"])
@pytest.mark.parametrize("dtype", [R.F32, R.F16, R.BF16], ids=["f32", "f16", "bf16"])
def test_the_fused_kernel_runs_directly_with_the_reference_bits(shape, dtype):
    case = R.make_case(shape, dtype, seed=5)
    out = np.full(shape, 3, dtype)
    ex, exe = phase1(case, out)
    assert exe.fused_store is not None
    assert exe.run(ex.bindings).keys() == {v.name for v in exe.graph.outputs}
    R.assert_bits_equal(out, case.expected())
    again = np.full(shape, 5, dtype)  # node by node, into another tensor: the same bits
    ex2, _ = phase1(case, again)
    with np.errstate(all="ignore"):
        exe.run_nodes(ex2.bindings)
    R.assert_bits_equal(again, out)


def test_level_1_goes_node_by_node_and_a_strided_output_gets_only_its_elements():
    case = R.make_case((2, 3, 4), R.F32, seed=6)
    _, exe1 = phase1(case, np.zeros((2, 3, 4), R.F32), level=1)
    assert exe1.fused_store is None  # several nodes
    wide = np.full((2, 3, 8), 9, R.F32)
    out = wide[..., ::2]  # every other element: not C-contiguous
    ex, exe = phase1(case, out)
    exe.run(ex.bindings)
    R.assert_bits_equal(out, case.expected())
    assert np.all(wide[..., 1::2] == 9)  # the gaps are untouched


def test_a_profiled_run_times_the_node_and_an_unbound_input_is_named():
    case = R.make_case((2, 3, 4), R.F32, seed=7)
    out = np.zeros((2, 3, 4), R.F32)
    ex, exe = phase1(case, out)
    seen = []
    exe.profile = lambda node, start, stop: seen.append((node.op, stop >= start))
    try:
        exe.run(ex.bindings)
    finally:
        del exe.profile
    assert seen == [("FusedElementwise", True)]
    R.assert_bits_equal(out, case.expected())
    bindings = dict(ex.bindings)
    del bindings["counter"]
    with pytest.raises(ValueError, match="counter is not bound"):
        exe.run(bindings)


@pytest.mark.parametrize("dtype", [R.F32, R.F16, R.BF16], ids=["f32", "f16", "bf16"])
def test_a_small_kernel_keeps_its_program_and_a_chunked_one_does_not(dtype):
    """A small fused store looks its interpreter program up at the first run and calls it
    straight on later runs, whatever tensors they bind: another call with the same metadata
    (the same executable) gets its own data's reference bits. A chunked one keeps none."""
    case, other = R.make_case((2, 3, 4), dtype, seed=8), R.make_case((2, 3, 4), dtype, seed=9)
    out, out2 = np.full((2, 3, 4), 3, dtype), np.full((2, 3, 4), 5, dtype)
    ex, exe = phase1(case, out)
    exe.store_program = None  # as a new executable (an earlier test may have run this one)
    exe.run(ex.bindings)
    assert exe.store_program and exe.store_program.straight()
    R.assert_bits_equal(out, case.expected())
    ex2, exe2 = phase1(other, out2)
    assert exe2 is exe
    exe.run(ex2.bindings)
    R.assert_bits_equal(out2, other.expected())
    assert not np.array_equal(out2, out)
    big = R.make_case((4, 8, 40, 40), dtype, seed=10)
    big_out = np.zeros((4, 8, 40, 40), dtype)
    ex3, exe3 = phase1(big, big_out)
    exe3.run(ex3.bindings)
    assert exe3.store_program is False
    R.assert_bits_equal(big_out, big.expected())
