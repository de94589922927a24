"""Helpers shared by the op_api modules: the vendor's check idioms (status codes, dtype lists
per SoC, private formats) and the kernel-availability rule.

    >>> from opgraph.core.platform import lookup
    >>> bf16_on(lookup("Ascend910B")), bf16_on(lookup("Ascend910"))
    (True, False)
"""
from __future__ import annotations

from typing import Optional, Sequence

from opgraph.core.dtypes import DataType
from opgraph.core.platform import Platform
from opgraph.core.status import AclnnError, Status
from opgraph.core.tensor import Tensor

F32, F16, BF16, S32 = DataType.FLOAT, DataType.FLOAT16, DataType.BF16, DataType.INT32
MAX_RANK = 8


def invalid(msg: str) -> AclnnError:
    """ACLNN_ERR_PARAM_INVALID (161002) with ``msg``."""
    return AclnnError(Status.ACLNN_ERR_PARAM_INVALID, msg)


def bf16_on(p: Platform) -> bool:
    """``SocVersion ∈ [ASCEND910B, ASCEND910E]`` (910B, 910_93, 950) — the BF16 gate most of the
    family uses."""
    return p.soc in ("Ascend910B", "Ascend910_93") or p.is_regbase


def float_dtypes(p: Platform) -> tuple[DataType, ...]:
    """{F32, F16}, plus BF16 where :func:`bf16_on`."""
    return (F32, F16, BF16) if bf16_on(p) else (F32, F16)


def check_dtype(name: str, t: Optional[Tensor], allowed: Sequence[DataType], p: Platform) -> None:
    """161002 when ``t`` (if given) has a dtype outside ``allowed``."""
    if t is not None and t.dtype not in allowed:
        raise invalid(f"{name}: dtype {t.dtype.name} is not supported on {p.soc} "
                      f"(supported: {', '.join(d.name for d in allowed)})")


def check_not_private(name: str, t: Optional[Tensor]) -> None:
    """161002 when ``t`` (if given) has a private storage format."""
    if t is not None and t.format.is_private:
        raise invalid(f"{name}: private storage format {t.format.name} is not supported "
                      "(use ND, NCHW, NCL, NCDHW or another plain format)")


def check_rank(name: str, t: Tensor, lo: int = 2, hi: int = MAX_RANK) -> None:
    """161002 when ``t``'s rank is outside [lo, hi] (the high bound is checked first)."""
    if t.ndim > hi:
        raise invalid(f"{name}: rank {t.ndim} is greater than {hi}")
    if t.ndim < lo:
        raise invalid(f"{name}: rank {t.ndim} is less than {lo}")


def check_channel_vector(name: str, t: Optional[Tensor], C: int) -> None:
    """161002 unless ``t`` (if given) is 1-D of size C."""
    if t is not None and t.shape != (C,):
        raise invalid(f"{name}: shape {list(t.shape)} must be [C] = [{C}]")


def require_kernel(platforms: Sequence[str], p: Platform, kernel: str) -> None:
    """561003 (kernel not found) on a SoC outside ``platforms`` (those with the op's kernels)."""
    if p.soc not in platforms:
        raise AclnnError(Status.ACLNN_ERR_INNER_FIND_KERNEL_ERROR,
                         f"{kernel} has no kernel on {p.soc} ({p.arch_name}); supported platforms: "
                         f"{', '.join(platforms)}")
