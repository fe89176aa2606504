"""Repo-named tokenizers that could not be had, fetched again in the background, with backoff.

A tokenizer named by HF repo id that the gateway could not get at startup (offline, the hub down, a
token not yet mounted: router.prepare.served_models `fetch_hub`) leaves its model tokenizing on the
engines. `HubRetry` tries again `timeouts.hub_retries` times (8 by default), the first after
`timeouts.hub_retry_s` (30 s), each wait twice the last (at most `MAX_DELAY_S`), each fetch bounded by
`timeouts.hub_fetch_s` and run on a thread with the files' loading, so no request waits on it. Files
that arrive are handed to the models on the event loop (`Models.adopt_hub`): the model tokenizes
locally from its next request. Every repo fetched is counted by outcome (`resolved`, or the reason it
is still missing: tokenization.hub.REASONS) and logged; when the attempts are spent with a repo still
missing, that is logged once and the model stays on the engines until a restart.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final

import msgspec

from router.core.variant import Variant
from router.prepare.served_models import Models
from tokenization import CachedEncoder
from tokenization.base import TokenizationError
from tokenization.hub import HubRef, HubUnavailable, fetch_tokenizers
from tokenization.loading import load_encoder

__all__ = ["MAX_DELAY_S", "HubRetry", "HubRetrySettings", "fetch_and_load", "retry_delays"]

log = logging.getLogger(__name__)

MAX_DELAY_S: Final = 600.0
"""The longest wait between two attempts."""

Source = tuple[str | None, str | None, str | None]
Fetched = tuple[Path, dict[Source, CachedEncoder]] | HubUnavailable
"""A repo's directory and its variants' loaded tokenizers (by tokenizer source), or why not."""


class HubRetrySettings(msgspec.Struct, frozen=True):
    """The `[timeouts]` keys of the retry: how many attempts, the first wait, each fetch's bound."""

    attempts: int = 8
    first_s: float = 30.0
    fetch_s: float = 30.0


def retry_delays(first_s: float, attempts: int) -> list[float]:
    """The wait before each attempt: `first_s`, doubling, at most `MAX_DELAY_S`."""
    return [min(first_s * 2**k, MAX_DELAY_S) for k in range(attempts)]


def fetch_and_load(missing: Mapping[HubRef, list[Variant]], timeout_s: float) -> dict[HubRef, Fetched]:
    """Fetch each missing repo (at most `timeout_s` for all) and load the tokenizer of every variant
    reading it; files that do not load are `unreadable`. Blocking: run on a thread."""
    found: dict[HubRef, Fetched] = {}
    for ref, got in fetch_tokenizers(missing, timeout_s).items():
        if isinstance(got, HubUnavailable):
            found[ref] = got
            continue
        try:
            encoders = {v.tokenizer_source: load_encoder(str(got), v.chat_template) for v in missing[ref]}
        except (TokenizationError, OSError) as exc:
            found[ref] = HubUnavailable(ref, "unreadable", str(exc))
            continue
        found[ref] = (got, encoders)
    return found


class HubRetry:
    """The background retry of one gateway process's missing repo-named tokenizers (module docstring)."""

    def __init__(self, models: Models, settings: HubRetrySettings, count: Callable[[str], None]) -> None:
        """`count(outcome)` counts each repo fetched: `resolved`, or the reason it is still missing."""
        self.models, self.settings, self.count = models, settings, count
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the retries (none when `attempts` is 0)."""
        if self.settings.attempts > 0:
            self._task = asyncio.create_task(self._run(), name="hub-retry")

    async def close(self) -> None:
        """Stop retrying (a fetch under way on its thread is abandoned: its answer is not read)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        settings = self.settings
        delays = retry_delays(settings.first_s, settings.attempts)
        for attempt, delay in enumerate(delays, 1):
            await asyncio.sleep(delay)  # a backoff period, not synchronisation
            missing = self.models.hub_missing()
            if missing:
                found = await asyncio.to_thread(fetch_and_load, missing, settings.fetch_s)
                self._apply(found, attempt)
        if still := self.models.hub_missing():
            repos = sorted(ref[0] for ref in still)
            log.warning(
                "tokenizer retries spent: the engines' /tokenize stands in until a restart",
                extra={"repos": repos, "attempts": settings.attempts},
            )

    def _apply(self, found: Mapping[HubRef, Fetched], attempt: int) -> None:
        """Hand what arrived to the models (on the event loop); count and log every outcome."""
        for ref, got in found.items():
            if isinstance(got, HubUnavailable):
                self.count(got.reason)
                log.info("tokenizer retry: still unavailable", extra={"attempt": attempt, "error": str(got)})
            else:
                self.models.adopt_hub(ref, *got)
                self.count("resolved")
