"""Choosing an engine: trust, load, scoring, and the limits (admission, breaker, retry)."""
