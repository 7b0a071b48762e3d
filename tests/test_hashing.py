from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from prefix_gateway.prompt.hashing import chain_hashes, extend_hashes, key_hash


def test_only_full_blocks_are_hashed() -> None:
    assert chain_hashes(b"x" * 63, 64) == []
    assert len(chain_hashes(b"x" * 64, 64)) == 1
    assert len(chain_hashes(b"x" * 200, 64)) == 3


def test_equal_prefixes_give_equal_chains_until_they_differ() -> None:
    a = b"s" * 640 + b"conversation one" * 20
    b = b"s" * 640 + b"conversation two" * 20
    ha, hb = chain_hashes(a, 64), chain_hashes(b, 64)
    assert ha[:10] == hb[:10]
    assert all(x != y for x, y in zip(ha[10:], hb[10:], strict=False))


def test_a_block_hash_depends_on_everything_before_it() -> None:
    # Same block content at the same depth after different beginnings must not collide.
    a = chain_hashes(b"A" * 64 + b"Z" * 64, 64)
    b = chain_hashes(b"B" * 64 + b"Z" * 64, 64)
    assert a[1] != b[1]


@given(st.binary(max_size=2000), st.binary(max_size=2000), st.integers(1, 100))
def test_extend_equals_hashing_the_whole(prefix: bytes, suffix: bytes, block: int) -> None:
    whole = prefix + suffix
    assert extend_hashes(chain_hashes(prefix, block), whole, block) == chain_hashes(whole, block)


def test_key_hash_accepts_text_and_bytes() -> None:
    assert key_hash("abc") == key_hash(b"abc")
    assert key_hash("abc") != key_hash("abd")
