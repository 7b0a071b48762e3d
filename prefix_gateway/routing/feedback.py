"""Cache feedback: a replica's reported cached tokens against the index's prediction.

The two agree within a tolerance when nothing was evicted. A report clearly below means the
replica evicted the prompt from its first missing block on: every *other* chain through that
block whose request ended before this one was sent is forgotten for that backend, found
through `ChainLinks` (bounded, per process) in O(prompt + pruned), at most `_PRUNE_MAX`
blocks, deepest runs first so every chain left is a prefix. Failures are counted, not raised.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from itertools import pairwise

from prefix_gateway.config import Settings
from prefix_gateway.metrics import Metrics
from prefix_gateway.prompt.canonical import is_batch
from prefix_gateway.prompt.parsing import Endpoint, RoutingInput
from prefix_gateway.prompt.tokens import TOKEN_BYTES
from prefix_gateway.routing import types
from prefix_gateway.state.index import PrefixIndex

log = logging.getLogger("prefix_gateway.routing.feedback")

# The tolerance is one engine block plus this slack, which covers block rounding and
# template tokens with nothing evicted (docs/routing.md).
_SLACK_TOKENS = 8
# Real tokenizers' characters per token vary along a prompt: a prediction may also be off by
# this share of itself.
_SLACK_FRACTION = 0.1
_LINKS_MAX = 1 << 18  # blocks ChainLinks remembers: bounds its memory (docs/routing.md)
_PRUNE_MAX = 4096  # blocks one report may prune: bounds the work after one response


class ReportedDepth(Enum):
    CONFIRMED = "confirmed"
    SHALLOWER = "shallower"
    DEEPER = "deeper"


@dataclass(slots=True)
class Verdict:
    outcome: ReportedDepth
    predicted_tokens: float
    first_missing: int
    """The first index block surely not cached on the replica when the request arrived."""


def tolerance(block_tokens: int) -> tuple[float, float]:
    """The tokens, and the share of a prediction, by which a report may miss it with nothing
    evicted (`judge`'s last two arguments)."""
    return block_tokens + _SLACK_TOKENS, _SLACK_FRACTION


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
        return Verdict(ReportedDepth.SHALLOWER, predicted, first_missing)
    deeper = cached_tokens > predicted + tolerance_tokens
    outcome = ReportedDepth.DEEPER if deeper else ReportedDepth.CONFIRMED
    return Verdict(outcome, predicted, predicted_blocks)


class ChainLinks:
    """Which block follows which over recent requests' chains: a bounded tree that drops the
    least recently added blocks first, a chain's deepest first."""

    def __init__(self, max_blocks: int = _LINKS_MAX) -> None:
        self._max_blocks = max_blocks
        # Oldest first. An OrderedDict, since popping a plain dict's first entry again and again
        # leaves dead slots that every next look-up of the first entry walks.
        # One child is stored as an int, a chain's last block as ().
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
        """The chains leaving `hashes` below block `start`, last added before `before`: runs
        of whole subtrees (at most `limit` blocks), deepest first, so that forgetting them in
        order keeps every chain in the index a prefix."""
        following = self._next
        added_at = self._added_at
        roots: list[int] = []
        for depth in range(start, len(hashes)):
            known = following.get(hashes[depth])
            if known is None or known == ():
                continue
            on_path = hashes[depth + 1] if depth + 1 < len(hashes) else None
            if known == on_path:  # the usual link: only the chain itself goes on from here
                continue
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
        self._block_tokens = settings.block_tokens
        self._chars_per_token = settings.chars_per_token
        self.tolerance_tokens = settings.block_tokens + _SLACK_TOKENS
        self.links = ChainLinks()

    async def observe(
        self, request: RoutingInput, prompt: list[int], outcome: types.Outcome, chain: list[int]
    ) -> None:
        """Learn from a completed request's usage (`chain`: its prompt and answer). Never raises."""
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
        # With the engine's tokens, "characters" are packed ids: the ratio is their width.
        hashed, block = request.hashed(self._block_chars, self._block_tokens)
        assumed = self._chars_per_token if request.tokens is None else TOKEN_BYTES
        ratio = chars_per_token(len(hashed), outcome.prompt_tokens, assumed)
        verdict = judge(
            outcome.decision.matched_blocks,
            cached_tokens,
            ratio,
            block,
            self.tolerance_tokens,
            _SLACK_FRACTION,
        )
        metrics = self._metrics
        metrics.child(metrics.index_feedback, model, backend, verdict.outcome.value).inc()
        metrics.child(metrics.index_feedback_gap_tokens, model).observe(
            verdict.predicted_tokens - cached_tokens
        )
        if verdict.outcome is ReportedDepth.SHALLOWER:
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
    """A completions batch, whose usage adds up prompts that no one chain predicts."""
    return request.endpoint is Endpoint.COMPLETIONS and is_batch(request.canonical)
