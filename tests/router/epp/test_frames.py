"""router.epp.frames' reading of HPACK blocks (`table_neutral`), against blocks the `hpack` package
encodes: a block called neutral leaves the decoder's dynamic table as it was."""

from __future__ import annotations

import hpack
from hpack import HeaderTuple, NeverIndexedHeaderTuple
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.epp.frames import table_neutral

names = st.sampled_from([b":path", b":method", b"content-type", b"x-request-id", b"x-a", b"te"])
values = st.binary(max_size=300)
fields = st.lists(
    st.tuples(names, values, st.sampled_from(["indexed", "never", "plain"])), min_size=0, max_size=8
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(fields, min_size=1, max_size=4), st.booleans(), st.sampled_from([None, 0, 64, 4096]))
def test_a_neutral_block_leaves_the_table_alone_and_unindexed_ones_are_neutral(
    blocks: list[list[tuple[bytes, bytes, str]]], huffman: bool, resize: int | None
) -> None:
    """Sound: a block called neutral leaves the table as it was (a False is only a cache miss, so a
    literal added to a table of size 0 may be called not neutral). Complete where it matters: a block
    of fields sent never indexed (an indexed field, or a literal not added) with no size update is
    neutral."""
    encoder, decoder = hpack.Encoder(), hpack.Decoder()
    if resize is not None:
        encoder.header_table_size = resize  # (the next block starts with a size update)
    for i, block_fields in enumerate(blocks):
        headers = [
            HeaderTuple(n, v)
            if how == "indexed"
            else NeverIndexedHeaderTuple(n, v)
            if how == "never"
            else (n, v)
            for n, v, how in block_fields
        ]
        block = encoder.encode(headers, huffman=huffman)
        before = list(decoder.header_table.dynamic_entries), decoder.header_table.maxsize
        decoder.decode(block, raw=True)
        after = list(decoder.header_table.dynamic_entries), decoder.header_table.maxsize
        if table_neutral(block):
            assert before == after, block.hex()
        if all(how == "never" for _, _, how in block_fields) and (resize is None or i > 0):
            assert table_neutral(block), block.hex()


def test_blocks_cut_short_or_added_to_the_table_are_not_neutral() -> None:
    envoy = bytes.fromhex(
        "8304a560b5773fa5d05b3b98855cbe5315761c8bf7657c1e525b2a1d1aec390a841ec635d8721508c286c1c0bfbe"
    )
    assert table_neutral(envoy)  # (Envoy's request block after the first stream's)
    assert table_neutral(b"")
    assert not table_neutral(envoy[:-8])  # a literal cut short
    assert not table_neutral(b"\x04\xa5")  # a length past the end
    assert not table_neutral(b"\x40\x01a\x01b")  # a literal added to the table
    assert not table_neutral(b"\x3f\xe1\x1f")  # a size update
    assert not table_neutral(b"\xff")  # an index whose integer never ends
