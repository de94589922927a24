"""The five aten primitives SyncBatchNorm is built from, on CPU torch tensors, each one op_api
call (the torch_npu mapping, reference syncbn-family.md §9), plus their registration as the CPU
kernels of ``aten::batch_norm_stats`` & co. Inputs are viewed, not copied (:func:`as_numpy`);
outputs are new torch tensors (or ``out``) that phase 2 writes in place. ``backend`` picks the
opgraph backend phase 2 runs on, ``platform`` the SoC whose op_apis run (default: the current
ones; bfloat16 statistics need ``platform="Ascend950"``).

    >>> import torch
    >>> x = torch.arange(8.).reshape(2, 2, 2)          # channel 0: 0 1 4 5, channel 1: 2 3 6 7
    >>> mean, invstd = batch_norm_stats(x, 1e-5)
    >>> mean.tolist(), mean.dtype
    ([2.5, 4.5], torch.float32)
    >>> y = batch_norm_elemt(x, None, None, mean, invstd, 1e-5)
    >>> round(y[0, 0, 0].item(), 4)
    -1.2127
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable, Optional, Union

import numpy as np
import torch

from opgraph.core.config import BackendRef, current_backend_ref, use_backend
from opgraph.core.platform import Platform, get_platform, lookup, platform as use_platform
from opgraph.core.tensor import tensor as op_tensor
from opgraph.aclnn import (batch_norm_elemt as _elemt, batch_norm_elemt_backward as _elemt_bwd,
                           batch_norm_gather_stats_with_counts as _gather,
                           batch_norm_reduce_backward as _reduce_bwd, batch_norm_stats as _stats)
from .arrays import DTYPES, as_numpy, to_torch
from .direct import DIRECT_CALLS

Tensor = torch.Tensor
PlatformRef = Union[str, Platform, None]
BF16_PLATFORM = "Ascend950"  # the SoC whose BatchNormStats takes bfloat16
PRIMITIVES = ("batch_norm_stats", "batch_norm_gather_stats_with_counts", "batch_norm_elemt",
              "batch_norm_elemt.out", "batch_norm_backward_reduce", "batch_norm_backward_elemt")


_UNCHANGED = contextlib.nullcontext()
# why torch.compile runs the op_apis eagerly (a graph break): they run numpy and C on the
# tensors' memory, which dynamo cannot trace
NOT_TRACEABLE = "opgraph's op_apis run numpy and C on the tensors' memory"


def eager_under_compile(fn: Callable) -> Callable:
    """``fn``, run eagerly when torch.compile traces it (``torch.compiler.disable``, applied only
    then: importing dynamo costs ~1.5 s, and a plain call stays a plain call). The five
    primitives (the registered aten kernels call them) and SyncBatchNorm's autograd function are
    such: dynamo traced into the op_apis' numpy and failed (TorchRuntimeError on fake tensors)
    or ran its own rendering of it, not the op_api's bits.

        >>> eager_under_compile(abs)(-2)
        2
    """
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        return torch.compiler.disable(fn, reason=NOT_TRACEABLE)(*args, **kwargs)
    return run


def on(backend: Optional[BackendRef] = None,
       platform: PlatformRef = None) -> contextlib.AbstractContextManager:
    """Inside: phase 2 on ``backend`` and the op_apis on ``platform`` (a SoC name, e.g.
    ``"Ascend950"``, where bfloat16 batch_norm_stats exists); None keeps the current one.

    >>> from opgraph.core.platform import get_platform
    >>> with on("numpy", "Ascend950"):
    ...     get_platform().soc
    'Ascend950'
    """
    if backend is None and platform is None:
        return _UNCHANGED
    if platform is None:
        return use_backend(backend)
    if backend is None:
        return use_platform(platform)
    return _Both(use_backend(backend), use_platform(platform))


def pinned(backend: Optional[BackendRef] = None, platform: PlatformRef = None) -> dict[str, Any]:
    """``{"backend": ..., "platform": ...}`` for :func:`on`: the ones given, else the ones current
    now — so that a later block (a backward after its forward's block ended) runs there too.

    >>> with on(platform="Ascend950"):
    ...     where = pinned()
    >>> where["backend"], where["platform"].soc
    ('numpy', 'Ascend950')
    """
    return {"backend": current_backend_ref() if backend is None else backend,
            "platform": get_platform() if platform is None else platform}


class _Both:
    """Two context managers entered in order and left in reverse (what an ExitStack does for
    two, at a fifth of its cost: SyncBatchNorm enters one per forward and per backward)."""

    __slots__ = ("first", "second")

    def __init__(self, first: Any, second: Any) -> None:
        self.first, self.second = first, second

    def __enter__(self) -> None:
        self.first.__enter__()
        try:
            self.second.__enter__()
        except BaseException:
            self.first.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            self.second.__exit__(*exc)
        finally:
            self.first.__exit__(*exc)


class TorchViews:
    """Each CPU torch tensor passed in as an opgraph Tensor over its memory, made once per
    instance (held with the torch tensor, so an id is never reused while remembered); anything
    else (None, arrays, a tensor opgraph cannot view) unchanged, for the op_api's own checks to
    name. SyncBatchNorm's step passes its input to five op_apis and the per-channel tensors to
    several: one instance per step views each once (about 6 µs a view, its address included).

    >>> views, x = TorchViews(), torch.ones(2, 3)
    >>> views(x) is views(x), views(x).shape, views(None)
    (True, (2, 3), None)
    """

    def __init__(self) -> None:
        self._made: dict[int, tuple[Tensor, Any]] = {}

    def __call__(self, t: Any) -> Any:
        if not isinstance(t, Tensor):
            return t
        hit = self._made.get(id(t))
        if hit is None:
            a = as_numpy(t)
            try:
                view = op_tensor(a) if type(a) is np.ndarray else a
            except (TypeError, ValueError):  # what opgraph.tensor refuses: the op_api names it
                view = a
            hit = self._made[id(t)] = (t, view)
        return hit[1]


def _views(views: Optional[TorchViews]) -> Callable[[Any], Any]:
    """How a call views its tensors: through the shared ``views``, else each as it comes."""
    return as_numpy if views is None else views


def running_stats_refused(running_mean: Optional[Tensor], mean_dtype: torch.dtype,
                          input_dtype: Optional[torch.dtype] = None) -> bool:
    """Whether batch_norm_gather_stats_with_counts on the current platform refuses
    ``running_mean`` (and a running var of its dtype) next to a ``mean`` of ``mean_dtype``: the
    Ascend950's fused kernel keeps the running statistics in mean's dtype and fails on any other
    (561103; without running stats, given ``input_dtype``: it makes zeros in the input's dtype
    and fails on those, 561002); the 910B op casts them to float32 and back itself.

    >>> with on(platform="Ascend950"):
    ...     (running_stats_refused(torch.zeros(2, dtype=torch.bfloat16), torch.float32),
    ...      running_stats_refused(None, torch.float32, torch.bfloat16))
    (True, True)
    """
    dtype = input_dtype if running_mean is None else running_mean.dtype
    return dtype is not None and dtype != mean_dtype and get_platform().soc == _gather.FUSED_SOC


@functools.lru_cache(maxsize=64)
def _stats_input_dtypes(p: Platform) -> tuple[torch.dtype, ...]:
    """BatchNormStats' input dtypes on ``p`` as torch dtypes (memoised: every forward asks,
    and ``DataType.np`` takes ~2 µs)."""
    return tuple(DTYPES[d.np.name] for d in _stats.input_dtypes(p))


def check_input_dtype(dtype: torch.dtype, platform: PlatformRef = None) -> None:
    """TypeError, saying what to use, unless batch_norm_stats on ``platform`` (None: the current
    one) takes ``dtype``. A SyncBatchNorm step checks it before any exchange, so that every rank
    refuses alike (an empty rank, which computes no statistics, would wait in the gather).

    >>> check_input_dtype(torch.float16)
    >>> check_input_dtype(torch.bfloat16)
    Traceback (most recent call last):
    TypeError: SyncBatchNorm: input dtype torch.bfloat16 is not supported on Ascend910B, whose \
BatchNormStats takes float32, float16; bfloat16 statistics exist only on Ascend950: ...
    """
    p = get_platform() if platform is None else lookup(platform)
    allowed = _stats_input_dtypes(p)
    if dtype in allowed:
        return
    hint = (f"bfloat16 statistics exist only on {BF16_PLATFORM}: SyncBatchNorm(..., platform="
            f"{BF16_PLATFORM!r}) or convert_sync_batchnorm(model, platform={BF16_PLATFORM!r})"
            if dtype == torch.bfloat16 else
            "use float32 (model.float() and float32 inputs)")
    names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
    raise TypeError(f"SyncBatchNorm: input dtype {dtype} is not supported on {p.soc}, whose "
                    f"BatchNormStats takes {names}; {hint}")


PARAMETER_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the op_apis' [C] tensors take


def check_parameter_dtypes(**tensors: Optional[Tensor]) -> None:
    """TypeError naming the first of ``tensors`` (weight, bias, running stats; None skipped)
    whose dtype no op_api of the step takes (float64 after ``model.double()``), checked with
    :func:`check_input_dtype` before any exchange.

    >>> check_parameter_dtypes(weight=torch.ones(2), running_mean=None)
    >>> check_parameter_dtypes(weight=torch.ones(2, dtype=torch.float64))
    Traceback (most recent call last):
    TypeError: SyncBatchNorm: weight dtype torch.float64 is not supported (the op_apis take \
float32, float16, bfloat16); use model.float()
    """
    for name, t in tensors.items():
        if t is not None and t.dtype not in PARAMETER_DTYPES:
            raise TypeError(f"SyncBatchNorm: {name} dtype {t.dtype} is not supported (the op_apis "
                            "take float32, float16, bfloat16); use model.float()")


def scratch_running_stats(C: int) -> tuple[Tensor, Tensor]:
    """Float32 running mean and var (zeros, ones) for a gather that refuses to go without them
    (:func:`running_stats_refused` of None); what it writes into them is to be dropped.

    >>> [t.tolist() for t in scratch_running_stats(2)]
    [[0.0, 0.0], [1.0, 1.0]]
    """
    return torch.zeros(C, dtype=torch.float32), torch.ones(C, dtype=torch.float32)


@eager_under_compile  # (dynamo cannot trace the op_api)
def batch_norm_stats(input: Tensor, eps: float, *, backend: Optional[BackendRef] = None,
                     platform: PlatformRef = None,
                     views: Optional[TorchViews] = None) -> tuple[Tensor, Tensor]:
    """Per-channel mean and 1/sqrt(biased var + eps) of ``input`` [N, C, ...], float32
    (aclnnBatchNormStats). ``views``: a :class:`TorchViews` shared by several calls (every
    function here takes one) views each tensor once."""
    def slow() -> list:
        return [to_torch(o) for o in _stats.batch_norm_stats(_views(views)(input), eps)]
    with on(backend, platform):
        mean, invstd = DIRECT_CALLS.call("aclnnBatchNormStats", (input, eps), slow)
    return mean, invstd


@eager_under_compile  # (dynamo cannot trace the op_api)
def batch_norm_gather_stats_with_counts(
        input: Tensor, mean: Tensor, invstd: Tensor, running_mean: Optional[Tensor],
        running_var: Optional[Tensor], momentum: float, eps: float, counts: Tensor, *,
        backend: Optional[BackendRef] = None, platform: PlatformRef = None,
        views: Optional[TorchViews] = None) -> tuple[Tensor, Tensor]:
    """Global mean and invstd from per-rank ``mean``/``invstd`` [W, C] and ``counts`` [W]; the
    running stats (when given) are updated in place (aclnnBatchNormGatherStatsWithCounts)."""
    args = (input, mean, invstd, running_mean, running_var, momentum, eps, counts)

    def slow() -> list:
        view = _views(views)
        return [to_torch(o) for o in _gather.batch_norm_gather_stats_with_counts(
            *map(view, args[:5]), momentum, eps, view(counts))]
    with on(backend, platform):
        m, s = DIRECT_CALLS.call("aclnnBatchNormGatherStatsWithCounts", args, slow)
    return m, s


@eager_under_compile  # (dynamo cannot trace the op_api)
def batch_norm_elemt(input: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                     mean: Tensor, invstd: Tensor, eps: float, *, out: Optional[Tensor] = None,
                     backend: Optional[BackendRef] = None, platform: PlatformRef = None,
                     views: Optional[TorchViews] = None) -> Tensor:
    """``(input - mean) * invstd * weight + bias`` per channel into ``out`` (default: a new tensor
    like ``input``, channels_last kept) (aclnnBatchNormElemt)."""
    args = (input, weight, bias, mean, invstd, eps)
    with on(backend, platform):
        return _into(out, input, "aclnnBatchNormElemt", args, lambda into: _elemt.batch_norm_elemt(
            *map(_views(views), args[:5]), eps, out=into))


@eager_under_compile  # (dynamo cannot trace the op_api)
def batch_norm_backward_reduce(
        grad_out: Tensor, input: Tensor, mean: Tensor, invstd: Tensor, weight: Optional[Tensor],
        input_g: bool, weight_g: bool, bias_g: bool, *,
        backend: Optional[BackendRef] = None, platform: PlatformRef = None,
        views: Optional[TorchViews] = None) -> tuple[Optional[Tensor], ...]:
    """``(sum_dy, sum_dy_xmu, grad_weight, grad_bias)`` per channel; an output whose flag is
    False is None (aclnnBatchNormReduceBackward)."""
    args = (grad_out, input, mean, invstd, weight, input_g, weight_g, bias_g)

    def slow() -> list:
        return [to_torch(o) for o in _reduce_bwd.batch_norm_backward_reduce(
            *map(_views(views), args[:5]), input_g, weight_g, bias_g)]
    with on(backend, platform):
        return tuple(DIRECT_CALLS.call("aclnnBatchNormReduceBackward", args, slow))


@eager_under_compile  # (dynamo cannot trace the op_api)
def batch_norm_backward_elemt(
        grad_out: Tensor, input: Tensor, mean: Tensor, invstd: Tensor, weight: Optional[Tensor],
        sum_dy: Tensor, sum_dy_xmu: Tensor, count: Tensor, *, out: Optional[Tensor] = None,
        backend: Optional[BackendRef] = None, platform: PlatformRef = None,
        views: Optional[TorchViews] = None) -> Tensor:
    """SyncBatchNorm's input gradient from the all-reduced sums and the per-rank ``count``
    (aclnnBatchNormElemtBackward), into ``out`` (default: a new tensor like ``input``)."""
    args = (grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count)
    with on(backend, platform):
        return _into(out, input, "aclnnBatchNormElemtBackward", args,
                     lambda into: _elemt_bwd.batch_norm_elemt_backward(*map(_views(views), args),
                                                                      out=into))


def memory_format(t: Tensor) -> torch.memory_format:
    """``t``'s layout as a memory format: channels_last(_3d) when it is contiguous so (PTF:39-45),
    else contiguous.

    >>> memory_format(torch.ones(2, 3, 4, 5).contiguous(memory_format=torch.channels_last))
    torch.channels_last
    """
    for fmt in (torch.channels_last, torch.channels_last_3d):
        if t.is_contiguous(memory_format=fmt):
            return fmt
    return torch.contiguous_format


def resize_out(out: Tensor, like: Tensor) -> None:
    """torch's rule for an ``out=`` tensor (``at::native::resize_output``, which CUDA's
    batch_norm_elemt.out applies): one of another shape is resized to ``like``'s, in its layout,
    with a warning (opgraph's words, as torch warns) when it had elements."""
    if out.shape == like.shape:
        return
    if out.numel():
        warnings.warn(f"out= tensor of shape {list(out.shape)} resized to {list(like.shape)}: "
                      "like torch, opgraph resizes an out of another shape, and warns when it "
                      "had elements (torch deprecates that); pass an empty out or one of the "
                      "result's shape", UserWarning, stacklevel=3)
    out.resize_(like.shape, memory_format=memory_format(like))


def _into(out: Optional[Tensor], like: Tensor, name: str, args: tuple,
          write: Callable[[np.ndarray], Any]) -> Tensor:
    """An element-wise op_api's output: ``write(array)`` into ``out`` (a caller's: the op_api
    checks it) or into a new tensor like ``like`` (channels_last kept), a direct call when
    learnt. The array is the tensor's numpy view, which the Pythonic API writes in place."""
    if out is not None:
        write(as_numpy(out))
        return out

    def slow() -> list:
        into = torch.empty_like(like)
        write(as_numpy(into))
        return [into]
    return DIRECT_CALLS.call(name, args, slow)[0]


# --- torch.library registration --------------------------------------------------------------
_registered: dict[str, Any] = {"library": None, "backend": None, "platform": None}


def _where() -> dict[str, Any]:
    return {"backend": _registered["backend"], "platform": _registered["platform"]}


def _aten_stats(input: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return batch_norm_stats(input, eps, **_where())


def _aten_gather(input: Tensor, mean: Tensor, invstd: Tensor, running_mean: Optional[Tensor],
                 running_var: Optional[Tensor], momentum: float, eps: float,
                 counts: Tensor) -> tuple[Tensor, Tensor]:
    return batch_norm_gather_stats_with_counts(input, mean, invstd, running_mean, running_var,
                                               momentum, eps, counts, **_where())


def _aten_elemt(input: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], mean: Tensor,
                invstd: Tensor, eps: float) -> Tensor:
    return batch_norm_elemt(input, weight, bias, mean, invstd, eps, **_where())


def _aten_elemt_out(input: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                    mean: Tensor, invstd: Tensor, eps: float, *, out: Tensor) -> Tensor:
    resize_out(out, input)  # (the op_api itself takes an out of the input's shape only)
    return batch_norm_elemt(input, weight, bias, mean, invstd, eps, out=out, **_where())


def _aten_reduce(grad_out: Tensor, input: Tensor, mean: Tensor, invstd: Tensor,
                 weight: Optional[Tensor], input_g: bool, weight_g: bool,
                 bias_g: bool) -> tuple[Tensor, ...]:
    outs = batch_norm_backward_reduce(grad_out, input, mean, invstd, weight, input_g, weight_g,
                                      bias_g, **_where())
    # the schema returns four Tensors: an output not asked for is an empty one
    return tuple(torch.empty(0, dtype=mean.dtype) if o is None else o for o in outs)


def _aten_backward_elemt(grad_out: Tensor, input: Tensor, mean: Tensor, invstd: Tensor,
                         weight: Optional[Tensor], sum_dy: Tensor, sum_dy_xmu: Tensor,
                         count: Tensor) -> Tensor:
    return batch_norm_backward_elemt(grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu,
                                     count, **_where())


_IMPLS = dict(zip(PRIMITIVES, (_aten_stats, _aten_gather, _aten_elemt, _aten_elemt_out,
                               _aten_reduce, _aten_backward_elemt)))


def register_cpu_kernels(backend: Optional[BackendRef] = None,
                         platform: PlatformRef = None) -> None:
    """Make ``aten::batch_norm_stats``, ``batch_norm_gather_stats_with_counts``,
    ``batch_norm_elemt`` (and ``.out``), ``batch_norm_backward_reduce`` and
    ``batch_norm_backward_elemt`` run on CPU tensors, through their op_apis on ``backend``
    (an opgraph backend name or instance) and ``platform`` (a SoC name); None: the ones
    current at each call.

    Idempotent: the kernels are registered once per process; a later call only changes the
    backend and platform. Afterwards ``torch.batch_norm_stats(cpu_tensor, 1e-5)`` works.
    """
    with on(backend, platform):  # an unknown backend or platform fails here, not at a call
        pass
    _registered.update(backend=backend, platform=platform)
    if _registered["library"] is None:
        lib = torch.library.Library("aten", "IMPL")
        for name, fn in _IMPLS.items():
            lib.impl(name, fn, "CPU")
        _registered["library"] = lib


__all__ = ["BF16_PLATFORM", "NOT_TRACEABLE", "PRIMITIVES", "batch_norm_backward_elemt",
           "batch_norm_backward_reduce", "batch_norm_elemt", "batch_norm_gather_stats_with_counts",
           "batch_norm_stats", "as_numpy", "check_input_dtype", "check_parameter_dtypes",
           "eager_under_compile", "memory_format", "on", "pinned", "register_cpu_kernels", "resize_out",
           "running_stats_refused", "scratch_running_stats", "to_torch", "TorchViews"]
