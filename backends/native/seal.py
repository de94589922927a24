"""The seal of a cached kernel library: :data:`SEAL` and the sha256 of its cache key and bytes,
appended to the library (ELF ignores trailing bytes). :mod:`.build` loads a cached library only
when its seal matches: ``dlopen()`` of a truncated library can succeed and then crash the
process with SIGBUS, and another kernel's library under this key's name would run as this one.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

SEAL = b"\0opgraph-kernel-seal:"  # + 64 hex digits: the end of every cached library


def _digest(key: str, body: bytes) -> bytes:
    return SEAL + hashlib.sha256(key.encode() + b"\0" + body).hexdigest().encode()


def seal(lib: Path, key: str) -> None:
    """Append the seal of cache key ``key`` to the library ``lib`` (ELF ignores trailing bytes).

        >>> import tempfile; p = Path(tempfile.mkdtemp()) / "x.so"; _ = p.write_bytes(b"ELF")
        >>> seal(p, "k1"); sealed(p, "k1"), sealed(p, "k2")
        (True, False)
    """
    body = lib.read_bytes()
    with open(lib, "ab") as f:
        f.write(_digest(key, body))


def sealed(lib: Path, key: str) -> bool:
    """Whether ``lib`` ends with the seal of ``key`` over the bytes before it (see :func:`seal`);
    False for a file that cannot be read."""
    try:
        data = lib.read_bytes()
    except OSError:
        return False
    n = len(SEAL) + 64
    return len(data) > n and data[-n:] == _digest(key, data[:-n])


__all__ = ["SEAL", "seal", "sealed"]
