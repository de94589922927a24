"""SoC presets and the current platform (a context variable: thread- and task-safe).

    >>> get_platform().soc
    'Ascend910B'
    >>> with platform("Ascend950") as p:
    ...     p.npu_arch, p.vector_cores, p.ub_size
    (3510, 64, 245760)
"""
from __future__ import annotations

import contextlib
import contextvars
import operator
from dataclasses import dataclass


@dataclass(frozen=True)
class Platform:
    """One SoC: its short version, NpuArch number, AI Vector core count and UB bytes."""

    soc: str
    soc_version: int  # opbase SocVersion enum value
    npu_arch: int
    vector_cores: int
    ub_size: int

    def __post_init__(self) -> None:
        # a hand-made platform feeds the tilings (they divide by the core count): checked here,
        # not as a ZeroDivisionError inside phase 1
        if not isinstance(self.soc, str):
            raise TypeError(f"soc must be a str, got {type(self.soc).__name__}")
        for name in ("soc_version", "npu_arch", "vector_cores", "ub_size"):
            value = getattr(self, name)
            try:
                if isinstance(value, bool):
                    raise TypeError
                object.__setattr__(self, name, operator.index(value))  # (numpy ints as ints)
            except TypeError:
                raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
        for name in ("vector_cores", "ub_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    @property
    def arch_name(self) -> str:
        """The arch's name as CANN spells it, e.g. for the Ascend950:

            >>> PRESETS["Ascend950"].arch_name
            'DAV_3510'
        """
        return f"DAV_{self.npu_arch}"

    @property
    def is_regbase(self) -> bool:
        """Only DAV_3510 (Ascend950) is a regbase arch."""
        return self.npu_arch == 3510

    @property
    def core_count(self) -> int:
        """The AI Vector cores the tilings split work over (:attr:`vector_cores`).

            >>> PRESETS["Ascend910B"].core_count
            40
        """
        return self.vector_cores


PRESETS: dict[str, Platform] = {
    p.soc: p
    for p in [
        Platform("Ascend910B", 1, 2201, 40, 196608),
        Platform("Ascend910_93", 2, 2201, 48, 196608),
        Platform("Ascend950", 3, 3510, 64, 245760),
        Platform("Ascend910", 0, 1001, 32, 262144),
        Platform("Ascend310P", 6, 2002, 8, 262144),
        Platform("Ascend310B", 7, 3002, 1, 196608),
    ]
}
_ALIASES = {"Ascend910_95": "Ascend950"}
DEFAULT = "Ascend910B"

_current: contextvars.ContextVar[Platform] = contextvars.ContextVar("opgraph_platform", default=PRESETS[DEFAULT])


def lookup(name: "str | Platform") -> Platform:
    """The preset named ``name`` (``Ascend910_95`` is an alias of ``Ascend950``)."""
    if isinstance(name, Platform):
        return name
    key = _ALIASES.get(name, name)
    try:
        return PRESETS[key]
    except KeyError:
        raise ValueError(f"unknown platform {name!r}; known: {', '.join(PRESETS)}") from None


def get_platform() -> Platform:
    """The platform phase 1 records for (default Ascend910B)."""
    return _current.get()


def set_platform(name: "str | Platform") -> Platform:
    """Set the platform for the current thread/context; returns it."""
    p = lookup(name)
    _current.set(p)
    return p


class platform(contextlib.ContextDecorator):
    """Run a block on another SoC: ``with opgraph.platform("Ascend950"): ...`` (or decorate a
    function; a class, as :class:`opgraph.core.config.use_backend`)."""

    __slots__ = ("name", "_token")

    def __init__(self, name: "str | Platform") -> None:
        self.name = name

    def _recreate_cm(self) -> "platform":  # each decorated call enters its own
        return platform(self.name)

    def __enter__(self) -> Platform:
        p = lookup(self.name)
        self._token = _current.set(p)
        return p

    def __exit__(self, *exc: object) -> None:
        _current.reset(self._token)
