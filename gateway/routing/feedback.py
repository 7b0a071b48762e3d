"""Cache feedback: what a replica's reported cached tokens say about the prefix index.

The index predicts, per request, how deep the chosen replica's cached prefix is (its matched
depth in blocks of `block_chars` characters). The replica reports what it found
(`usage.prompt_tokens_details.cached_tokens`). Converted to tokens with the request's own
characters per token (canonical length over reported prompt tokens), the two agree within a
tolerance when nothing was evicted; the tolerance covers the engine rounding its hit down to
whole blocks (and leaving the last prompt token to compute) and the chunking's character
counts not falling on token boundaries.

A report clearly below the prediction means the replica evicted the prefix from some block on.
The request has just computed its whole prompt again, so its own blocks are where the index
says they are. What turned stale is every *other* chain through the first missing block:
each use of such a chain used that block too, so under LRU (the emulator's, and vLLM's, whose
freed blocks queue for eviction tail first) their deeper blocks were evicted no later than it.
Those are the chains that branch off the prompt at or below the first missing block; this
module keeps the links between blocks (`ChainLinks`, bounded, local to the process) to find
them, and the index forgets them for that backend only. Only chains whose requests had ended
before this one was sent count: the index records a prompt when it is routed, so a request
sent while another with the same new prefix is still being computed finds nothing, and that is
not eviction.

Everything here runs after the response reached the client; a failure is counted, not raised.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from itertools import pairwise

from gateway.config import Settings
from gateway.metrics import Metrics
from gateway.prompt.canonical import is_batch
from gateway.prompt.parsing import Endpoint, RoutingInput
from gateway.routing import types
from gateway.state.index import PrefixIndex

log = logging.getLogger("gateway.routing.feedback")

# With nothing evicted, the emulator's reports differ from predictions by at most 17.3 tokens
# (loadtest/feedback_tolerance.py, docs/routing.md): one engine block plus this slack covers it.
_SLACK_TOKENS = 8
# Real tokenizers' characters per token vary along a prompt (code, JSON, prose), which the
# emulator's does not show: a prediction may also be off by this share of itself.
_SLACK_FRACTION = 0.1
_LINKS_MAX = 1 << 18
"""Blocks whose successors `ChainLinks` remembers (about 160 bytes each: 40 MiB at most)."""
_PRUNE_MAX = 4096
"""Blocks one report may prune at most."""


class Agreement(Enum):
    CONFIRMED = "confirmed"
    SHALLOWER = "shallower"
    DEEPER = "deeper"


@dataclass(frozen=True, slots=True)
class Verdict:
    outcome: Agreement
    predicted_tokens: float
    first_missing: int
    """The first index block surely not cached on the replica when the request arrived."""


def chars_per_token(canonical_chars: int, prompt_tokens: int | None, assumed: float) -> float:
    """The request's own characters per token, or `assumed` when the replica did not say."""
    if prompt_tokens and canonical_chars:
        return canonical_chars / prompt_tokens
    return assumed


def judge(
    predicted_blocks: int,
    cached_tokens: int,
    ratio: float,
    block_chars: int,
    tolerance_tokens: float,
    tolerance_fraction: float = 0.0,
) -> Verdict:
    """Compare the index's prediction with a replica's report, at `ratio` characters per
    token, allowing `tolerance_tokens` plus `tolerance_fraction` of the prediction."""
    predicted = predicted_blocks * block_chars / ratio
    tolerance_tokens += tolerance_fraction * predicted
    if cached_tokens + tolerance_tokens < predicted:
        # The block holding the character that the report plus the tolerance reaches is the
        # first one surely missing.
        reached = (cached_tokens + tolerance_tokens) * ratio
        first_missing = min(predicted_blocks - 1, math.floor(reached / block_chars))
        return Verdict(Agreement.SHALLOWER, predicted, first_missing)
    deeper = cached_tokens > predicted + tolerance_tokens
    outcome = Agreement.DEEPER if deeper else Agreement.CONFIRMED
    return Verdict(outcome, predicted, predicted_blocks)


class ChainLinks:
    """Which block follows which, over the chains of recent requests: a bounded tree.

    Hashes are chained, so a block has one predecessor and the links form a tree; a block
    followed by one block (the common case) stores it as a plain int, a chain's last block an
    empty tuple. Each block also keeps when a chain through it was last added: a block's time
    is never earlier than any block's below it. When full, the blocks used longest ago are
    dropped first, and of one chain its deepest blocks first, so that a block is never kept
    while the links leading to it are gone.
    """

    def __init__(self, max_blocks: int = _LINKS_MAX) -> None:
        self._max_blocks = max_blocks
        # Ordered by last use, oldest first. (A plain dict would do without its O(1) removal
        # of the oldest: deleting a dict's first entry again and again leaves a run of dead
        # slots that every next look-up of the first entry walks.)
        self._next: OrderedDict[int, int | tuple[int, ...]] = OrderedDict()
        self._added_at: dict[int, float] = {}

    def __len__(self) -> int:
        return len(self._next)

    def add(self, hashes: list[int], now: float) -> None:
        """Link the chain `hashes`, added at `now` (a `time.perf_counter()` value)."""
        if not hashes:
            return
        following = self._next
        added_at = self._added_at
        if hashes[0] not in following:
            # A chain whose first block is new is new throughout (chained hashes): linked in
            # one pass, deepest first, as the general case below would.
            following[hashes[-1]] = ()
            following.update(zip(reversed(hashes[:-1]), reversed(hashes[1:]), strict=True))
            added_at.update(dict.fromkeys(hashes, now))
            self._trim()
            return
        last = hashes[-1]
        if last in following:
            following.move_to_end(last)
        else:
            following[last] = ()
        added_at[last] = now
        # Deepest first, each moved to the end: the order kept is the order to drop in.
        for block, child in reversed(list(pairwise(hashes))):
            added_at[block] = now
            known = following.get(block)
            if known is None:
                following[block] = child
                continue
            following.move_to_end(block)
            if isinstance(known, int):
                if known != child:
                    following[block] = (known, child)
            elif not known:  # was a chain's last block
                following[block] = child
            elif child not in known:
                following[block] = (*known, child)
        self._trim()

    def _trim(self) -> None:
        following = self._next
        added_at = self._added_at
        while len(following) > self._max_blocks:
            dropped, _ = following.popitem(last=False)
            del added_at[dropped]

    def branches(
        self,
        hashes: list[int],
        start: int,
        before: float = math.inf,
        limit: int = _PRUNE_MAX,
    ) -> list[list[int]]:
        """The blocks of chains that leave `hashes` below block `start` and were last added
        before `before`, in runs ending at a chain's last block, every block once, a run after
        the runs below it.

        At most `limit` blocks, as whole subtrees: a block is never listed without the blocks
        below it, so that forgetting the runs in order keeps every chain in the index a prefix.
        """
        following = self._next
        added_at = self._added_at
        roots: list[int] = []
        for depth in range(start, len(hashes)):
            known = following.get(hashes[depth])
            if known is None or known == ():
                continue
            on_path = hashes[depth + 1] if depth + 1 < len(hashes) else None
            children = (known,) if isinstance(known, int) else known
            # A child whose own entry was dropped is no more recent than its parent.
            parent_added = added_at[hashes[depth]]
            roots.extend(
                child
                for child in children
                if child != on_path and added_at.get(child, parent_added) < before
            )
        runs: list[list[int]] = []
        total = 0
        for root in roots:
            subtree = self._subtree(root, limit - total)
            if subtree is None:
                break
            runs.extend(subtree)
            total += sum(len(run) for run in subtree)
        runs.reverse()
        return runs

    def _subtree(self, root: int, limit: int) -> list[list[int]] | None:
        """The runs below and including `root` in depth-first order; None past `limit` blocks."""
        following = self._next
        runs: list[list[int]] = []
        total = 0
        seen: set[int] = set()
        stack: list[tuple[int, list[int]]] = [(root, [])]
        while stack:
            block, run = stack.pop()
            total += 1
            if total > limit or block in seen:  # `seen`: a hash collision must not loop
                return None
            seen.add(block)
            run.append(block)
            known = following.get(block)
            if known is None or known == ():  # a chain's end, or its links were dropped
                runs.append(run)
                continue
            children = (known,) if isinstance(known, int) else known
            stack.extend((child, []) for child in reversed(children[1:]))
            stack.append((children[0], run))
        return runs


class CacheFeedback:
    def __init__(self, index: PrefixIndex, metrics: Metrics, settings: Settings) -> None:
        self._index = index
        self._metrics = metrics
        self._block_chars = settings.block_chars
        self._chars_per_token = settings.chars_per_token
        self.tolerance_tokens = settings.block_tokens + _SLACK_TOKENS
        self.links = ChainLinks()

    async def observe(
        self, request: RoutingInput, prompt: list[int], outcome: types.Outcome, chain: list[int]
    ) -> None:
        """Learn from a completed request's usage; `prompt` is its prompt's chain, `chain` what
        the index holds for it once its answer is recorded. Never raises."""
        if outcome.cached_tokens is None or request.endpoint is Endpoint.EMBEDDINGS:
            return
        if _batched(request):
            return
        try:
            await self._observe(request, prompt, outcome)
            self.links.add(chain, time.perf_counter())
        except Exception:
            self._metrics.index_feedback_errors.inc()
            log.warning("cache feedback failed", exc_info=True)

    async def _observe(
        self, request: RoutingInput, prompt: list[int], outcome: types.Outcome
    ) -> None:
        model, backend = request.model, outcome.decision.backend
        cached_tokens = outcome.cached_tokens or 0
        ratio = chars_per_token(
            len(request.canonical), outcome.prompt_tokens, self._chars_per_token
        )
        verdict = judge(
            outcome.decision.matched_blocks,
            cached_tokens,
            ratio,
            self._block_chars,
            self.tolerance_tokens,
            _SLACK_FRACTION,
        )
        metrics = self._metrics
        metrics.child(metrics.index_feedback, model, backend, verdict.outcome.value).inc()
        metrics.child(metrics.index_feedback_gap_tokens, model).observe(
            verdict.predicted_tokens - cached_tokens
        )
        if verdict.outcome is Agreement.SHALLOWER:
            pruned = 0
            # Only chains whose requests had ended before this one was sent: one still being
            # computed then (a burst sharing a new prefix) was not evicted, just not there yet.
            stale = self.links.branches(prompt, verdict.first_missing, outcome.sent_at)
            for run in stale:
                await self._index.forget(model, backend, run)
                pruned += len(run)
            if pruned:
                metrics.index_feedback_pruned_blocks.labels(model, backend).inc(pruned)


def _batched(request: RoutingInput) -> bool:
    """A completions batch: its usage adds up prompts that the replica caches each on its own,
    which one chain cannot predict."""
    return request.endpoint is Endpoint.COMPLETIONS and is_batch(request.canonical)
