"""Stores a cache may defer: what an encoding, decode or keying keeps only for later requests.

A cache with `later` set appends such a store there instead of running it (`keep_or_defer`); whoever
set it runs them all before the next request is prepared (router.prepare.served_models: right after
the request is written to its engine). Pure.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import ParamSpec, TypeAlias

__all__ = ["Later", "keep_or_defer"]

P = ParamSpec("P")

Later: TypeAlias = list[Callable[[], None]]
"""The stores deferred so far, in the order they were made."""


def keep_or_defer(later: Later | None, store: Callable[P, None], *args: P.args, **kwargs: P.kwargs) -> None:
    """`store(*args, **kwargs)` now when `later` is None, else appended to `later` to run with the rest."""
    if later is None:
        store(*args, **kwargs)
    else:
        later.append(partial(store, *args, **kwargs))
