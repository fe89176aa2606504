"""Load-test workloads: synthetic conversations and Mooncake trace replay, as request specs. Pure.

A workload is a list of `RequestSpec` (arrival time, prompt token ids, output length, session),
identical for every policy compared, so differences come from routing alone. Trace replay maps each
Mooncake ``hash_id`` (one 512-token block) to a deterministic block of token ids: equal ids become
equal blocks, so the trace's prefix sharing survives exactly; a request's last block is cut to its
``input_length``. `block_tokens` can shrink blocks (and prompts with them) so a trace runs in seconds.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Final

import msgspec

__all__ = [
    "Conversation",
    "MooncakeRecord",
    "RequestSpec",
    "SyntheticWorkload",
    "TraceWorkload",
    "arrival_span",
    "block_token_ids",
    "cut_at_duration",
    "load_trace",
    "scale_arrivals",
    "shared_prefix_tokens",
    "spread_arrivals",
    "synthetic_requests",
    "trace_requests",
]

MOONCAKE_BLOCK_TOKENS: Final = 512
# Token ids stay inside every tokenizer's ordinary vocabulary (the built-in one included) and clear
# of the low ids where special tokens usually sit.
TOKEN_BASE: Final = 1000
TOKEN_SPAN: Final = 20000


class MooncakeRecord(msgspec.Struct, frozen=True):
    """One line of a Mooncake trace: arrival in ms, lengths in tokens, one hash id per 512-token block."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


class Conversation(msgspec.Struct, frozen=True):
    """A request as the turns of a conversation, for the chat, Messages and Responses APIs
    (`kvrouter.loadtest.api_bodies`): a system prompt, tool definitions (text, "" for none), then
    user and assistant turns alternating from a user's; with `tool_calls` every assistant turn is a
    tool call and the user turn after it that call's result."""

    system: str
    tools: str
    turns: list[str]
    tool_calls: bool = False


class RequestSpec(msgspec.Struct, frozen=True):
    """One request to send: when (seconds from start), what tokens, how many to generate."""

    arrival_s: float
    prompt: list[int]
    max_tokens: int
    session: str
    text: str | None = None
    """The prompt as text that the served tokenizer encodes to `prompt` (sent instead, when set)."""
    turns: tuple[int, ...] = ()
    """Where the conversation's pieces end in `prompt`, but the last (which ends with it): the system
    prompt, then user and assistant turns alternating from a user's. Empty: the prompt is one user
    turn (traces). What `--api chat|messages|responses` turns into a `Conversation`."""
    tools: int = 0
    """How many ids at the end of the system prompt stand for tool definitions; > 0 also makes every
    assistant turn a tool call and the user turn after it the call's result (the agents workload)."""
    conversation: Conversation | None = None
    """The request as a conversation, once `prompt` is what the engine renders for it (set by
    `kvrouter.loadtest.api_bodies.as_conversations`; then `turns` and `tools` are spent)."""


class TraceWorkload(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How to turn a trace into requests: time scaling, block shrinking, and how many to take."""

    path: str
    time_scale: float = 1.0
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    max_requests: int | None = None
    max_output_tokens: int | None = None


class SyntheticWorkload(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Shared system prompts x users x multi-turn conversations, Poisson arrivals at `rate` per second."""

    system_prompts: int = 4
    system_prompt_tokens: int = 1024
    users: int = 16
    turns: int = 4
    user_turn_tokens: int = 128
    output_tokens: int = 32
    rate: float = 20.0
    seed: int = 0


_TRACE_DECODER: Final = msgspec.json.Decoder(MooncakeRecord)


def load_trace(path: Path, limit: int | None = None) -> list[MooncakeRecord]:
    """Parse a Mooncake JSONL trace; a bad line raises ValueError naming the line number."""
    records: list[MooncakeRecord] = []
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(records) >= limit:
                break
            if not line.strip():
                continue
            try:
                records.append(_TRACE_DECODER.decode(line))
            except msgspec.DecodeError as exc:
                raise ValueError(f"{path}:{lineno}: {exc}") from exc
    return records


def block_token_ids(block_id: int, n: int, salt: int = 0) -> list[int]:
    """The `n` token ids standing for block `block_id`: deterministic, distinct across blocks."""
    rng = random.Random(block_id * 1_000_003 + salt)
    return [TOKEN_BASE + rng.randrange(TOKEN_SPAN) for _ in range(n)]


def _trace_prompt(record: MooncakeRecord, block_tokens: int) -> list[int]:
    full_blocks = -(-record.input_length // MOONCAKE_BLOCK_TOKENS)
    if full_blocks != len(record.hash_ids):
        raise ValueError(f"trace record has {len(record.hash_ids)} hash ids for {record.input_length} tokens")
    length = max(1, round(record.input_length * block_tokens / MOONCAKE_BLOCK_TOKENS))
    prompt: list[int] = []
    for block_id in record.hash_ids:
        prompt.extend(block_token_ids(block_id, block_tokens))
    return prompt[:length]


def trace_requests(records: Sequence[MooncakeRecord], spec: TraceWorkload) -> list[RequestSpec]:
    """Requests replaying `records`: arrivals scaled by `time_scale` (2.0 = twice as fast)."""
    if spec.time_scale <= 0 or spec.block_tokens <= 0:
        raise ValueError("time_scale and block_tokens must be > 0")
    chosen = records[: spec.max_requests] if spec.max_requests is not None else records
    start = chosen[0].timestamp if chosen else 0.0
    out: list[RequestSpec] = []
    for i, record in enumerate(chosen):
        max_tokens = max(1, record.output_length)
        if spec.max_output_tokens is not None:
            max_tokens = min(max_tokens, spec.max_output_tokens)
        arrival = (record.timestamp - start) / 1000.0 / spec.time_scale
        out.append(RequestSpec(arrival, _trace_prompt(record, spec.block_tokens), max_tokens, f"trace-{i}"))
    return out


def synthetic_requests(spec: SyntheticWorkload) -> list[RequestSpec]:
    """Every user runs `turns` turns on one of the shared system prompts; each turn resends the history.

    Turn k of a user arrives after turn k-1's arrival (Poisson gaps at `rate` overall), so later turns
    can reuse the cache their earlier turns left on whichever engine served them.
    """
    rng = random.Random(spec.seed)
    systems = [
        block_token_ids(-1 - i, spec.system_prompt_tokens, spec.seed) for i in range(spec.system_prompts)
    ]
    # Users pick their system prompt and take turns in a random order, so no fixed rotation (such
    # as round robin over engines) lines up with the sharing by accident.
    histories = {u: list(systems[rng.randrange(spec.system_prompts)]) for u in range(spec.users)}
    ends: dict[int, list[int]] = {u: [spec.system_prompt_tokens] for u in range(spec.users)}
    pending = [(u, t) for t in range(spec.turns) for u in rng.sample(range(spec.users), spec.users)]
    clock = 0.0
    out: list[RequestSpec] = []
    for u, t in pending:
        clock += rng.expovariate(spec.rate) if spec.rate > 0 else 0.0
        turn = block_token_ids(10_000_000 + u * 1000 + t, spec.user_turn_tokens, spec.seed)
        histories[u].extend(turn)
        prompt = list(histories[u])
        out.append(RequestSpec(clock, prompt, spec.output_tokens, f"user-{u}", turns=tuple(ends[u])))
        histories[u].extend(block_token_ids(20_000_000 + u * 1000 + t, spec.output_tokens, spec.seed))
        ends[u] += [len(prompt), len(histories[u])]  # this user turn's end, then the answer's
    return out


def arrival_span(requests: Sequence[RequestSpec]) -> float:
    """Seconds from the first arrival to the last (0 for none or one): the time over which the
    offered load and the stubs' busy fractions are measured."""
    arrivals = [r.arrival_s for r in requests]
    return max(arrivals) - min(arrivals) if arrivals else 0.0


def scale_arrivals(requests: Sequence[RequestSpec], factor: float) -> list[RequestSpec]:
    """The same requests with every arrival time multiplied by `factor` (< 1: sent faster)."""
    return [msgspec.structs.replace(r, arrival_s=r.arrival_s * factor) for r in requests]


def spread_arrivals(requests: Sequence[RequestSpec], gap_s: float) -> list[RequestSpec]:
    """The same requests, each sent at least `gap_s` after the one before it in arrival order (ties
    kept in list order); a request already that far from its predecessor keeps its arrival time.

    Mooncake timestamps tie in whole steps (the conversation trace sends up to 16 requests at each
    3 s mark). Sent at the same instant, they reach a router in whatever order the client's new
    connections complete, different in every run and for every router, and that order alone moves
    a policy's TTFT p50 by more than routing does. Spread this little, every router sees them in
    trace order."""
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    out = list(requests)
    previous = float("-inf")
    for i in order:
        arrival = max(requests[i].arrival_s, previous + gap_s)
        if arrival != requests[i].arrival_s:
            out[i] = msgspec.structs.replace(requests[i], arrival_s=arrival)
        previous = arrival
    return out


def cut_at_duration(
    requests: Sequence[RequestSpec], duration_s: float | None
) -> tuple[list[RequestSpec], int]:
    """The requests arriving in the first `duration_s` seconds (all when None), and how many are cut."""
    if duration_s is None:
        return list(requests), 0
    kept = [r for r in requests if r.arrival_s <= duration_s]
    return kept, len(requests) - len(kept)


def shared_prefix_tokens(requests: Iterable[RequestSpec], block: int = 16) -> int:
    """Prompt tokens, in whole `block`s, that repeat a prefix an earlier request already sent.

    This is what a single engine with an unbounded cache would save, the upper bound of any policy:
    as vLLM, a hit stops at the first unseen block and leaves at least the prompt's last token to compute.
    """
    seen: set[int] = set()
    shared = 0
    for req in requests:
        chain, hit, limit = 0, True, (len(req.prompt) - 1) // block * block
        for end in range(block, len(req.prompt) + 1, block):
            chain = hash((chain, tuple(req.prompt[end - block : end])))
            hit = hit and chain in seen and end <= limit
            shared += block if hit else 0
            seen.add(chain)
    return shared
