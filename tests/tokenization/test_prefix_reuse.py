"""Prefix reuse: a text copies the ids of a recent text's prefix up to a safe cut, and stays exact.

The property tests compare the reuse path with a plain encode on texts built to cut badly: prefixes
ending mid-word, mid whitespace run, inside a multi-byte character, before digits and punctuation, and
around added tokens, for every tokenizer these tests load that reuse applies to (DeepSeek's, and a
byte-level BPE with GPT-2's pre-tokenizer built here with the tokenizers library).
"""

from __future__ import annotations

import json
from array import array
from itertools import accumulate
from pathlib import Path

import msgspec
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.encoder_helpers import chat_ids, deepseek, encoder_of, new_reuse, plain_packed, text_ids
from tokenization import HfTokenizer
from tokenization.fast_paths import pretokenizer_cuts
from tokenization.prefix_reuse import (
    PrefixReuse,
    ReuseEntry,
    TokenEnds,
    WrappedIds,
    count_of,
    ids_of,
    shared_prefix,
)
from tokenization.safe_cuts import CutFinder, token_byte_lengths
from tokenization.segmenter import AddedToken

DATA = Path(__file__).parents[1] / "data"
BAR = "\uff5c"
USER, ASSISTANT = f"<{BAR}User{BAR}>", f"<{BAR}Assistant{BAR}>"
DS_BOS = f"<{BAR}begin\u2581of\u2581sentence{BAR}>"


_TOKENIZERS: dict[str, HfTokenizer] = {}


def _deepseek() -> HfTokenizer:
    return deepseek()


CORPUS = [
    "The quick brown fox jumps over the lazy dog. 12345 apples, 67 pears!",
    "def f(x):\n    return x + 1  # comment\n\n",
    "café naïve résumé 你好世界 🙂🙂 e\u0301 ü",
    "<|user|>hello<|end|><|assistant|>hi there<|end|>",
]


def _gpt2(tmp: Path) -> HfTokenizer:
    """A small byte-level BPE under GPT-2's pre-tokenizer regex, trained on CORPUS, with added tokens."""
    if "gpt2" not in _TOKENIZERS:
        hf = tokenizers.Tokenizer(tokenizers.models.BPE())
        hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = tokenizers.decoders.ByteLevel()
        trainer = tokenizers.trainers.BpeTrainer(
            vocab_size=400, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()
        )
        hf.train_from_iterator(CORPUS * 20, trainer)
        hf.add_special_tokens(["<|user|>", "<|assistant|>", "<|end|>"])
        hf.add_tokens([tokenizers.AddedToken("<think>", normalized=True)])
        hf.save(str(tmp / "tokenizer.json"))
        _TOKENIZERS["gpt2"] = HfTokenizer.from_dir(tmp)
    return _TOKENIZERS["gpt2"]


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> HfTokenizer:
    return _gpt2(tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module", params=["deepseek", "gpt2"])
def tok(request: pytest.FixtureRequest, gpt2: HfTokenizer) -> HfTokenizer:
    return _deepseek() if request.param == "deepseek" else gpt2


# --- Which tokenizers get reuse, and with which cuts ------------------------------------------------------


def test_both_tokenizers_reuse_prefixes_with_pretokenizer_cuts(tok: HfTokenizer) -> None:
    rules = encoder_of(tok).view().reuse_rules
    assert rules is not None and rules.cuts.pretokenizer_rule


def test_pretokenizer_rule_is_recognised_only_where_it_was_proven() -> None:
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    assert pretokenizer_cuts(msgspec.Raw(json.dumps(byte_level).encode()))
    assert not pretokenizer_cuts(msgspec.Raw(json.dumps({**byte_level, "add_prefix_space": True}).encode()))
    assert not pretokenizer_cuts(msgspec.Raw(json.dumps({"type": "Whitespace"}).encode()))
    llama3 = {
        "type": "Sequence",
        "pretokenizers": [
            {
                "type": "Split",
                "pattern": {"Regex": "(?i:'s|'t)|\\p{L}+"},
                "behavior": "Isolated",
                "invert": False,
            },
            {**byte_level, "use_regex": False},
        ],
    }
    assert not pretokenizer_cuts(msgspec.Raw(json.dumps(llama3).encode()))  # never analysed: no cuts
    assert not pretokenizer_cuts(msgspec.Raw(b"null"))


def test_a_tokenizer_without_byte_level_bpe_gets_no_reuse(tmp_path: Path) -> None:
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "x": 1}, unk_token="[UNK]"))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    assert encoder_of(HfTokenizer.from_dir(tmp_path)).view().reuse_rules is None
    assert token_byte_lengths({"a": 0}, [], {"type": "Metaspace"}) is None


def test_cut_rules_on_bytes() -> None:
    added = [
        AddedToken(1, "<|end|>", normalized=False, special=True),
        AddedToken(2, "<|end|>x", normalized=False),
    ]
    cuts = CutFinder(added, pretokenizer_rule=True)
    assert cuts.safe(b"ab cd", 2)  # letter | space
    assert cuts.safe(b"ab.cd", 2) and cuts.safe(b"ab1", 2)  # letter | punctuation, digit
    assert not cuts.safe(b"ab cd", 1)  # mid-word
    assert not cuts.safe(b"a  b", 2)  # mid whitespace run
    assert not cuts.safe(b" ab", 1)  # space | letter
    assert not cuts.safe("ab\u00e9".encode(), 2)  # before a non-ASCII letter
    assert not cuts.safe("e\u0301 x".encode(), 1)  # inside a multi-byte character
    assert cuts.safe(b"ab", 2) and not cuts.safe(b"ab", 0)  # the end, never the start
    assert not cuts.safe(b"<|end|>", 5)  # inside an added token: 'd' | '|'
    assert not cuts.safe(b"a<|end|>y", 8)  # '<|end|>x' might continue there: not provably isolated
    only_end = CutFinder(added[:1], pretokenizer_rule=False)
    assert only_end.safe(b"a<|end|>y", 8) and only_end.safe(b"a<|end|><|end|>", 8)  # after a raw token
    assert not only_end.safe(b"<|<|end|>", 2) and not only_end.safe(b"ab cd", 2)
    assert cuts.last_cut(b"hello world", b"hello there", 6) == 5
    alone = CutFinder(added, pretokenizer_rule=False, bytes_alone=True)
    assert alone.safe(b"a  b", 2) and alone.safe(b" ab", 2) and alone.safe(b"ab1", 1)  # anywhere
    assert not alone.safe("e\u0301".encode(), 2)  # inside a multi-byte character (str texts)
    assert not alone.safe(b"<|end|>", 5) and not alone.safe(b"a<|end|>y", 8)  # a token spans it
    assert alone.safe(b"a<|end|>y", 1) and alone.last_cut(b"hello world", b"hello there", 6) == 6


CUT_TEXT = st.lists(
    st.sampled_from(["a", "b", " ", "  ", ".", "1", "é", "<|end|>", "<|end|>x", "<|", "x"]), max_size=12
)


@settings(max_examples=300, deadline=None)
@given(
    shared=CUT_TEXT,
    a_rest=CUT_TEXT,
    b_rest=CUT_TEXT,
    rule=st.booleans(),
    search=st.integers(1, 12),
    alone=st.booleans(),
)
def test_last_cut_is_the_latest_offset_safe_in_both_texts(
    shared: list[str], a_rest: list[str], b_rest: list[str], rule: bool, search: int, alone: bool
) -> None:
    added = [
        AddedToken(1, "<|end|>", normalized=False, special=True),
        AddedToken(2, "<|end|>x", normalized=False),
    ]
    cuts = CutFinder(added, pretokenizer_rule=rule, search_bytes=search, bytes_alone=alone)
    a, b = "".join(shared + a_rest).encode(), "".join(shared + b_rest).encode()
    limit = 0
    while limit < min(len(a), len(b)) and a[limit] == b[limit]:
        limit += 1  # the whole shared prefix
    both = [q for q in range(limit, max(0, limit - search), -1) if cuts.safe(a, q) and cuts.safe(b, q)]
    assert cuts.last_cut(a, b, limit) == (both[0] if both else 0)


@given(ids=st.lists(st.integers(0, 2**32 - 1), max_size=40), cut=st.integers(0, 40), at=st.integers(0, 200))
def test_an_entrys_packed_ids_from_a_view_read_as_the_joined_ones(ids: list[int], cut: int, at: int) -> None:
    """An entry whose copied ids are a view of another's packed ids (`PrefixReuse.extend`, lazy) reads
    its head, its end and its ids as the joined bytes give them, joining only on `packed`."""
    cut = min(cut, len(ids))
    whole = array("I", ids).tobytes()
    tail = array("I", ids[cut:]).tobytes()
    entry = ReuseEntry(
        data=b"", tail=tuple(ids[cut:]), packed=tail, ends=None, copied=cut, head=memoryview(whole)[: 4 * cut]
    )
    assert bytes(entry.packed_head(at)) == whole[:at] and bytes(entry.packed_from(at)) == whole[at:]
    assert entry.prefix(at // 4) == tuple(ids[: at // 4])
    assert entry._head is not None  # read, but not joined
    assert entry.packed == whole and entry.ids == tuple(ids) and entry.count == len(ids)
    assert bytes(entry.packed_from(at)) == whole[at:] and bytes(entry.packed_head(at)) == whole[:at]


@settings(max_examples=300, deadline=None)
@given(head=CUT_TEXT, before=CUT_TEXT, after=CUT_TEXT, rule=st.booleans())
def test_a_cut_before_a_token_is_a_cut_before_and_after_it(
    head: list[str], before: list[str], after: list[str], rule: bool
) -> None:
    added = [
        AddedToken(1, "<|end|>", normalized=False, special=True),
        AddedToken(2, "<|end|>x", normalized=False),
    ]
    cuts = CutFinder(added, pretokenizer_rule=rule)
    floor, q = len("".join(head).encode()), len("".join(head + before).encode())
    data = "".join(head + before + after).encode()
    n = cuts.edge_length(data[q:])
    if n and cuts.token_start(data, q, n, floor):  # what `_after_token` proves for the token's end
        assert cuts._after_token(data[floor:], q - floor + n) and not cuts._spanned(data[floor:], q - floor)
    assert not cuts.token_start(data, q, 0, floor)  # no token: no cut


AROUND_TOKENS = st.lists(
    st.sampled_from(
        ["a", "é", "你", " ", "\n", "7", "42", ".", "<", f"<{BAR}", f"{BAR}>", USER, ASSISTANT, DS_BOS]
    ),
    max_size=8,
)


@settings(max_examples=200, deadline=None)
@given(
    head=AROUND_TOKENS,
    before=AROUND_TOKENS,
    token=st.sampled_from([USER, ASSISTANT, DS_BOS, "<think>", "</think>", "<"]),
    after=AROUND_TOKENS,
)
def test_a_text_cut_before_a_token_encodes_as_its_two_parts(
    head: list[str], before: list[str], token: str, after: list[str]
) -> None:
    tok = _deepseek()
    cuts = new_reuse(tok).cuts
    floor, a, b = len("".join(head).encode()), "".join(before), token + "".join(after)
    data = ("".join(head) + a + b).encode()
    n = cuts.edge_length(b.encode())
    if n and cuts.token_start(data, len(data) - len(b.encode()), n, floor):
        assert tok.encode(a + b, False) == tok.encode(a, False) + tok.encode(b, False)


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(st.one_of(AROUND_TOKENS, CUT_TEXT), max_size=3),
    q=st.integers(0, 120),
    floor=st.integers(0, 120),
    toy=st.booleans(),
)
def test_spanned_equals_its_definition(parts: list[list[str]], q: int, floor: int, toy: bool) -> None:
    """`CutFinder._spanned` (which passes over a byte no prefix ends in, and slices the few lengths
    of one some do) answers as its definition: a proper prefix of an added token ends at ``q``,
    starting at ``floor`` or later."""
    if toy:
        added = [AddedToken(1, "<|end|>", normalized=False), AddedToken(2, "<|end|>x", normalized=False)]
        cuts = CutFinder(added, pretokenizer_rule=True)
    else:
        cuts = new_reuse(_deepseek()).cuts
    data = "".join(w for words in parts for w in words).encode()
    lo = max(floor, q - cuts._max_len + 1)
    assert cuts._spanned(data, q, floor) == any(data[s:q] in cuts._prefixes for s in range(lo, q))


@settings(max_examples=300, deadline=None)
@given(
    common=st.binary(max_size=2000),
    a=st.binary(max_size=40),
    b=st.binary(max_size=40),
    view=st.booleans(),
)
def test_shared_prefix_of_long_texts_is_the_longest_common_prefix(
    common: bytes, a: bytes, b: bytes, view: bool
) -> None:
    """`shared_prefix` (memcmps down to a short gap, then one XOR) counts the bytes two texts share
    from the start, as a byte-by-byte loop does."""
    x, y = common + a, common + b
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    assert shared_prefix(x, memoryview(y) if view else y) == n


# --- Exactness: the reuse path equals a plain encode ------------------------------------------------------

ADVERSARIAL = st.sampled_from(
    ["a", "Z", "é", "è", "ü", "你", "好", "🙂", "\u0301", " ", "  ", "\t", "\n", "\r\n", "0", "7", "42",
     ".", ",", "!", "'s", "(", "-", "_", "x1", USER, ASSISTANT, DS_BOS, "<think>", "<|user|>", "<|end|>"]
)  # fmt: skip
WORDS = st.lists(st.one_of(ADVERSARIAL, st.text(alphabet="abcxyz ", min_size=1, max_size=6)), max_size=30)


@settings(max_examples=150, deadline=None)
@given(base=WORDS, edits=st.lists(st.tuples(st.integers(0, 200), WORDS), min_size=1, max_size=5))
def test_reuse_equals_plain_encode_on_adversarial_prefixes(
    base: list[str], edits: list[tuple[int, list[str]]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    for tok in (_deepseek(), _gpt2(tmp_path_factory.mktemp("g"))):
        text = "".join(base)
        texts = [text]
        for cut, suffix in edits:  # each text: a prefix of the previous one (cut anywhere) + new text
            text = text[: cut % (len(text) + 1)] + "".join(suffix)
            texts.append(text)
        for t in texts:
            for add in (False, True):
                assert text_ids(encoder_of(tok), t, add) == tok.encode(t, add), t


@settings(max_examples=60, deadline=None)
@given(head=WORDS, a=WORDS, b=WORDS)
def test_texts_that_differ_after_a_shared_head_stay_exact(
    head: list[str], a: list[str], b: list[str]
) -> None:
    tok = _deepseek()
    first, second = "".join(head + a), "".join(head + b)
    assert encoder_of(tok).encode(first, False).ids == tuple(tok.encode(first, False))
    encoded = encoder_of(tok).encode(second, False)
    ids = encoded.ids
    assert ids == tuple(tok.encode(second, False))
    assert encoded.packed == array("I", ids).tobytes()


# --- It is effective, counted and bounded -----------------------------------------------------------------


def test_a_completions_prompt_with_a_new_suffix_encodes_only_the_suffix() -> None:
    tok = _deepseek()
    prompt = "Summarise the following report about caches and routers. " * 50
    encoder_of(tok).encode(prompt + "request 1", True)
    before = encoder_of(tok).stats()
    ids = encoder_of(tok).encode(prompt + "request 2", True).ids
    after = encoder_of(tok).stats()
    assert ids == tuple(tok.encode(prompt + "request 2", True))
    assert after.reuse_hits == before.reuse_hits + 1
    assert after.encoded_bytes - before.encoded_bytes <= len("request 2")
    assert after.reused_tokens - before.reused_tokens >= len(ids) - 3


def test_a_chat_rendered_again_with_a_new_turn_encodes_only_the_new_text() -> None:
    tok = _deepseek()
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " * 40} for i in range(6)]
    chat_ids(encoder_of(tok), turns[:5])
    encoded = encoder_of(tok).stats().encoded_bytes
    ids = chat_ids(encoder_of(tok), turns)
    assert ids == tok.encode(tok.apply_chat_template(turns), add_special_tokens=False)
    new_text = len(b"turn 5 " * 40) + len(f"{USER}{ASSISTANT}".encode())
    assert encoder_of(tok).stats().encoded_bytes - encoded <= new_text + len(ASSISTANT.encode())


def test_the_cache_is_lru_and_bounded_in_entries_and_bytes() -> None:
    tok = _deepseek()
    unknown = 1 << 40  # not byte-level, or empty: no text's bytes can add up with it
    lengths = token_byte_lengths({"a": 0, "bc": 1, "Ġ": 2, "你": 3, "": 4}, [], {"type": "ByteLevel"})
    assert lengths == [1, 2, 1, unknown, unknown]
    ds_lengths = new_reuse(tok).byte_lengths
    reuse = PrefixReuse(CutFinder([], True), ds_lengths, max_entries=2)
    encode = plain_packed(tok)
    base = "abc def ghi " * 10
    for i in range(4):
        reuse.encode_packed(f"{'pqrs'[i]} {base}", encode)
    assert len(reuse) == 2 and reuse.stats.misses == 4  # different first words: nothing shared
    reuse.encode_packed("s abc", encode)
    assert reuse.stats.hits == 1 and len(reuse) == 2  # the LRU kept the newest
    assert reuse.bytes == sum(e.size for e in reuse._entries.values())
    tiny = PrefixReuse(CutFinder([], True), ds_lengths, max_bytes=100)
    tiny.encode_packed(base, encode)
    assert len(tiny) == 0 and tiny.bytes == 0  # larger than the whole bound: not stored
    with pytest.raises(ValueError):
        PrefixReuse(CutFinder([], True), [], max_entries=-1)


def test_a_text_whose_byte_lengths_do_not_add_up_is_never_reused() -> None:
    tok = _deepseek()
    wrong = [2] * 200_000  # every token claimed 2 bytes long
    reuse = PrefixReuse(CutFinder([], True), wrong)
    for text in ("hello world", "hello there"):
        ids, _ = reuse.encode_packed(text, plain_packed(tok))
        assert ids == tuple(tok.encode(text, False))
    # The first text was kept, found wrong when the second tried to reuse it, and dropped.
    assert reuse.stats.unverified == 1 and reuse.stats.hits == 0 and len(reuse) == 1


def test_a_text_reused_to_near_its_end_is_replaced_by_the_new_one() -> None:
    tok = _deepseek()
    reuse = PrefixReuse(CutFinder([], True), new_reuse(tok).byte_lengths)
    prompt = "A shared instruction for every request. " * 40
    for i in range(6):  # the same prompt with a new suffix: one entry, not six
        ids, _ = reuse.encode_packed(f"{prompt}request {i}", plain_packed(tok))
        assert ids == tuple(tok.encode(f"{prompt}request {i}", False))
    assert len(reuse) == 1 and reuse.stats.hits == 5
    reuse.encode_packed("A shared instruction, then something else entirely", plain_packed(tok))
    assert len(reuse) == 2  # reused far from its end: both kept


@given(head=st.lists(st.integers(0, 9), max_size=6), tail=st.lists(st.integers(0, 9), max_size=6))
def test_an_entrys_ids_are_its_head_and_tail_however_read(head: list[int], tail: list[int]) -> None:
    """The copied head is held packed only: read whole, in part or iterated, the ids are head + tail."""
    ids = (*head, *tail)
    for joined in (False, True):
        entry = ReuseEntry(
            data=b"", tail=tuple(tail), packed=array("I", ids).tobytes(), ends=None, copied=len(head)
        )
        if joined:
            assert entry.ids == ids
        assert entry.count == len(ids) and list(entry.iter_ids()) == list(ids)
        assert all(entry.prefix(n) == ids[:n] for n in range(len(ids) + 1))
        assert entry.ids == ids


@given(
    head=st.lists(st.integers(0, 9), max_size=6),
    tail=st.lists(st.integers(0, 9), max_size=6),
    wrap=st.tuples(st.lists(st.integers(10, 12), max_size=2), st.lists(st.integers(10, 12), max_size=2)),
)
def test_wrapped_ids_are_the_wrap_around_the_entrys_ids(
    head: list[int], tail: list[int], wrap: tuple[list[int], list[int]]
) -> None:
    entry = ReuseEntry(
        data=b"", tail=tuple(tail), packed=array("I", (*head, *tail)).tobytes(), ends=None, copied=len(head)
    )
    wrapped = WrappedIds(tuple(wrap[0]), entry, tuple(wrap[1]))
    ids = (*wrap[0], *head, *tail, *wrap[1])
    assert count_of(wrapped) == len(ids) and wrapped._ids is None  # counted without joining
    assert ids_of(wrapped) == ids and wrapped.ids is ids_of(wrapped)  # joined once
    assert entry._ids is (None if head else entry.tail)  # not joined on the entry


def test_a_completions_prompt_keeps_its_ids_unjoined_until_read(tok: HfTokenizer) -> None:
    prompt = "A shared instruction for every request. " * 20
    for i in range(3):
        text = f"{prompt}request {i}"
        encoded = encoder_of(tok).encode(text, True)
        expected = tuple(tok.encode(text, True))
        assert not isinstance(encoded._held, tuple)  # the cache's entry, its ids joined when read
        assert encoded.count == len(expected) and encoded.ids == expected
        assert encoded.packed == array("I", expected).tobytes()


def test_linked_prompts_with_and_without_special_tokens_interleaved_stay_exact(tok: HfTokenizer) -> None:
    """`encode` keeps the last special-token wrap's parts: alternating wraps each get theirs
    (ids, packed ids, and a link keyed by its own wrap, sharing its prefix's ids)."""
    prompt = "Another shared instruction, for linked prompts. " * 10
    for i in range(6):
        special = i % 3 != 0
        text = f"{prompt}request {i}"
        encoded = encoder_of(tok).encode(text, special)
        expected, link = tuple(tok.encode(text, special)), encoded.link
        assert encoded.ids == expected and encoded.packed == array("I", expected).tobytes()
        wrap = encoder_of(tok)._special_wrap(special)
        assert link is not None and wrap is not None
        assert link.shared_tokens <= len(expected) and link.own is not link.prior
        assert link.shared_tokens == 0 or expected[: len(wrap[0])] == tuple(wrap[0])


@settings(max_examples=300, deadline=None)
@given(shared=st.binary(max_size=70), a=st.binary(max_size=70), b=st.binary(max_size=70))
def test_shared_prefix_is_the_longest_common_prefix(shared: bytes, a: bytes, b: bytes) -> None:
    x, y = shared + a, shared + b
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    assert shared_prefix(x, y) == n == shared_prefix(y, memoryview(x))


def _flat_tokens_before(ends: list[int], cut: int) -> int:
    return next((i + 1 for i, end in enumerate(ends) if end == cut), 0)


@settings(max_examples=300, deadline=None)
@given(
    first=st.lists(st.integers(1, 5), max_size=30),
    turns=st.lists(
        st.tuples(st.integers(0, 60), st.lists(st.integers(1, 5), max_size=30)), min_size=1, max_size=8
    ),
    cuts=st.lists(st.integers(0, 200), max_size=10),
)
def test_token_ends_shared_across_extensions_equal_the_ends_made_flat(
    first: list[int], turns: list[tuple[int, list[int]]], cuts: list[int]
) -> None:
    """A chain of texts each keeping some leading tokens of the last and adding new ones: the shared
    ends read (count, last end, tokens before any cut) as the flat list of every token's end."""
    ends, flat = TokenEnds.of(first), list(accumulate(first))
    for keep, lengths in turns:
        k = min(keep, len(flat))
        cut = flat[k - 1] if k else 0
        ends = ends.extended(k, cut, lengths)
        flat = [*flat[:k], *list(accumulate(lengths, initial=cut))[1:]]
        assert list(ends.flat()) == flat and len(ends) == len(flat)
        assert ends.last() == (flat[-1] if flat else 0)
        for c in [*cuts, *flat]:
            assert ends.tokens_before(c) == _flat_tokens_before(flat, c)
