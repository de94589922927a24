"""The conformance kit for backend authors: :func:`check_backend` runs every registered op_api
through a backend — every level, platform, dtype, generator flag, with contiguous and strided
outputs (and, on request, channels-last tensors) — and compares each output bit for bit with the
numpy reference backend.

    >>> report = check_backend("numpy", op_apis=["aclnnBatchNormElemtBackward"],
    ...                        platforms=["Ascend910B"], levels=[2], dtypes=["float16"])
    >>> report.ok, report.cases > 0
    (True, True)

A case passes when every output and in-out tensor has the reference's bits (NaNs must sit at
the same positions; which NaN is left open, as IEEE 754 leaves it) and the elements of a strided
output's buffer that the view does not cover are untouched.
"""
from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

import numpy as np

from opgraph.core.backend import Backend, get
from opgraph.core.config import opt_level, use_backend
from opgraph.core.dtypes import DataType, dtype_of
from opgraph.core.opapi import InputConfig, OpApiSpec, get_op_api, load_entry_points, op_api_specs
from opgraph.core.platform import lookup, platform
from opgraph.core.status import Status
from opgraph.core.tensor import tensor
from opgraph.aclnn.twophase import aclGetRecentErrMsg

SENTINEL = 0xA5  # byte pattern of the gaps of strided output buffers
LAYOUTS = ("contiguous", "strided", "channels_last")


@dataclass(frozen=True)
class Case:
    """One configuration: op_api, platform, data dtype, level, layout of the outputs, options."""

    op_api: str
    platform: str
    dtype: str
    level: int
    layout: str
    options: tuple[tuple[str, Any], ...] = ()
    shape: tuple[int, ...] = ()

    def __str__(self) -> str:
        opts = "".join(f" {k}={v}" for k, v in self.options)
        shape = ",".join(map(str, self.shape))
        return f"{self.op_api} [{shape}] {self.platform} {self.dtype} O{self.level} {self.layout}{opts}"


@dataclass(frozen=True)
class Failure:
    """A case whose outputs differ from the reference (or that failed to run)."""

    case: Case
    detail: str

    def __str__(self) -> str:
        return f"{self.case}: {self.detail}"


@dataclass
class BackendReport:
    """What :func:`check_backend` found: ``cases`` run, ``failures`` among them."""

    backend: str
    cases: int = 0
    failures: list[Failure] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # op_apis without an input generator

    @property
    def ok(self) -> bool:
        """True when no case failed (op_apis skipped for want of an input generator do not count)."""
        return not self.failures

    def __str__(self) -> str:
        failed = len({f.case for f in self.failures})  # (a case may fail in several outputs)
        head = f"backend {self.backend!r}: {self.cases} cases, {failed} failed"
        if self.skipped:
            head += f"; skipped (no input generator): {', '.join(self.skipped)}"
        return "\n".join([head] + [f"  {f}" for f in self.failures[:50]]
                         + ([f"  ... {len(self.failures) - 50} more"] if len(self.failures) > 50 else []))


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.itemsize}") if a.dtype.kind in "fV" or a.dtype.itemsize == 2 else a


def compare(actual: np.ndarray, expected: np.ndarray) -> Optional[str]:
    """None when the bits agree (NaN positions must match, not payloads), else what differs."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return f"type {actual.dtype}{list(actual.shape)} != {expected.dtype}{list(expected.shape)}"
    a, e = np.ascontiguousarray(actual), np.ascontiguousarray(expected)
    nan_a = np.isnan(a.astype(np.float64)) if a.dtype.kind in "fV" or a.dtype.itemsize == 2 else None
    if nan_a is not None:
        nan_e = np.isnan(e.astype(np.float64))
        same = (_bits(a) == _bits(e)) | (nan_a & nan_e)
    else:
        same = a == e
    if same.all():
        return None
    bad = np.argwhere(~same)
    i = tuple(int(k) for k in bad[0])
    return (f"{len(bad)} of {a.size} elements differ, first at {list(i)}: "
            f"{a[i]!r} != reference {e[i]!r}")


def _strided(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A view of ``a``'s shape and values whose last dim has stride 2, over a sentinel buffer."""
    buf = np.full(max(a.size, 1) * 2, 0, dtype=a.dtype)
    buf.view(np.uint8)[...] = SENTINEL
    view = buf[: a.size * 2].reshape(a.shape[:-1] + (a.shape[-1] * 2,))[..., ::2] if a.ndim else buf[:1].reshape(())
    view[...] = a
    return view, buf


def channels_last(a: np.ndarray) -> np.ndarray:
    """A copy of ``a`` (rank ≥ 3) with its dim 1, the channel, innermost in memory.

    >>> channels_last(np.zeros((2, 3, 4, 5), np.float32)).strides
    (240, 4, 60, 12)
    """
    order = (0, *range(2, a.ndim), 1)
    return np.ascontiguousarray(a.transpose(order)).transpose(np.argsort(order))


def _run(spec: OpApiSpec, arrays: dict, layout: str, cfg: InputConfig) -> tuple[Optional[str], dict, dict]:
    """Both phases on fresh copies of ``arrays``; returns (error, written arrays, their buffers)."""
    written = {p.name for p in spec.tensor_params("output", "inout")}
    fresh, bufs = {}, {}
    for k, v in arrays.items():
        if isinstance(v, np.ndarray):
            if k in written and layout == "strided" and v.ndim:
                fresh[k], bufs[k] = _strided(v)
            elif layout == "channels_last" and v.ndim >= 3 and v.shape == tuple(cfg.shape):
                fresh[k] = channels_last(v)
            else:
                fresh[k] = v.copy()
        else:
            fresh[k] = v
    status, ws, ex = spec.get_workspace_size(*spec.args_of(fresh, tensor, cfg))
    if status != Status.ACLNN_SUCCESS:
        return f"phase 1 failed: {aclGetRecentErrMsg()}", fresh, bufs
    status = spec.run(bytearray(ws) if ws else None, ws, ex)
    if status != Status.ACLNN_SUCCESS:
        return f"phase 2 failed: {aclGetRecentErrMsg()}", fresh, bufs
    return None, {k: fresh[k] for k in written if fresh.get(k) is not None}, bufs


def _flag_sets(spec: OpApiSpec) -> Iterator[tuple[tuple[str, Any], ...]]:
    flags = [o.name for o in spec.options if o.type == "flag"]
    for values in itertools.product((False, True), repeat=len(flags)):
        yield tuple(zip(flags, values))


def _config(spec: OpApiSpec, shape: tuple[int, ...], dtype: DataType,
            flags: Iterable[tuple[str, Any]]) -> InputConfig:
    options = {o.name: o.default for o in spec.options}
    options.update(dict(flags))
    return InputConfig(shape, dtype, options)


def default_shapes(spec: OpApiSpec) -> list[tuple[int, ...]]:
    """The op_api's default shape and one with ≥ 8192 elements (large enough that backends
    which run tiny kernels elsewhere, like native, run their own code)."""
    small = tuple(spec.default_shape)
    head = math.prod(small[:-1]) or 1
    return [small, small[:-1] + (max(small[-1], -(-8192 // head)),)]


def check_backend(backend: Union[str, Backend], *, op_apis: Optional[Sequence[str]] = None,
                  platforms: Optional[Sequence[str]] = None, levels: Sequence[int] = (0, 1, 2),
                  dtypes: Optional[Sequence[str]] = None, layouts: Sequence[str] = ("contiguous", "strided"),
                  shapes: Optional[Sequence[tuple[int, ...]]] = None, seed: int = 0) -> BackendReport:
    """Run op_apis through ``backend`` (a registered name or an instance) and the numpy reference
    backend on identical inputs — every registered op_api (installed ones too) unless ``op_apis``
    names some, on its platforms, dtypes, generator flags, ``shapes`` (default:
    :func:`default_shapes`), ``levels`` and ``layouts`` ("contiguous", "strided": the outputs
    with gaps; "channels_last": every tensor of the op's shape, rank ≥ 3, with the channels
    innermost) — and report every case whose
    outputs differ, and every case whose phase 2 fails on both (the generator's inputs are valid;
    a phase 1 both refuse, such as an output layout the op_api does not take, is not reported)."""
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown:
        raise ValueError(f"unknown layout {unknown[0]!r}: the kit's layouts are {', '.join(LAYOUTS)}")
    target = get(backend)
    report = BackendReport(target.name)
    for ep in load_entry_points():  # installed op_apis are registered ones too (as in the CLI)
        if ep.error is not None:
            warnings.warn(ep.failure, stacklevel=2)
    specs = [get_op_api(n) for n in op_apis] if op_apis else list(op_api_specs().values())
    for spec in specs:
        if spec.make_inputs is None:
            report.skipped.append(spec.name)
            continue
        socs = [s for s in spec.platforms if platforms is None or s in platforms]
        for soc in socs:
            allowed = spec.dtypes(lookup(soc))
            chosen = [d for d in allowed if dtypes is None or d in {dtype_of(x) for x in dtypes}]
            for shape, dt, flags, level, layout in itertools.product(
                    shapes or default_shapes(spec), chosen, list(_flag_sets(spec)), levels, layouts):
                case = Case(spec.name, soc, dt.name.lower(), level, layout, flags, tuple(shape))
                report.cases += 1
                rng = np.random.default_rng(seed)
                cfg = _config(spec, tuple(shape), dt, flags)
                arrays = spec.make_inputs(cfg, rng)
                with platform(soc), opt_level(level):
                    with use_backend("numpy"):  # the same layout: some op_apis refuse strided outputs
                        err_ref, ref, _ = _run(spec, arrays, layout, cfg)
                    with use_backend(target):
                        err, got, bufs = _run(spec, arrays, layout, cfg)
                if err_ref or err:
                    # (phase 2's message names the backend that failed: not a difference)
                    if err_ref != (err or "").replace(f"backend {target.name!r}", "backend 'numpy'"):
                        report.failures.append(Failure(case, err or f"reference {err_ref}"))
                    elif err_ref.startswith("phase 2"):  # generated inputs are valid: a bug in both
                        report.failures.append(Failure(case, f"{err_ref} (on the numpy reference "
                                                             "too: the inputs are valid)"))
                    continue
                for name, expected in ref.items():
                    diff = compare(np.asarray(got[name]), expected)
                    if diff is None and name in bufs:
                        gaps = bufs[name].view(np.uint8).reshape(-1, bufs[name].itemsize)[1::2]
                        if not (gaps == SENTINEL).all():
                            diff = "wrote outside the strided output view"
                    if diff:
                        report.failures.append(Failure(case, f"{name}: {diff}"))
    return report


__all__ = ["BackendReport", "Case", "Failure", "channels_last", "check_backend", "compare"]
