"""What makes a decoded KV event valid, and the reasons one is rejected. Pure.

vLLM 0.33.0 sends token ids that are non-negative ints below 2**32, a medium of "GPU", "CPU" or
"STORAGE" (None means GPU), and untagged extra keys made of strings, ints and digests (LoRA name,
cache salt, (multimodal identifier, offset), prompt-embeds digest). An event outside that is rejected
alone: the rest of its batch is kept. The medium and lookahead tokens are checked by the event
types themselves (`events.wire`), extra keys and sizes by `event_problem`, run by the decoder on
every event; token ids, the bulk of a store, are checked where they are decoded (`checked_tokens`,
lazily and once), which is before the event changes anything, so an event is applied whole or not at
all. Every reason below is a label value of `kvrouter_engine_rejected_events_total`.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from events.wire import TOKEN_ID_LIMIT, AllBlocksCleared, BlockRemoved, BlockStored, LazyBlockStored

__all__ = [
    "MAX_ITEMS",
    "REJECT_REASONS",
    "InvalidEvent",
    "checked_tokens",
    "event_problem",
    "rejection_reason",
]

# The largest list a decoder accepts in one batch (events, or hashes in one event): 1M items. A sane
# vLLM step is orders of magnitude smaller; this only bounds what a hostile payload can allocate.
MAX_ITEMS: Final = 1 << 20

REJECT_REASONS: Final = (
    "malformed",  # does not decode to its event type (a field of the wrong type or missing, no tag)
    "too_large",  # more than MAX_ITEMS block hashes
    "medium",  # a medium vLLM does not name
    "extra_keys",  # an extra_keys entry that is not None or a tuple of scalars (or flat lists of them)
    "lookahead_token_ids",  # lookahead tokens that are not lists of uint32
    "token_ids",  # token ids that are not a list of uint32
)
# The field a type error names (msgspec's "- at `$.field`") -> the reason it is counted under.
_FIELD_REASONS: Final = tuple(
    (f"`$.{r}", r) for r in ("medium", "extra_keys", "lookahead_token_ids", "token_ids")
)
_SCALARS: Final = frozenset({str, int, float, bool, bytes, type(None)})
_SEQUENCES: Final = (list, tuple)


class InvalidEvent(ValueError):
    """An event that must be rejected; `reason` is one of `REJECT_REASONS`."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def rejection_reason(exc: BaseException) -> str:
    """The reason an event that failed to decode with `exc` is rejected under."""
    if isinstance(exc, msgspec.ValidationError):
        text = str(exc)
        for field, reason in _FIELD_REASONS:
            if field in text:
                return reason
    return "malformed"


def event_problem(ev: object) -> str | None:
    """The reason a decoded event is invalid beyond its type (sizes, extra keys), or None. Cheap."""
    kind = type(ev)
    if kind is LazyBlockStored or kind is BlockStored:  # the decoders' own classes: no getattr
        stored: Any = ev
        if len(stored.block_hashes) > MAX_ITEMS:
            return "too_large"
        extra = stored.extra_keys
        if extra and any(extra) and not all(map(_extra_ok, extra)):
            return "extra_keys"
        return None
    if kind is BlockRemoved:
        return "too_large" if len(ev.block_hashes) > MAX_ITEMS else None  # type: ignore[attr-defined]
    hashes = getattr(ev, "block_hashes", None)
    if hashes is None:
        return None if isinstance(ev, AllBlocksCleared) else "malformed"
    if len(hashes) > MAX_ITEMS:
        return "too_large"
    extra = getattr(ev, "extra_keys", None)
    if extra and any(extra) and not all(map(_extra_ok, extra)):
        return "extra_keys"
    return None


def checked_tokens(ev: BlockStored | LazyBlockStored) -> list[int]:
    """The store's token ids, decoded if lazy; InvalidEvent("token_ids") unless they are all uint32."""
    if isinstance(ev, LazyBlockStored):
        try:
            return ev.tokens()
        except msgspec.ValidationError as exc:
            raise InvalidEvent("token_ids", str(exc)) from exc
    tokens = ev.token_ids
    if not _uint32s(tokens):
        raise InvalidEvent("token_ids", "token ids must be integers in [0, 2**32)")
    return tokens


def _uint32s(tokens: Any) -> bool:
    if not isinstance(tokens, list):
        return False
    try:
        return not tokens or bool(min(tokens) >= 0 and max(tokens) < TOKEN_ID_LIMIT)
    except TypeError:
        return False


def _extra_ok(entry: Any) -> bool:
    """None, or a tuple of scalars and flat lists of scalars: what the router's key hashes."""
    if entry is None:
        return True
    if not isinstance(entry, tuple):
        return False
    for item in entry:
        if type(item) in _SCALARS:
            continue
        if not isinstance(item, _SEQUENCES) or any(type(x) not in _SCALARS for x in item):
            return False
    return True
