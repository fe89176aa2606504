"""What makes a KV event valid, and the reasons one is rejected. Pure.

vLLM 0.33.0 sends token ids that are non-negative ints below 2**32, a medium of "GPU", "CPU" or
"STORAGE" (None means GPU), and untagged extra keys made of strings, ints and digests (LoRA name,
cache salt, (multimodal identifier, offset), prompt-embeds digest). An event outside that is rejected
alone: the rest of its batch is kept. Types, the medium, sizes and lookahead tokens are checked by
the event types themselves when decoding (`events.wire`, in C: the fast path pays nothing). Token ids
and extra keys, the parts only a router-key mirror reads, are checked where it uses them: decoded
lazily as ints (`checked_tokens`), range-checked by the uint32 packing the router hashes them with,
and hashed with the block (an unhashable extra key fails there), all before the event changes
anything, so an event is applied whole or not at all. Every reason below is a label value of
`kvrouter_engine_rejected_events_total`.
"""

from __future__ import annotations

from typing import Final

import msgspec

from events.wire import MAX_ITEMS, BlockStored, LazyBlockStored

__all__ = ["MAX_ITEMS", "REJECT_REASONS", "InvalidEvent", "checked_tokens", "rejection_reason"]

REJECT_REASONS: Final = (
    "malformed",  # does not decode to its event type (a field of the wrong type or missing, no tag)
    "too_large",  # more than MAX_ITEMS block hashes
    "medium",  # a medium vLLM does not name
    "extra_keys",  # extra keys the router cannot hash (a map, nested lists)
    "lookahead_token_ids",  # lookahead tokens that are not lists of uint32
    "token_ids",  # token ids that are not a list of uint32
)
# The field a type error names (msgspec's "- at `$.field`") -> the reason it is counted under.
_FIELD_REASONS: Final = tuple(
    (f"`$.{r}", r) for r in ("medium", "extra_keys", "lookahead_token_ids", "token_ids")
)


class InvalidEvent(ValueError):
    """An event that must be rejected; `reason` is one of `REJECT_REASONS`."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def rejection_reason(exc: BaseException) -> str:
    """The reason an event that failed to decode with `exc` is rejected under."""
    if not isinstance(exc, msgspec.ValidationError):
        return "malformed"
    text = str(exc)
    if "`$.block_hashes`" in text and "length" in text:
        return "too_large"
    for field, reason in _FIELD_REASONS:
        if field in text:
            return reason
    return "malformed"


def checked_tokens(ev: BlockStored | LazyBlockStored) -> list[int]:
    """The store's token ids, decoded if lazy; InvalidEvent("token_ids") unless they are a list of ints.
    Their range (`events.wire.TOKEN_ID_LIMIT`) is checked by whoever packs them, at no extra cost."""
    if isinstance(ev, LazyBlockStored):
        try:
            return ev.tokens()
        except msgspec.ValidationError as exc:
            raise InvalidEvent("token_ids", str(exc)) from exc
    return ev.token_ids
