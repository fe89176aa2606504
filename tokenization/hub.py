"""A tokenizer named as users name models: an HF repo id (`Qwen/Qwen3-8B`) read through `huggingface_hub`.

A `tokenizer` setting is a local path or a repo id (`tokenization.hub_names.hub_repo`). A repo id is
resolved by `huggingface_hub.snapshot_download` restricted to the files `HfTokenizer.from_dir` reads
(`TOKENIZER_FILES`), so its cache (`HF_HOME`, `HF_HUB_CACHE`), offline mode (`HF_HUB_OFFLINE`),
endpoint (`HF_ENDPOINT`) and token (`HF_TOKEN`, or the login file) apply as huggingface_hub reads
them; we never read or log the token.

The library's HTTP client has no timeout of its own, so each resolution runs on a daemon thread and is
waited for at most `timeout_s`: a blackholed network costs startup that long, never a hang, and the
thread (blocked in the library) cannot keep the process alive. Every failure is a `HubUnavailable`
with a short `reason` (`REASONS`), for the caller to count and fall back on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from pathlib import Path

from tokenization.base import TokenizationError

__all__ = [
    "REASONS",
    "TOKENIZER_FILES",
    "HubRef",
    "HubUnavailable",
    "fetch_tokenizers",
]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
"""What `HfTokenizer.from_dir` reads; nothing else of the repo (weights, configs) is fetched."""

REASONS = ("offline", "unreachable", "timeout", "unauthorized", "not_found", "no_tokenizer", "unreadable")
"""Why a repo's tokenizer could not be had: not cached while `HF_HUB_OFFLINE`; the hub not reached
(no network, 5xx) and not cached; no answer within the timeout; 401/403 or a gated repo without
access; no such repo or revision; no `tokenizer.json` in it (or a partial cached snapshot); its files
do not load (the loader's verdict, raised by whoever loads them)."""

HubRef = tuple[str, str | None]
"""A repo id and its revision (a branch, tag or commit; None: `main`)."""


class HubUnavailable(TokenizationError):
    """A repo's tokenizer files could not be had; `reason` is one of `REASONS`."""

    def __init__(self, ref: HubRef, reason: str, detail: str) -> None:
        self.ref, self.reason = ref, reason
        at = f"@{ref[1]}" if ref[1] else ""
        super().__init__(f"tokenizer {ref[0]}{at} from the HF hub: {reason}: {detail}")


def _reason(exc: BaseException) -> str:
    """The `REASONS` entry for what `snapshot_download` raised."""
    from huggingface_hub import constants, errors

    if isinstance(exc, errors.IncompleteSnapshotError):
        return "no_tokenizer"
    if isinstance(exc, errors.LocalEntryNotFoundError):  # not cached, and the hub said why (or nothing)
        if isinstance(exc.__cause__, errors.HfHubHTTPError):
            return _reason(exc.__cause__)
        asked = exc.__cause__ is not None and not isinstance(exc.__cause__, errors.OfflineModeIsEnabled)
        return "unreachable" if asked and not constants.is_offline_mode() else "offline"
    if isinstance(exc, errors.GatedRepoError):
        return "unauthorized"
    if isinstance(exc, errors.RepositoryNotFoundError | errors.RevisionNotFoundError):
        return "not_found"
    if isinstance(exc, errors.HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else 0
        return "unauthorized" if status in (401, 403) else "unreachable"
    return "unreachable"


def _fetch(ref: HubRef, cache_only: bool) -> Path:
    """The local snapshot directory holding the repo's tokenizer files (downloaded if need be and not
    `cache_only`)."""
    from huggingface_hub import snapshot_download

    patterns = list(TOKENIZER_FILES)
    try:
        folder = Path(
            snapshot_download(ref[0], revision=ref[1], allow_patterns=patterns, local_files_only=cache_only)
        )
    except Exception as exc:  # the library raises OSError, ValueError and HTTP errors alike
        raise HubUnavailable(ref, _reason(exc), f"{type(exc).__name__}: {exc}") from exc
    if not (folder / "tokenizer.json").is_file():
        raise HubUnavailable(ref, "no_tokenizer", f"no tokenizer.json in {folder}")
    return folder


class _Fetch(threading.Thread):
    """One resolution on a daemon thread (see the module docstring)."""

    def __init__(self, ref: HubRef, cache_only: bool) -> None:
        super().__init__(name=f"hf-hub {ref[0]}", daemon=True)
        self.ref, self.cache_only = ref, cache_only
        self.result: Path | HubUnavailable = HubUnavailable(ref, "timeout", "not started")

    def run(self) -> None:
        try:
            self.result = _fetch(self.ref, self.cache_only)
        except HubUnavailable as exc:
            self.result = exc


def fetch_tokenizers(
    refs: Iterable[HubRef], timeout_s: float, cache_only: bool = False
) -> dict[HubRef, Path | HubUnavailable]:
    """Each repo's local tokenizer directory or why it cannot be had, all resolved at once and waited
    for at most `timeout_s` together (an unfinished one is `timeout`); `cache_only`: from the cache
    alone, no request (as `HF_HUB_OFFLINE` would; a miss is `offline`)."""
    fetches = [_Fetch(ref, cache_only) for ref in dict.fromkeys(refs)]
    for fetch in fetches:
        fetch.start()
    deadline = time.monotonic() + timeout_s
    for fetch in fetches:
        fetch.join(max(0.0, deadline - time.monotonic()))
    # A thread still running is abandoned (daemon): its answer, whenever it comes, is not read.
    late = f"no answer within {timeout_s:g} s"
    return {f.ref: HubUnavailable(f.ref, "timeout", late) if f.is_alive() else f.result for f in fetches}
