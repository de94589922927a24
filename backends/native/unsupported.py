"""What the native backend does not cover: :class:`Unsupported` (a body, or a part of one, the
C code does not render; the backend then runs it on numpy) and how the plan caches remember that
outcome (:class:`Refused`, :func:`remembered`), so that such a body is not planned again on every
call.

    >>> r = remembered(lambda: (_ for _ in ()).throw(Unsupported("pow")))
    >>> isinstance(r, Refused), r.reason
    (True, 'pow')
"""
from __future__ import annotations

from typing import Any, Callable, NoReturn


class Unsupported(ValueError):
    """The body has a part the C kernel does not render (the backend runs it on numpy)."""


class Refused:
    """A remembered :class:`Unsupported` outcome: what a plan cache keeps for a body (and
    operand layouts) the C code does not cover; :meth:`raise_` raises it anew."""

    __slots__ = ("reason", "attrs")

    def __init__(self, reason: str, attrs: Any = None):
        self.reason, self.attrs = reason, attrs

    def raise_(self) -> NoReturn:
        """Raise the remembered :class:`Unsupported` again, with its reason."""
        raise Unsupported(self.reason)


def remembered(make: Callable[[], Any], attrs: Any = None) -> Any:
    """``make()``, or a :class:`Refused` with its :class:`Unsupported` reason (and ``attrs``)."""
    try:
        return make()
    except Unsupported as e:
        return Refused(str(e), attrs)


def planned(memo: Any, obj: object, key: tuple, make: Callable[[], Any]) -> Any:
    """``memo.get(obj, key, make)`` (an :class:`~l0ops.primitives.IdentityMemo`) that keeps an
    :class:`Unsupported` outcome too: the plan, or Unsupported raised anew with its reason."""
    got = memo.get(obj, key, lambda: remembered(make))
    if isinstance(got, Refused):
        got.raise_()
    return got


__all__ = ["Refused", "Unsupported", "planned", "remembered"]
