"""Host-side tiling of the DAV_2201 SyncBatchNormBackwardElemt kernel: pure integer math.

The 910B kernel splits the flattened element count over AI Vector cores in 512-byte GM blocks,
then each core walks its range tile by tile (CopyIn → Compute → CopyOut), double-buffered when a
core has enough work. :func:`compute_tiling` follows the issue's rules step by step; the result
carries the nine-field :class:`TilingData` the kernel receives, ``blockDim`` and the tiling key.

    >>> t = compute_tiling(24, "float16", cores=40)      # shape 2,3,1,4 in fp16
    >>> t.data.as_tuple()
    (256, 512, 2, 1, 256, 256, 256, 0, 0)
    >>> t.block_dim, t.key, t.data.core(0)
    (1, 0, CoreRange(core=0, start=0, elements=256, tiles=1, tail=256, big=False))
    >>> t.ub_bytes()
    4096
"""
from __future__ import annotations

from dataclasses import astuple, dataclass, fields
from typing import NamedTuple

from l0ops.batchnorm import KERNEL_VARIANTS, MODELLED_ARCHS
from opgraph.core.dtypes import DataType, dtype_of
from opgraph.core.platform import PRESETS, Platform

F32, F16, BF16 = DataType.FLOAT, DataType.FLOAT16, DataType.BF16

GM_BLOCK_BYTES = 512          # GM alignment of every DataCopy
TILE_MAX_F16 = 6144           # (fp16, fp16)
TILE_MAX_OTHER = 3072         # (bf16, bf16), (fp16, fp32), (fp32, fp32)
TILING_KEY = 0                # ELEMENTWISE_TPL_SCH_MODE_0
SIM_ARCHS = (2201, 1001)      # archs whose (DAV_2201-flavoured) kernel ascend-sim models
# Float32 temporaries the float template paths keep in UB, in tiles. bf16/bf16 casts all seven
# operands up and keeps a float result (8); fp16/fp32 only casts gradOut and input up, plus the
# result (3). With double-buffered queues at tileMax both fill the 910B's 192 KiB exactly, as the
# direct paths do, which is why the tiling caps are what they are.
FLOAT_TMP_TILES = {(BF16, BF16): 8, (F16, F32): 3}


class NotModelledError(ValueError):
    """The platform's SyncBatchNormBackwardElemt kernel is not the one ascend-sim models."""


def ceil_div(a: int, b: int) -> int:
    """``a / b`` rounded up, in integers (for ``b`` > 0).

        >>> ceil_div(10, 4), ceil_div(8, 4), ceil_div(0, 4)
        (3, 2, 0)
    """
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    """``a`` rounded up to a multiple of ``b`` (e.g. elements to whole 512-byte blocks).

        >>> round_up(1000, 128), round_up(1024, 128), round_up(0, 128)
        (1024, 1024, 0)
    """
    return ceil_div(a, b) * b


def check_modelled(where: "Platform | int") -> None:
    """Raise :class:`NotModelledError` (one clear line) unless ascend-sim models the kernel of a
    platform or NpuArch number.

    >>> try:
    ...     check_modelled(PRESETS["Ascend950"])
    ... except NotModelledError as e:
    ...     print(e)
    ascend-sim models the DAV_2201 kernel only; Ascend950's DAV_3510 kernel is not modelled
    """
    if isinstance(where, Platform):
        arch, soc, supported = where.npu_arch, where.soc, where.npu_arch in MODELLED_ARCHS
    else:
        arch = int(where)
        p = next((q for q in PRESETS.values() if q.npu_arch == arch), None)
        soc, supported = (p.soc if p else "an unknown SoC"), arch in MODELLED_ARCHS
    if arch in SIM_ARCHS and supported:
        return
    if not supported:
        raise NotModelledError(f"{soc} (DAV_{arch}) has no SyncBatchNormBackwardElemt kernel; "
                               "ascend-sim models the DAV_2201 kernel only")
    raise NotModelledError(f"ascend-sim models the DAV_2201 kernel only; "
                           f"{soc}'s DAV_{arch} kernel is not modelled")


class CoreRange(NamedTuple):
    """What one core does: ``elements`` from GM element ``start`` in ``tiles`` tiles, the last
    one of ``tail`` elements; ``big`` when it is one of the first ``tailBlockNum`` cores."""

    core: int
    start: int
    elements: int
    tiles: int
    tail: int
    big: bool

    @property
    def stop(self) -> int:
        """The GM element after the core's last one (``start + elements``)."""
        return self.start + self.elements


@dataclass(frozen=True)
class TilingData:
    """The kernel's TilingData, fields in the order the kernel reads them."""

    smallCoreDataNum: int
    bigCoreDataNum: int
    finalBigTileNum: int
    finalSmallTileNum: int
    tileDataNum: int
    smallTailDataNum: int
    bigTailDataNum: int
    tailBlockNum: int
    usedDb: int

    @property
    def buffer_num(self) -> int:
        """Queue depth: 2 when double-buffered (usedDb = 1), else 1."""
        return 2 if self.usedDb else 1

    def as_tuple(self) -> tuple[int, ...]:
        """The field values in TilingData order (the order the kernel reads them)."""
        return astuple(self)

    def items(self) -> list[tuple[str, int]]:
        """``[(field name, value)]`` in TilingData order."""
        return [(f.name, getattr(self, f.name)) for f in fields(self)]

    def core(self, i: int) -> CoreRange:
        """The kernel's Init for block ``i``: big cores first, then small ones packed after them.

        >>> TilingData(384, 512, 1, 1, 512, 384, 512, 1, 0).core(1)
        CoreRange(core=1, start=512, elements=384, tiles=1, tail=384, big=False)
        """
        start = self.bigCoreDataNum * i
        if i < self.tailBlockNum:
            return CoreRange(i, start, self.bigCoreDataNum, self.finalBigTileNum,
                             self.bigTailDataNum, True)
        start -= (self.bigCoreDataNum - self.smallCoreDataNum) * (i - self.tailBlockNum)
        return CoreRange(i, start, self.smallCoreDataNum, self.finalSmallTileNum,
                         self.smallTailDataNum, False)


class UBBuffer(NamedTuple):
    """One ``pipe.InitBuffer``: ``num`` slots of ``nbytes`` each."""

    name: str
    num: int
    nbytes: int
    what: str

    @property
    def total(self) -> int:
        """Bytes reserved: ``num × nbytes``."""
        return self.num * self.nbytes


def kernel_path(dtype: DataType, param_dtype: DataType) -> str:
    """'direct' (fp16/fp16, fp32/fp32 compute in T) or 'float' (cast up, compute, RNE back)."""
    return "float" if (dtype, param_dtype) in FLOAT_TMP_TILES else "direct"


@dataclass(frozen=True)
class Tiling:
    """A computed tiling: TilingData, launch parameters and the inputs it was derived from."""

    data: TilingData
    block_dim: int
    key: int
    numel: int            # N, the tensor's element count
    padded: int           # L, N rounded up to whole 512-byte blocks
    block_elems: int      # E, elements per 512-byte block
    tile_max: int
    dtype: DataType       # T (gradOut, input, gradInput)
    param_dtype: DataType  # T1 (mean, invstd, weight, meanDy, meanDyXmu)
    cores_available: int  # R

    @property
    def path(self) -> str:
        """'direct' or 'float': the kernel's template for (T, T1) (:func:`kernel_path`)."""
        return kernel_path(self.dtype, self.param_dtype)

    def cores(self) -> list[CoreRange]:
        """The range of each of the ``block_dim`` launched cores, in block order."""
        return [self.data.core(i) for i in range(self.block_dim)]

    def ub_plan(self) -> list[UBBuffer]:
        """The UB the kernel reserves per core, buffer by buffer (queues × buffer count)."""
        d, n = self.data, self.data.buffer_num
        tile, st, sp = d.tileDataNum, self.dtype.itemsize, self.param_dtype.itemsize
        plan = [UBBuffer("inQueueX", n, 2 * tile * st, f"gradOut, input: 2 x {tile} {self.dtype.short}"),
                UBBuffer("inQueueParams", n, 5 * tile * sp,
                         f"mean, invstd, weight, meanDy, meanDyXmu: 5 x {tile} {self.param_dtype.short}"),
                UBBuffer("outQueue", n, tile * st, f"gradInput: {tile} {self.dtype.short}")]
        k = FLOAT_TMP_TILES.get((self.dtype, self.param_dtype), 0)
        if k:
            plan.append(UBBuffer("floatTmp", 1, k * tile * 4, f"float temporaries: {k} x {tile} f32"))
        return plan

    def ub_bytes(self) -> int:
        """Bytes of UB one core reserves."""
        return sum(b.total for b in self.ub_plan())

    def describe(self, ub_size: "int | None" = None) -> str:
        """A human-readable printout: TilingData in order, launch, per-core ranges, UB usage."""
        lines = [f"N={self.numel} {self.dtype.short}/{self.param_dtype.short} ({self.path} path): "
                 f"E={self.block_elems} elements per {GM_BLOCK_BYTES} B, L={self.padded}, "
                 f"tileMax={self.tile_max}, R={self.cores_available}", "TilingData:"]
        lines += [f"  {name:<18} {value}" for name, value in self.data.items()]
        lines.append(f"blockDim {self.block_dim}, tiling key {self.key}")
        lines.append("cores:   core  kind   range                    elements  tiles  last tile")
        for c in self.cores():
            rng = f"[{c.start}, {c.stop})"
            lines.append(f"         {c.core:>4}  {'big' if c.big else 'small':<5}  {rng:<23}  "
                         f"{c.elements:>8}  {c.tiles:>5}  {c.tail:>9}")
        used = self.ub_bytes()
        head = f"UB per core: {used} B"
        if ub_size is not None:
            head += f" of {ub_size} B ({100 * used / ub_size:.1f}%)" if ub_size else f" of {ub_size} B"
            if used > ub_size:
                head += f" -- OVERFLOW by {used - ub_size} B"
        lines.append(head)
        lines += [f"  {b.name:<14} {b.num} x {b.nbytes:>6} B = {b.total:>6} B  ({b.what})"
                  for b in self.ub_plan()]
        return "\n".join(lines)


def compute_tiling(numel: int, dtype: "DataType | str", param_dtype: "DataType | str | None" = None,
                   *, cores: int) -> Tiling:
    """The kernel's tiling for ``numel`` elements of ``dtype`` (T) with parameters of
    ``param_dtype`` (T1, default T) on ``cores`` vector cores (R).

    >>> compute_tiling(896, "float32", cores=40).data.as_tuple()   # the core-doubling rule
    (384, 512, 1, 1, 512, 384, 512, 1, 0)
    """
    T = dtype_of(dtype)
    T1 = dtype_of(param_dtype) if param_dtype is not None else T
    if (T, T1) not in KERNEL_VARIANTS:
        known = ", ".join(sorted(f"{a.short}/{b.short}" for a, b in KERNEL_VARIANTS))
        raise ValueError(f"SyncBatchNormBackwardElemt has no kernel for (T, T1) = "
                         f"({T.short}, {T1.short}); variants: {known}")
    if numel <= 0:
        raise ValueError(f"no tiling for {numel} elements: an empty tensor launches no kernel")
    if cores <= 0:
        raise ValueError(f"core count must be positive, got {cores}")
    E = GM_BLOCK_BYTES // T.itemsize
    L = round_up(numel, E)
    tile_max = TILE_MAX_F16 if (T, T1) == (F16, F16) else TILE_MAX_OTHER
    used = min(cores, ceil_div(L, 2 * tile_max))
    per = ceil_div(L, used)
    if used < cores // 4 and per > tile_max // 4:
        used *= 2
        per = ceil_div(L, used)
    used_db = 0 if per < tile_max // 2 else 1
    tile = min(tile_max, round_up(ceil_div(per, 2 if used_db else 1), E))
    blocks = L // E
    small = blocks // used * E
    big = small + E
    small_tiles, big_tiles = ceil_div(small, tile), ceil_div(big, tile)
    data = TilingData(
        smallCoreDataNum=small, bigCoreDataNum=big, finalBigTileNum=big_tiles,
        finalSmallTileNum=small_tiles, tileDataNum=tile,
        smallTailDataNum=small - (small_tiles - 1) * tile,
        bigTailDataNum=big - (big_tiles - 1) * tile,
        tailBlockNum=blocks % used, usedDb=used_db)
    return Tiling(data, used, TILING_KEY, numel, L, E, tile_max, T, T1, cores)
