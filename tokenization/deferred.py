"""Stores a cache may defer: what an encoding, decode or keying keeps only for later requests.

A cache with `later` set appends such a store there instead of running it: one `functools.partial`
of its store and the store's arguments, made where it would have run (no helper call between: this
is on every request's path); whoever set it runs them all before the next request is prepared
(router.prepare.served_models: right after the request is written to its engine). Pure.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

__all__ = ["Later"]

Later: TypeAlias = list[Callable[[], None]]
"""The stores deferred so far, in the order they were made."""
