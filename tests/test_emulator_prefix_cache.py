"""The emulator's block-level prefix cache: lookup, the hit rule, pinning and eviction."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_gateway.emulator.prefix_cache import CacheLease, PrefixCache, block_hashes
from prefix_gateway.emulator.prompts import chat_prompt_ids
from prefix_gateway.emulator.sampler import Sampler
from prefix_gateway.emulator.tokenizer import token_ids

BLOCK = 16


def tokens(count: int, start: int = 0) -> list[int]:
    return list(range(start, start + count))


def serve(cache: PrefixCache, prompt: list[int], max_tokens: int = 1) -> int:
    """Run one sequence to completion (output ids follow the prompt); returns cached tokens."""
    hashes = block_hashes(prompt, cache.block_size)
    lease = cache.admit(hashes, len(prompt), max_tokens)
    assert lease is not None
    cache.publish(lease, hashes)
    output = tokens(max_tokens, 10_000_000 + len(prompt))
    held = prompt + output[:-1]
    cache.publish(lease, block_hashes(held, cache.block_size, hashes))
    cache.release(lease)
    return lease.cached_tokens


def test_only_full_blocks_are_hashed_and_each_hash_names_its_whole_prefix() -> None:
    assert block_hashes(tokens(15), BLOCK) == []
    assert len(block_hashes(tokens(47), BLOCK)) == 2
    same_block_other_parent = block_hashes(tokens(16, 100) + tokens(16), BLOCK)[1]
    assert block_hashes(tokens(16), BLOCK)[0] != same_block_other_parent


def test_hashes_can_be_extended_from_known_blocks() -> None:
    prompt = tokens(70)
    known = block_hashes(prompt[:40], BLOCK)
    assert block_hashes(prompt, BLOCK, known) == block_hashes(prompt, BLOCK)
    assert block_hashes(prompt[:20], BLOCK, block_hashes(prompt, BLOCK)) == known[:1]


def test_a_cache_salt_keeps_equal_prompts_apart() -> None:
    prompt = tokens(48)
    plain, salted = block_hashes(prompt, BLOCK), block_hashes(prompt, BLOCK, salt="a")
    assert not set(plain) & set(salted)
    assert salted == block_hashes(prompt, BLOCK, salt="a") != block_hashes(prompt, BLOCK, salt="b")
    assert block_hashes(prompt, BLOCK, salted[:1]) == salted  # extending keeps the salt


def test_lookup_is_the_longest_run_of_leading_cached_blocks() -> None:
    cache = PrefixCache(100, BLOCK)
    serve(cache, tokens(64))
    hashes = block_hashes(tokens(64), BLOCK)
    assert cache.lookup(hashes) == 4
    assert cache.lookup(block_hashes(tokens(32) + tokens(32, 500), BLOCK)) == 2
    assert cache.lookup(block_hashes(tokens(64, 1), BLOCK)) == 0


@pytest.mark.parametrize(
    ("prompt_tokens", "expected"),
    [(64, 48), (65, 64), (70, 64), (17, 16), (16, 0), (1, 0)],
)
def test_a_hit_always_leaves_at_least_one_token_to_compute(
    prompt_tokens: int, expected: int
) -> None:
    cache = PrefixCache(100, BLOCK)
    serve(cache, tokens(80))
    assert serve(cache, tokens(prompt_tokens)) == expected


def test_counters_count_prompt_tokens_queried_and_found() -> None:
    cache = PrefixCache(100, BLOCK)
    serve(cache, tokens(100))
    serve(cache, tokens(100))
    assert (cache.queries, cache.hits) == (200, 96)


def test_admission_reserves_every_block_the_sequence_will_hold() -> None:
    cache = PrefixCache(100, BLOCK)
    assert cache.sequence_blocks(16, 1) == 1
    assert cache.sequence_blocks(16, 2) == 2
    assert cache.sequence_blocks(100, 300) == 25
    lease = cache.admit(block_hashes(tokens(100), BLOCK), 100, 300)
    assert lease is not None
    assert cache.pinned_blocks == 25 and cache.usage == 0.25
    cache.release(lease)
    assert cache.pinned_blocks == 0 and cache.usage == 0.0


def test_finished_sequences_cache_prompt_and_output_but_the_last_token() -> None:
    cache = PrefixCache(100, BLOCK)
    serve(cache, tokens(40), max_tokens=9)
    # 40 prompt + 8 output tokens held: three full blocks.
    assert cache.cached_blocks == 3
    assert cache.pinned_blocks == 0


def test_pinned_blocks_are_never_evicted_and_a_full_cache_refuses() -> None:
    cache = PrefixCache(8, BLOCK)
    first = cache.admit(block_hashes(tokens(64), BLOCK), 64, 1)
    assert first is not None
    cache.publish(first, block_hashes(tokens(64), BLOCK))
    second_prompt = tokens(64, 1000)
    second_hashes = block_hashes(second_prompt, BLOCK)
    assert cache.admit(second_hashes, 64, 17) is None
    second = cache.admit(second_hashes, 64, 1)
    assert second is not None
    assert cache.free_blocks == 0
    assert cache.admit(block_hashes(tokens(16, 5000), BLOCK), 16, 1) is None
    cache.release(first)
    assert cache.free_blocks == 4
    assert cache.admit(block_hashes(tokens(16, 5000), BLOCK), 16, 1) is not None
    assert cache.lookup(block_hashes(tokens(64), BLOCK)) == 3  # one block taken, from the tail


def test_reusing_an_evictable_block_pins_it_and_counts_against_free_space() -> None:
    cache = PrefixCache(4, BLOCK)
    serve(cache, tokens(48))  # three cached evictable blocks
    lease = cache.admit(block_hashes(tokens(48), BLOCK), 48, 1)
    assert lease is not None and lease.cached_tokens == 32
    assert cache.pinned_blocks == 3
    assert cache.admit(block_hashes(tokens(32, 900), BLOCK), 32, 1) is None


def test_eviction_is_lru_and_takes_a_chain_from_its_tail() -> None:
    cache = PrefixCache(64, BLOCK)
    prompt_a, prompt_b = tokens(480), tokens(640, 100_000)
    assert serve(cache, prompt_a) == 0
    assert serve(cache, prompt_a) == 464  # 29 of 30 blocks: one token is always computed
    assert serve(cache, prompt_b) == 0  # needs 40 blocks: 34 are empty, 6 evicted from A's tail
    assert serve(cache, prompt_a) == 384  # A's 24 leading blocks survive


def test_recently_used_chains_outlive_older_ones() -> None:
    cache = PrefixCache(10, BLOCK)
    old, recent = tokens(64), tokens(64, 1000)
    serve(cache, old)
    serve(cache, recent)
    serve(cache, tokens(64, 9000))  # evicts 2 blocks: the tail of the older chain
    assert cache.lookup(block_hashes(old, BLOCK)) == 2
    assert cache.lookup(block_hashes(recent, BLOCK)) == 4


def test_blocks_computed_twice_at_once_are_cached_once() -> None:
    cache = PrefixCache(20, BLOCK)
    prompt = tokens(64)
    hashes = block_hashes(prompt, BLOCK)
    leases = [cache.admit(hashes, 64, 1) for _ in range(2)]
    assert all(lease is not None and lease.cached_tokens == 0 for lease in leases)
    for lease in leases:
        assert lease is not None
        cache.publish(lease, hashes)
    assert cache.cached_blocks == 4 and cache.pinned_blocks == 8
    for lease in leases:
        assert lease is not None
        cache.release(lease)
    assert cache.cached_blocks == 4 and cache.pinned_blocks == 0
    assert serve(cache, prompt) == 48


def test_a_request_arriving_while_its_prefix_is_computed_counts_as_an_in_flight_miss() -> None:
    cache = PrefixCache(capacity_blocks=64, block_size=BLOCK)
    shared = tokens(64)
    first_hashes = block_hashes(shared + tokens(16, 500), BLOCK)
    second_hashes = block_hashes(shared + tokens(16, 900), BLOCK)
    first = cache.admit(first_hashes, 80, 1)
    assert first is not None
    second = cache.admit(second_hashes, 80, 1)  # the shared blocks are still being computed
    assert second is not None and second.cached_tokens == 0
    assert cache.in_flight_misses == 1
    cache.publish(first, first_hashes)
    cache.release(second)
    assert serve(cache, shared + tokens(16, 700)) == 64  # computed: a hit, not a miss
    assert serve(cache, tokens(32, 5000)) == 0  # nobody computes it: a plain miss
    assert cache.in_flight_misses == 1
    cache.release(first)


def test_six_turn_conversation_computes_1640_of_12600_prompt_tokens() -> None:
    cache = PrefixCache(8192, BLOCK)
    sampler = Sampler(0)
    system = " ".join(f"s{index}" for index in range(1000))
    history: list[dict[str, str]] = [{"role": "system", "content": system}]
    computed, prompted = [], []
    for turn in range(6):
        history.append({"role": "user", "content": " ".join(f"q{turn}w{i}" for i in range(100))})
        prompt = chat_prompt_ids(history, None, "plain")
        answer = sampler.sample(prompt, 300)
        hashes = block_hashes(prompt, BLOCK)
        lease = cache.admit(hashes, len(prompt), 300)
        assert lease is not None
        cache.publish(lease, hashes)
        held = prompt + token_ids(answer[:-1])
        cache.publish(lease, block_hashes(held, BLOCK, hashes))
        cache.release(lease)
        history.append({"role": "assistant", "content": "".join(answer)})
        prompted.append(len(prompt))
        computed.append(len(prompt) - lease.cached_tokens)
    assert prompted == [1100 + 400 * turn for turn in range(6)]
    assert computed == [1100, 108, 108, 108, 108, 108]
    assert (sum(computed), sum(prompted)) == (1640, 12600)


operations = st.lists(
    st.tuples(
        st.sampled_from(["admit", "finish", "abort"]),
        st.integers(min_value=0, max_value=5),
        st.integers(min_value=1, max_value=120),
        st.integers(min_value=1, max_value=40),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(operations)
def test_block_accounting_stays_within_capacity(
    steps: list[tuple[str, int, int, int]],
) -> None:
    cache = PrefixCache(24, 8)
    running: list[tuple[CacheLease, list[int], list[int]]] = []
    for action, family, length, max_tokens in steps:
        if action == "admit":
            prompt = tokens(length, family * 1000)
            hashes = block_hashes(prompt, 8)
            expected_hit = min(cache.lookup(hashes), (length - 1) // 8) * 8
            lease = cache.admit(hashes, length, max_tokens)
            fits = cache.sequence_blocks(length, max_tokens) <= cache.capacity_blocks
            if lease is None:
                assert running or not fits
                continue
            assert lease.cached_tokens == expected_hit
            cache.publish(lease, hashes)
            running.append((lease, prompt, hashes))
        elif running:
            lease, prompt, hashes = running.pop(family % len(running))
            if action == "finish":
                held = prompt + tokens(max_tokens - 1, 7_000_000)
                cache.publish(lease, block_hashes(held, 8, hashes))
            cache.release(lease)
        assert cache.pinned_blocks <= cache.used_blocks <= cache.capacity_blocks
        assert cache.free_blocks == cache.capacity_blocks - cache.pinned_blocks
    for lease, _, _ in running:
        cache.release(lease)
    assert cache.pinned_blocks == 0
    assert cache.used_blocks == cache.cached_blocks
