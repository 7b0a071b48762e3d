"""The exact per-replica index fed by vLLM's KV-cache events, on the recorded sample of real
events (tests/data/vllm_kv_events.msgpack: stored, salted, reused, evicted, cleared)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from engines.kv_events import decode, load_sample
from prefix_gateway.prompt.hashing import chain_hashes
from prefix_gateway.prompt.tokens import TOKEN_BYTES, pack
from prefix_gateway.state.engine_blocks import EngineBlocks, EventFedIndex
from prefix_gateway.state.index import InMemoryPrefixIndex

SAMPLE = Path(__file__).parent / "data" / "vllm_kv_events.msgpack"
BLOCK = 32


def messages() -> list[tuple[int, list[dict[str, Any]]]]:
    return [(seq, decode(payload)["events"]) for _, seq, payload in load_sample(SAMPLE)]


def gateway_chain(tokens: list[int]) -> list[int]:
    """The chain the router computes for a prompt of these token ids (`--tokenizer`)."""
    return chain_hashes(pack(tokens), BLOCK * TOKEN_BYTES)


class EngineModel:
    """What the engine holds, from the events read plainly: each unsalted block's tokens from
    the start of its prompt."""

    def __init__(self) -> None:
        self.prefix: dict[int, list[int]] = {}
        self.salted: set[int] = set()

    def apply(self, event: dict[str, Any]) -> None:
        if event["type"] == "BlockStored":
            parent = event["parent_block_hash"]
            tokens = [] if parent is None else list(self.prefix.get(parent, []))
            salted = parent in self.salted
            for position, block in enumerate(event["block_hashes"]):
                salted = salted or bool(event["extra_keys"][position])
                tokens = tokens + event["token_ids"][position * BLOCK : (position + 1) * BLOCK]
                if salted:
                    self.salted.add(block)
                else:
                    self.prefix[block] = tokens
        elif event["type"] == "BlockRemoved":
            for block in event["block_hashes"]:
                self.prefix.pop(block, None)
                self.salted.discard(block)
        else:
            self.prefix.clear()
            self.salted.clear()


def test_the_index_holds_exactly_the_engines_unsalted_blocks_after_every_message() -> None:
    blocks = EngineBlocks(BLOCK)
    engine = EngineModel()
    held_at_most = 0
    for seq, events in messages():
        blocks.receive(seq, events)
        for event in events:
            engine.apply(event)
        expected = {gateway_chain(tokens)[-1] for tokens in engine.prefix.values()}
        assert {block for block in expected if block in blocks} == expected
        assert len(blocks) == len(expected)
        for tokens in engine.prefix.values():
            assert blocks.depth(gateway_chain(tokens)) == len(tokens) // BLOCK
        held_at_most = max(held_at_most, len(blocks))
        assert blocks.complete
    assert held_at_most >= 4  # the sample did store, and evict, several blocks
    assert len(blocks) == 0  # it ends with AllBlocksCleared


def test_a_missed_message_makes_the_replica_unknown_until_it_restarts_or_clears() -> None:
    recorded = messages()
    blocks = EngineBlocks(BLOCK)
    blocks.receive(*recorded[0])
    blocks.receive(recorded[2][0], recorded[2][1])
    assert not blocks.complete
    blocks.receive(0, recorded[0][1])  # numbering from 0 again: a new engine
    assert blocks.complete
    assert len(blocks) == len(recorded[0][1][0]["block_hashes"])


def test_the_event_fed_index_answers_live_replicas_from_events_and_others_as_predicted() -> None:
    async def scenario() -> None:
        now = [100.0]
        predicted = InMemoryPrefixIndex(600, 100_000)
        live: dict[str, EngineBlocks] = {"a": EngineBlocks(BLOCK)}
        index = EventFedIndex(predicted, lambda: live, pending_seconds=30, clock=lambda: now[0])
        seq, events = messages()[0]
        stored = next(event for event in events if event["type"] == "BlockStored")
        chain = gateway_chain(stored["token_ids"])
        # Sent to both: "a" counts it as pending until its engine stores it; "b" as predicted.
        await index.record("m", "a", chain)
        await index.record("m", "b", chain)
        assert await index.match("m", chain) == {"a": len(chain), "b": len(chain)}
        now[0] += 31  # the prefill never stored anything on "a": it holds nothing
        assert await index.match("m", chain) == {"b": len(chain)}
        live["a"].receive(seq, events)
        index.settle("a", chain)
        assert await index.match("m", chain) == {"a": len(chain), "b": len(chain)}
        removed = {"type": "BlockRemoved", "block_hashes": [stored["block_hashes"][-1]]}
        live["a"].receive(seq + 1, [removed])  # evicted: the predicted index never learns it
        assert await index.match("m", chain) == {"a": len(chain) - 1, "b": len(chain)}
        answered = [*chain, 1, 2]  # with an answer the engine did not store
        await index.record("m", "a", answered)
        index.share("m", "a", answered)  # accepted: still pending until stored or settled
        assert (await index.match("m", answered))["a"] == len(answered)
        index.settle("a", answered)  # the request ended: its last events may be on their way
        assert (await index.match("m", answered))["a"] == len(answered)
        now[0] += 1.5  # they never came: the engine did not store the answer
        assert (await index.match("m", answered))["a"] == len(chain) - 1
        live.clear()  # its events stopped: predicted again
        assert await index.match("m", chain) == {"a": len(chain), "b": len(chain)}

    asyncio.run(scenario())
