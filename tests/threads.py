"""A test helper: call a function concurrently from several threads and collect what differs.

    >>> got, errors = hammer(lambda k: k * k, [0, 1, 4], lambda a, b: a == b, rounds=3)
    >>> got, errors
    ({0: 0, 1: 1, 2: 4}, [])
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, ContextManager, Sequence


def hammer(call: Callable[[int], Any], wants: Sequence[Any], same: Callable[[Any, Any], bool],
           rounds: int = 40, context: Callable[[], ContextManager] = contextlib.nullcontext,
           timeout: float = 120.0) -> tuple[dict[int, Any], list]:
    """Run ``call(k)`` ``rounds`` times on thread k for each ``wants[k]``, each thread inside
    ``context()``; return the last result per thread and the errors: a k whose result was not
    ``same`` as ``wants[k]``, or an exception raised."""
    got: dict[int, Any] = {}
    errors: list = []

    def work(k: int) -> None:
        try:
            with context():
                for _ in range(rounds):
                    got[k] = call(k)
                    if not same(got[k], wants[k]):
                        errors.append(k)
                        return
        except Exception as e:  # reported to the caller
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(wants))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    return got, errors
