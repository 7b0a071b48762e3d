"""What each replica's KV cache holds, exactly, as its engine's cache events tell it (vLLM's
`BlockStored`, `BlockRemoved`, `AllBlocksCleared`), and a prefix index that answers from it.

A stored block carries its token ids and its parent's engine hash, so the block is re-keyed by
the gateway's own chain hash of those ids (the hash `Router` computes for a prompt tokenized
with `--tokenizer`): matching a prompt costs no engine hashing. A block whose parent is unknown
(stored before the gateway listened), or that carries extra keys (a `cache_salt`, a LoRA), is
left out, with every block chained on it: it would never match a prompt's chain anyway.

`EventFedIndex` answers a replica's depth from these blocks while its events flow, counting
also the blocks the gateway sent there that are still pending: routed and not yet stored (a
prefill not yet scheduled has stored nothing), until the engine stores them, `settle_seconds`
after the request ends (`settle`: its last blocks' events may still be on their way when the
client already sends its next turn), or `pending_seconds` pass. For a replica whose events
stopped or skipped, it answers from the predicted index, which every call keeps up to date as
before.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from prefix_gateway.prompt.hashing import chain_hashes
from prefix_gateway.prompt.tokens import TOKEN_BYTES, pack
from prefix_gateway.state.index import PrefixIndex


class EngineBlocks:
    """One replica's cached blocks, keyed by the gateway's chain hashes."""

    def __init__(self, block_size: int, max_blocks: int = 4_000_000) -> None:
        self.block_size = block_size
        self._max_blocks = max_blocks
        self._engine_of: dict[int, int] = {}
        """Gateway hash -> the engine's hash of the same block."""
        self._ours: dict[int, int] = {}
        """The engine's hash -> the gateway's."""
        self.last_sequence: int | None = None
        self.complete = True
        """False once a message was missed: what the engine holds is no longer known."""

    def __len__(self) -> int:
        return len(self._engine_of)

    def __contains__(self, block: int) -> bool:
        return block in self._engine_of

    def depth(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of the chain `hashes` the replica holds."""
        held = self._engine_of
        depth = 0
        for block in hashes:
            if block not in held:
                break
            depth += 1
        return depth

    def receive(self, sequence: int, events: Iterable[Mapping[str, Any]]) -> list[int]:
        """Apply one message's events; the gateway hashes of the blocks it stored."""
        last = self.last_sequence
        if last is not None and sequence <= last:
            self.clear()  # numbering began again: the engine restarted, its cache empty
        elif last is not None and sequence > last + 1:
            self.complete = False
        self.last_sequence = sequence
        stored: list[int] = []
        for event in events:
            kind = event.get("type")
            if kind == "BlockStored":
                stored += self._stored(event)
            elif kind == "BlockRemoved":
                for engine_hash in event.get("block_hashes") or ():
                    ours = self._ours.pop(engine_hash, None)
                    if ours is not None:
                        self._engine_of.pop(ours, None)
            elif kind == "AllBlocksCleared":
                self.clear()
        return stored

    def clear(self) -> None:
        """The engine holds nothing: known again, whatever was missed before."""
        self._engine_of.clear()
        self._ours.clear()
        self.complete = True

    def _stored(self, event: Mapping[str, Any]) -> list[int]:
        engine_hashes = event.get("block_hashes") or []
        token_ids = event.get("token_ids") or []
        size = event.get("block_size", self.block_size)
        if size != self.block_size or event.get("lora_id") is not None:
            return []
        if len(token_ids) != size * len(engine_hashes):
            return []
        parent = event.get("parent_block_hash")
        seed = 0
        if parent is not None:
            found = self._ours.get(parent)
            if found is None:
                return []
            seed = found
        extra = event.get("extra_keys") or [None] * len(engine_hashes)
        keyed = next((i for i, keys in enumerate(extra) if keys), len(engine_hashes))
        if keyed == 0:
            return []
        ours = chain_hashes(pack(token_ids[: keyed * size]), size * TOKEN_BYTES, seed)
        if len(self._engine_of) + len(ours) > self._max_blocks:
            return []
        for gateway_hash, engine_hash in zip(ours, engine_hashes, strict=False):
            self._engine_of[gateway_hash] = engine_hash
            self._ours[engine_hash] = gateway_hash
        return ours


class EventFedIndex:
    """A prefix index whose depths, for replicas with flowing events, are what they hold."""

    def __init__(
        self,
        predicted: PrefixIndex,
        live: Callable[[], Mapping[str, EngineBlocks]] = dict,
        pending_seconds: float = 30.0,
        settle_seconds: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.predicted = predicted
        self.live = live
        """The replicas whose events flow now, and their blocks."""
        self._pending_seconds = pending_seconds
        self._settle_seconds = min(settle_seconds, pending_seconds)
        self._clock = clock
        self._pending: dict[tuple[str, int], float] = {}
        """(backend, block) -> when the gateway sent it there, until the engine stores it."""

    async def match(self, model: str, hashes: Sequence[int]) -> dict[str, int]:
        matched = await self.predicted.match(model, hashes)
        live = self.live()
        if not live or not hashes:
            return matched
        oldest = self._clock() - self._pending_seconds
        pending = self._pending
        for backend, blocks in live.items():
            depth = 0
            for block in hashes:
                if block not in blocks and pending.get((backend, block), -1.0) < oldest:
                    break
                depth += 1
            if depth:
                matched[backend] = depth
            else:
                matched.pop(backend, None)
        return matched

    async def record(self, model: str, backend: str, hashes: Sequence[int]) -> None:
        await self.predicted.record(model, backend, hashes)
        self._pend(backend, hashes)

    def _pend(self, backend: str, hashes: Sequence[int]) -> None:
        """Blocks sent to `backend` count as held until its events had time to tell."""
        if backend in self.live():
            now = self._clock()
            for block in hashes:
                self._pending[(backend, block)] = now
            if len(self._pending) > 1_000_000:
                self._drop_old(now)

    def share(self, model: str, backend: str, hashes: Sequence[int]) -> None:
        self.predicted.share(model, backend, hashes)

    async def publish(self, model: str, backend: str, hashes: Sequence[int]) -> None:
        await self.predicted.publish(model, backend, hashes)
        self._pend(backend, hashes)

    async def forget(self, model: str, backend: str, hashes: Sequence[int]) -> None:
        await self.predicted.forget(model, backend, hashes)
        for block in hashes:
            self._pending.pop((backend, block), None)

    def settle(self, backend: str, blocks: Iterable[int]) -> None:
        """The request that sent `blocks` ended: they stay pending `settle_seconds` more, for
        the events of what the engine stored last to arrive, then count only if stored."""
        pending = self._pending
        expiry = self._clock() - self._pending_seconds + self._settle_seconds
        for block in blocks:
            key = (backend, block)
            if key in pending:
                pending[key] = min(pending[key], expiry)

    def _drop_old(self, now: float) -> None:
        oldest = now - self._pending_seconds
        self._pending = {key: at for key, at in self._pending.items() if at >= oldest}
