"""Mutation audit of opgraph/capture/: what the capture and replay tests did not pin before.
Two views at one address that differ only in strides are different tensors; in-out state that a
later call reads is still stored; a refused rebinding is not remembered as apart; a tensor a
call only took (for its shape) is marked written when a later call writes it; check_schedule
counts from a tensor's first write; a rebound array whose strides changed in place is viewed
afresh."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from opgraph.aclnn.batch_norm_elemt import batch_norm_elemt
from opgraph.aclnn.batch_norm_gather_stats_with_counts import batch_norm_gather_stats_with_counts
from opgraph.aclnn.batch_norm_stats import batch_norm_stats
from opgraph.capture import CaptureError, all_gather, capture, check_schedule
from opgraph.core.dtypes import DataType as D
from opgraph.core.ir import Graph, TensorType
from opgraph.core.memory import plan_memory


def test_a_transposed_view_of_a_written_tensor_is_refused_not_taken_as_the_written_value():
    """y.T starts where y does, with y's shape and dtype: only its strides tell it apart."""
    x = np.arange(16, dtype=np.float32).reshape(4, 4)
    y = np.empty((4, 4), np.float32)
    with pytest.raises(CaptureError, match="overlaps a tensor another call wrote without being "
                                           "the same view"):
        with capture():
            mean, invstd = batch_norm_stats(x, 1e-5)
            batch_norm_elemt(x, None, None, mean, invstd, 1e-5, out=y)
            batch_norm_stats(y.T, 1e-5)


def test_running_stats_read_by_a_later_call_are_still_stored():
    """In-out state (the running mean the gather updates) that a later call reads is an edge
    and a stored output: a replay updates it (float64 formula) and the reader sees the update."""
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    rm, rv = np.zeros(3, np.float32), np.ones(3, np.float32)
    with capture() as prog:
        mean, invstd = batch_norm_stats(x, 1e-5)
        mean_all, invstd_all = all_gather(mean, invstd)
        _, ginvstd = batch_norm_gather_stats_with_counts(x, mean_all, invstd_all, rm, rv, 0.1,
                                                         1e-5, np.float32([8]))
        y = batch_norm_elemt(x, None, None, rm, ginvstd, 1e-5)
    assert "runningMean" in prog.outputs
    prog.replay()
    x64 = x.astype(np.float64)
    want_rm = 0.1 * x64.mean(axis=(0, 2))
    np.testing.assert_allclose(rm, want_rm, rtol=1e-6)
    want_y = (x64 - want_rm[:, None]) / np.sqrt(x64.var(axis=(0, 2)) + 1e-5)[:, None]
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)


def test_a_refused_rebinding_is_refused_again_and_writes_nothing():
    """A rebinding refused for sharing memory with a written tensor is not remembered as
    apart: the same tensors passed again are refused again, nothing written."""
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    with capture() as prog:
        mean, invstd = batch_norm_stats(x, 1e-5)
        batch_norm_elemt(x, None, None, mean, invstd, 1e-5)
    prog.replay()
    shared = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    for _ in range(2):
        with pytest.raises(ValueError, match="replay: input: shares memory with output"):
            prog.replay(input=shared, output=shared)
    assert np.array_equal(shared, np.arange(24, dtype=np.float32).reshape(2, 3, 4))


def test_check_schedule_counts_from_the_first_write_of_a_tensor_written_twice():
    """A read between two writes of one user tensor reads after the first: caught (the order
    counts from the first write, not the last)."""
    g = Graph("twice")
    x = g.add_input("x", TensorType((3,), D.FLOAT))
    first = g.add_node("ViewCopy", [g.add_node("Mul", [x, x]).outputs[0], x]).outputs[0]
    between = g.add_node("Add", [x, x]).outputs[0]
    last = g.add_node("ViewCopy", [between, x]).outputs[0]
    g.outputs = [first, last]
    with pytest.raises(CaptureError, match=r"reads %x at node 2 after node 1 wrote it"):
        check_schedule(g, plan_memory(g))


def test_a_rebound_array_whose_strides_changed_in_place_is_viewed_afresh():
    """The same array object rebound again is the last replay's Tensor only while its layout
    is unchanged: strides set in place (same shape) make it a new view, refused here as of
    another type instead of read with the old strides."""
    x = np.arange(8, dtype=np.float32).reshape(2, 2, 2)
    with capture() as prog:
        batch_norm_stats(x, 1e-5)
    y = x.copy()
    prog.replay(input=y)
    with warnings.catch_warnings():  # (the strides setter is deprecated in NumPy 2.4)
        warnings.simplefilter("ignore", DeprecationWarning)
        y.strides = (4, 8, 16)
    with pytest.raises(ValueError, match=r"replay: input: the program was captured with"):
        prog.replay(input=y)


def test_a_tensor_a_call_only_took_is_marked_written_when_a_later_call_writes_it():
    """The gather takes ``input`` for its shape only (no read). When a later call writes that
    tensor, another view of it read afterwards overlaps a written tensor: refused."""
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    z = np.zeros((2, 3, 4), np.float32)
    rm, rv = np.zeros(3, np.float32), np.ones(3, np.float32)
    with pytest.raises(CaptureError, match="call #4 aclnnBatchNormStats: input overlaps a tensor "
                                           "another call wrote"):
        with capture():
            mean, invstd = batch_norm_stats(x, 1e-5)
            mean_all, invstd_all = all_gather(mean, invstd)
            m, s = batch_norm_gather_stats_with_counts(z, mean_all, invstd_all, rm, rv, 0.1,
                                                       1e-5, np.float32([8]))
            batch_norm_elemt(x, None, None, m, s, 1e-5, out=z)
            batch_norm_stats(z[:1], 1e-5)
