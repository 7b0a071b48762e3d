"""`token-agreement`: the cached tokens routing predicts for a repeated probe against those the
engine reports, and, when they differ, which of the tokenizer, the chat template or the block
size is to blame, found by trying each.
"""

from __future__ import annotations

from prefix_gateway.config import Settings
from prefix_gateway.doctor.probe import GatewayView
from prefix_gateway.doctor.verdicts import (
    Check,
    CheckResult,
    block_size_verdict,
    cached_at,
    failed,
    passed,
    skipped,
)
from prefix_gateway.routing.feedback import ReportedDepth, judge, tolerance


def token_agreement(
    settings: Settings,
    view: GatewayView,
    prompt_tokens: int,
    cached_tokens: int | None,
    engine_count: int | None,
) -> CheckResult:
    """`engine_count`: the engine's token count of the gateway's own rendering of the probe
    (with `--tokenizer`, where the engine has `/tokenize`)."""
    check = Check.TOKEN_AGREEMENT
    if cached_tokens is None:
        return skipped(check, "cannot tell: the engine reports no cached tokens")
    if cached_tokens == 0:
        return failed(check, "nothing was served from cache to compare (see prefix-caching)")
    block = settings.block_tokens
    predicted = len(view.chain) * block
    summary = (
        f"predicted {predicted} cached tokens, the engine reported {cached_tokens}"
        f" of {prompt_tokens}"
    )
    if view.counted:
        agree = predicted == cached_tokens
        how = f"tokens counted with --tokenizer, blocks of {block}"
    else:
        # As cache feedback judges a reply: at the characters per token the engine's count
        # gives this prompt, within the same tolerance.
        per_token = view.characters / max(prompt_tokens, 1)
        slack, share = tolerance(block)
        verdict = judge(
            len(view.chain), cached_tokens, per_token, settings.block_chars, slack, share
        )
        agree = (
            verdict.outcome is ReportedDepth.CONFIRMED
            and cached_at(prompt_tokens, block) == cached_tokens
        )
        how = (
            f"tokens estimated from characters: {per_token:.2f} per token on this probe,"
            f" --chars-per-token {settings.chars_per_token:g}; blocks of {block}"
        )
        summary = (
            f"predicted {verdict.predicted_tokens:.0f} cached tokens, the engine reported"
            f" {cached_tokens} of {prompt_tokens}"
        )
    if agree:
        return passed(check, f"{summary} ({how})")
    return failed(
        check, f"{summary}: {_why(settings, view, prompt_tokens, cached_tokens, engine_count)}"
    )


def _why(
    settings: Settings,
    view: GatewayView,
    prompt_tokens: int,
    cached_tokens: int,
    engine_count: int | None,
) -> str:
    ours = round(view.tokens)
    if view.counted and ours != prompt_tokens:
        counts = f"the gateway makes the probe {ours} tokens, the engine {prompt_tokens}"
        if engine_count is None:
            return f"{counts}: the tokenizer or the chat template differs (--tokenizer)"
        if engine_count == ours:
            return (
                f"chat template differs: {counts}, yet the engine's tokenizer makes the"
                f" gateway's rendering {engine_count} tokens too; give --tokenizer the folder"
                " of the template the engine uses (its tokenizer_config.json or"
                " chat_template.jinja)"
            )
        return (
            f"tokenizer differs: {counts}, and the engine's tokenizer makes the gateway's own"
            f" rendering {engine_count} tokens; give --tokenizer the served model's folder"
        )
    size = block_size_verdict(prompt_tokens, cached_tokens, settings.block_tokens)
    if size is not None:
        return size
    return (
        "the engine holds less of the probe than it was sent: it evicted part of it, or its"
        " chat template adds what the gateway does not see"
    )
