"""Distinct names for the identifiers the router's decision layer passes around."""

from __future__ import annotations

from typing import NewType

__all__ = ["EngineId", "RequestId"]

EngineId = NewType("EngineId", str)
"""An engine's configured (or discovered) name; one engine may have several DP ranks."""

RequestId = NewType("RequestId", str)
"""The router's id for one client request (also sent back as `x-request-id`)."""
