"""Zero-copy interop: ``opgraph.tensor`` views CPU torch tensors (strided, channels_last,
requires_grad, bfloat16) and phase 2 writes into torch outputs in place; other devices refused."""
from __future__ import annotations

import gc
import warnings

import ml_dtypes
import numpy as np
import pytest

import opgraph
from opgraph import aclnn

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'opgraph[torch]')")

import opgraph.torch as ot  # noqa: E402


def raw16(t):
    """The 16-bit words of a bf16/fp16 torch tensor, read by torch itself."""
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def shares_memory(og: opgraph.Tensor, t) -> bool:
    """Writing through the opgraph view changes the torch tensor (and is undone)."""
    view = og.view()
    idx = (0,) * view.ndim
    old = t[idx].item()
    view[idx] = 7
    seen = t[idx].item() == 7
    t[idx] = old
    return seen


@pytest.mark.parametrize("make", [
    lambda: torch.arange(24.).reshape(2, 3, 4),
    lambda: torch.arange(120.).reshape(2, 3, 4, 5).to(memory_format=torch.channels_last),
    lambda: torch.arange(240.).reshape(2, 3, 2, 4, 5).to(memory_format=torch.channels_last_3d),
    lambda: torch.arange(60.).reshape(3, 4, 5)[1:, ::2, 1:4],     # offset + strides
    lambda: torch.arange(12.).reshape(3, 4).t(),
    lambda: torch.arange(6, dtype=torch.float16).reshape(2, 3),
    lambda: torch.arange(6, dtype=torch.int32).reshape(3, 2),
    lambda: torch.arange(6, dtype=torch.int8),
], ids=["contiguous", "channels_last", "channels_last_3d", "sliced", "transposed", "fp16",
        "int32", "int8"])
def test_cpu_tensor_is_a_view(make):
    t = make()
    og = opgraph.tensor(t)
    assert og.shape == tuple(t.shape) and og.strides == tuple(t.stride())
    assert not og.copied and og.writeable
    np.testing.assert_array_equal(og.numpy(), t.numpy())
    assert og.numpy().dtype == t.numpy().dtype
    assert shares_memory(og, t)


def test_requires_grad_tensor_is_a_detached_view():
    leaf = torch.randn(2, 3, requires_grad=True)
    og = opgraph.tensor(leaf)
    np.testing.assert_array_equal(og.numpy(), leaf.detach().numpy())
    og.view()[0, 0] = 5.0
    assert leaf[0, 0].item() == 5.0 and leaf.requires_grad


@pytest.mark.parametrize("make", [
    lambda: torch.randn(4, 5).to(torch.bfloat16),
    lambda: torch.randn(2, 3, 4, 5).to(torch.bfloat16).to(memory_format=torch.channels_last),
    lambda: torch.randn(6, 7).to(torch.bfloat16)[1:, ::3],
    lambda: torch.randn(3, requires_grad=True, dtype=torch.bfloat16),
], ids=["contiguous", "channels_last", "sliced", "requires_grad"])
def test_bfloat16_is_viewed_through_its_raw_storage(make):
    t = make()
    og = opgraph.tensor(t)
    assert og.dtype == opgraph.DataType.BF16 and not og.copied
    assert og.strides == tuple(t.stride())
    assert np.array_equal(og.numpy().view(np.uint16), raw16(t.detach()))
    assert shares_memory(og, t.detach())


def test_the_view_keeps_a_temporary_tensor_alive():
    og = opgraph.tensor(torch.full((1000,), 1.5, dtype=torch.bfloat16) * 2)
    og2 = opgraph.tensor(torch.full((1000,), 1.5) * 2)
    gc.collect()
    torch.full((1000,), 9.0, dtype=torch.bfloat16), torch.full((1000,), 9.0)  # reuse freed memory
    assert (og.numpy().astype(np.float32) == 3.0).all() and (og2.numpy() == 3.0).all()


@pytest.mark.parametrize("t", [torch.tensor(2.5), torch.empty(0, 3), torch.empty(2, 0, 4),
                               torch.empty(0, 3, dtype=torch.bfloat16)],
                         ids=["0-d", "empty", "empty-middle", "empty-bf16"])
def test_scalars_and_empty_tensors(t):
    og = opgraph.tensor(t)
    assert og.shape == tuple(t.shape) and og.numel == t.numel()
    if t.dim() == 0:
        assert og.numpy() == 2.5


def test_a_dtype_conversion_is_a_copy():
    t = torch.arange(4.)
    og = opgraph.tensor(t, dtype="float16")
    assert og.copied and og.dtype == opgraph.DataType.FLOAT16


def test_broadcast_views_are_inputs_not_outputs():
    t = torch.arange(3.).expand(4, 3)
    og = opgraph.tensor(t)
    assert og.strides == (0, 1) and not og.copied
    np.testing.assert_array_equal(og.numpy(), t.numpy())


class FakeDeviceArray:
    """A DLPack exporter on a CUDA device, as cupy or torch.cuda tensors present themselves."""
    device = "cuda:0"

    def __dlpack__(self, **kwargs):
        raise AssertionError("never exported")

    def __dlpack_device__(self):
        return (2, 0)


@pytest.mark.parametrize("obj,device", [(torch.empty(2, 3, device="meta"), "meta"),
                                        (FakeDeviceArray(), "cuda:0")], ids=["meta", "cuda"])
def test_other_devices_are_a_clear_error(obj, device):
    with pytest.raises(ValueError, match=f"device '{device}'.*CPU memory only"):
        opgraph.tensor(obj)


def _csr(t):
    with warnings.catch_warnings():  # "support is in beta state"
        warnings.simplefilter("ignore")
        return t.to_sparse_csr()


LAZY_OR_OPAQUE = {  # CPU tensors whose memory is not their values as a strided array
    "neg bit": (lambda: torch.randn(2, 3, dtype=torch.complex64).conj().imag,  # public route to it
                "neg bit set: its memory does not hold its values .*resolve_neg"),
    "conj bit": (lambda: torch.randn(2, 3, dtype=torch.complex64).conj(), "conj bit set.*resolve_conj"),
    "sparse": (lambda: torch.eye(3).to_sparse(), "layout other than torch.strided"),
    "sparse csr": (lambda: _csr(torch.eye(3)), "layout other than torch.strided"),  # no strides at all
    "mkldnn": (lambda: torch.ones(2, 3).to_mkldnn(), "layout torch._mkldnn"),
    # no memory at all (a NULL data pointer): DLPack exported garbage (float32) or failed
    "zero tensor": (lambda: torch._efficientzerotensor(2, 3), "ZeroTensor: its memory .*clone"),
    "bf16 zero tensor": (lambda: torch._efficientzerotensor(2, 3, dtype=torch.bfloat16),
                         "ZeroTensor: its memory .*clone"),
}


@pytest.mark.parametrize("label", sorted(LAZY_OR_OPAQUE))
def test_lazy_or_opaque_tensors_are_a_clear_error(label):
    """Viewing such a tensor's memory would give other values (a negation DLPack leaves out)
    or none: refused, saying why, and, through the op_apis, naming the argument."""
    make, why = LAZY_OR_OPAQUE[label]
    with pytest.raises(ValueError, match=why):
        opgraph.tensor(make())
    x, c = torch.ones(2, 2, 3), torch.ones(2)
    with pytest.raises(opgraph.AclnnError, match=f"mean: cannot be used as a tensor.*{why}"):
        ot.batch_norm_elemt(x, None, None, make(), c, 1e-5)


def test_unsupported_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot view Tensor of dtype torch.float8_e4m3fn"):
        opgraph.tensor(torch.zeros(3, dtype=torch.float8_e4m3fn))


def test_pythonic_api_refuses_a_device_tensor_naming_the_argument():
    x = np.ones((2, 2, 3), np.float32)
    c = np.ones(2, np.float32)
    with pytest.raises(opgraph.AclnnError, match="grad_out: cannot be used as a tensor.*meta"):
        opgraph.ops.batch_norm_elemt_backward(torch.empty(2, 2, 3, device="meta"), x, c, c, c,
                                              c, c, np.int32([6]))


# --- phase 2 writes into torch outputs ---------------------------------------------------------
def _elemt_backward_args(dtype, lib):
    """gradOut, input, 5 channel tensors and the counter, as numpy (lib=np) or torch tensors."""
    rng = np.random.default_rng(3)
    big = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    ch = [rng.standard_normal(3).astype(np.float32) for _ in range(5)]
    ch[1] = np.abs(ch[1]) + 0.5
    arrays = [big, big * 0.5 + 1, *ch, np.float32([40, 40, 40])]
    if lib is np:
        return [a.astype(dtype) if a.ndim == 4 else a for a in arrays]
    return [torch.from_numpy(a.copy()).to(dtype) if a.ndim == 4 else torch.from_numpy(a.copy())
            for a in arrays]


@pytest.mark.parametrize("tdtype,ndtype", [(torch.float32, np.float32),
                                           (torch.float16, np.float16),
                                           (torch.bfloat16, opgraph.DataType.BF16.np)],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_phase_2_writes_into_a_torch_output_in_place(tdtype, ndtype, channels_last):
    targs = _elemt_backward_args(tdtype, torch)
    nargs = [a.float().numpy().astype(ndtype) if a.dim() == 4
             else a.numpy() for a in targs]
    if channels_last:
        targs[:2] = [a.to(memory_format=torch.channels_last) for a in targs[:2]]
    out = torch.full((2, 3, 4, 5), -1.0, dtype=tdtype)
    if channels_last:
        out = out.to(memory_format=torch.channels_last)
    ptr = out.data_ptr()
    st, ws, ex = aclnn.aclnnBatchNormElemtBackwardGetWorkspaceSize(
        *[opgraph.tensor(a) for a in targs], opgraph.tensor(out))
    assert st == opgraph.Status.ACLNN_SUCCESS, aclnn.aclGetRecentErrMsg()
    assert aclnn.aclnnBatchNormElemtBackward(bytearray(ws) if ws else None, ws, ex) == 0
    expected = opgraph.ops.batch_norm_elemt_backward(*nargs)   # the same op on numpy arrays
    assert out.data_ptr() == ptr and out.is_contiguous(
        memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    got = opgraph.tensor(out).numpy()
    assert np.array_equal(got.view(np.uint8), expected.view(np.uint8))


def test_pythonic_out_may_be_a_torch_tensor():
    targs = _elemt_backward_args(torch.float32, torch)
    out = torch.zeros(2, 3, 4, 5)
    opgraph.ops.batch_norm_elemt_backward(*targs, out=out)
    expected = opgraph.ops.batch_norm_elemt_backward(*[a.numpy() for a in targs])
    np.testing.assert_array_equal(out.numpy(), expected)


def test_a_failed_phase_1_leaves_the_torch_output_untouched():
    targs = _elemt_backward_args(torch.float32, torch)
    out = torch.full((2, 3, 4, 6), -1.0)                        # wrong shape
    with pytest.raises(opgraph.AclnnError):
        opgraph.ops.batch_norm_elemt_backward(*targs, out=out)
    assert (out == -1).all()


# --- numpy arrays: the unchecked fast path builds what the checked constructor would ---------
@pytest.mark.parametrize("make", [
    lambda: np.arange(24, dtype=np.float32).reshape(2, 3, 4),
    lambda: np.arange(24, dtype=np.float16).reshape(2, 3, 4)[:, ::2, 1:],
    lambda: np.arange(12, dtype=np.int32).reshape(3, 4).T,
    lambda: np.arange(6, dtype=np.float32)[:, None, None],      # size-1 dims
    lambda: np.broadcast_to(np.arange(3, dtype=np.float32), (4, 3)),
], ids=["contiguous", "sliced", "transposed", "unit-dims", "broadcast"])
def test_numpy_fast_path_matches_the_checked_constructor(make):
    a = make()
    t = opgraph.tensor(a)
    checked = opgraph.Tensor(t.storage, t.shape, t.strides, t.offset, t.format,
                             storage_shape=t.storage_shape, copied=t.copied)
    for name in ("dtype", "shape", "strides", "offset", "format", "storage_shape", "copied"):
        assert getattr(t, name) == getattr(checked, name), name
    assert np.shares_memory(t.storage, a) and t.writeable == a.flags.writeable
    np.testing.assert_array_equal(t.view(), a)
    np.testing.assert_array_equal(checked.view(), a)
    if a.flags.writeable:
        t.view()[(0,) * a.ndim] = 99
        assert a[(0,) * a.ndim] == 99


@pytest.mark.parametrize("make", [
    lambda: np.arange(24, dtype=np.float32).reshape(2, 3, 4).transpose(0, 2, 1),
    lambda: np.arange(60, dtype=np.float32).reshape(3, 4, 5)[1:, ::2, 1:4],
    lambda: np.arange(12, dtype=np.float16).reshape(3, 4).T,
    lambda: (np.arange(12, dtype=np.float32).reshape(3, 4) / 8).astype(ml_dtypes.bfloat16).T,
    lambda: np.array(2.5, np.float32),
    lambda: np.array(-1.5, ml_dtypes.bfloat16),
], ids=["transposed", "sliced", "fp16", "bf16", "0-d", "bf16 0-d"])
def test_to_torch_views_any_layout_keeping_its_shape(make):
    """A strided array was copied into a contiguous tensor, and a 0-d one became [1]."""
    a = make()
    t = ot.kernels.to_torch(a)
    assert tuple(t.shape) == a.shape and t.stride() == tuple(s // a.itemsize for s in a.strides)
    assert t.data_ptr() == a.__array_interface__["data"][0]
    assert np.array_equal(ot.kernels.as_numpy(t).astype(np.float64), a.astype(np.float64))


def test_to_torch_copies_only_what_torch_cannot_view():
    a = np.arange(4, dtype=np.float32)[::-1]
    assert ot.kernels.to_torch(a).tolist() == [3.0, 2.0, 1.0, 0.0]
