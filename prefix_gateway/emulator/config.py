"""The emulated replica's settings: one frozen value, checked once, built from CLI flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

CHAT_TEMPLATES = ("plain", "chatml")


@dataclass(frozen=True)
class EmulatorConfig:
    model: str = "emulated-model"
    host: str = "127.0.0.1"
    port: int = 8001
    block_size: int = 16
    cache_blocks: int = 8192
    max_running: int = 64
    prefill_seconds_per_token: float = 0.0
    decode_seconds_per_token: float = 0.0
    slowdown: float = 1.0
    """How many times slower than the per-token costs prefill and decode run (a slower GPU)."""
    chat_template: str = "plain"
    default_max_tokens: int = 64
    seed: int = 0
    prompt_tokens_details: bool = True
    """Usage reports the cached tokens (`prompt_tokens_details`), as vLLM does only when run
    with --enable-prompt-tokens-details."""
    honour_cache_salt: bool = True
    """A request's `cache_salt` keys its cached blocks; off: accepted and ignored, as an engine
    without salting would."""
    pooling: bool = False
    """Also serve what vLLM serves only for a pooling model: `/pooling`, `/classify`,
    `/v2/embed`, score and rerank (a generative vLLM answers them 404)."""
    enable_scale_out: bool = False
    """Answer vLLM's render endpoints (`/v1/chat/completions/render`, `/v1/completions/render`)
    with the prompt's token ids, as vLLM does with `--enable-scale-out`; off: 403, as by
    default."""
    lora_modules: tuple[tuple[str, str], ...] = ()
    """LoRA adapters served from the start, (name, path), as vLLM's `--lora-modules`."""
    enable_lora: bool = False
    """Serve adapters (implied by `lora_modules`), with the runtime load and unload endpoints."""
    max_loras: int = 1
    lora_load_seconds: float = 0.0
    lora_swap_seconds: float = 0.0

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("the model name must not be empty")
        if self.block_size < 1 or self.cache_blocks < 1 or self.max_running < 1:
            raise ValueError("block_size, cache_blocks and max_running must be at least 1")
        if self.prefill_seconds_per_token < 0 or self.decode_seconds_per_token < 0:
            raise ValueError("per-token costs must not be negative")
        if not self.slowdown > 0:
            raise ValueError("the slowdown must be a positive number")
        if self.chat_template not in CHAT_TEMPLATES:
            raise ValueError(
                f"unknown chat template {self.chat_template!r}; "
                f"choose one of {', '.join(CHAT_TEMPLATES)}"
            )
        if self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be at least 1")
        if self.max_loras < 1 or self.lora_load_seconds < 0 or self.lora_swap_seconds < 0:
            raise ValueError("max_loras must be at least 1, LoRA load and swap times not negative")
        names = [name for name, _ in self.lora_modules]
        if len(set(names)) != len(names) or self.model in names:
            raise ValueError("LoRA adapter names must differ from each other and the model")

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    @property
    def max_model_len(self) -> int:
        """Longest prompt plus completion accepted: a sequence that fits the whole cache."""
        return self.block_size * self.cache_blocks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = EmulatorConfig()
    parser.add_argument("--host", default=defaults.host, help="address to listen on")
    parser.add_argument("--port", type=int, default=defaults.port, help="port to listen on")
    parser.add_argument("--name", default=defaults.model, help="model name served")
    parser.add_argument(
        "--cache-blocks",
        type=int,
        default=defaults.cache_blocks,
        help="KV-cache capacity in blocks",
    )
    parser.add_argument(
        "--block-size", type=int, default=defaults.block_size, help="tokens per KV-cache block"
    )
    parser.add_argument(
        "--max-running",
        type=int,
        default=defaults.max_running,
        help="sequences run concurrently; more wait in a FIFO queue",
    )
    parser.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=defaults.prefill_seconds_per_token * 1e6,
        help="microseconds of prefill per uncached prompt token (prefills run one at a time)",
    )
    parser.add_argument(
        "--decode-ms-per-token",
        type=float,
        default=defaults.decode_seconds_per_token * 1e3,
        help="milliseconds per generated token of every running sequence",
    )
    parser.add_argument(
        "--slowdown",
        type=float,
        default=defaults.slowdown,
        help="compute this many times slower than the per-token costs (prefill and decode), as"
        " a slower GPU would; POST /emulator/slowdown {\"factor\": F} changes it while running",
    )
    parser.add_argument(
        "--chat-template",
        choices=CHAT_TEMPLATES,
        default=defaults.chat_template,
        help="plain: message contents only; chatml: with role and turn tokens",
    )
    parser.add_argument(
        "--default-max-tokens",
        type=int,
        default=defaults.default_max_tokens,
        help="tokens generated when a request sets no max_tokens",
    )
    parser.add_argument(
        "--seed", type=int, default=defaults.seed, help="seed of the generated text"
    )
    parser.add_argument(
        "--no-prompt-tokens-details",
        dest="prompt_tokens_details",
        action="store_false",
        help="leave usage.prompt_tokens_details out of answers (null), as vLLM does without"
        " --enable-prompt-tokens-details: no cached tokens are reported",
    )
    parser.add_argument(
        "--ignore-cache-salt",
        dest="honour_cache_salt",
        action="store_false",
        help="accept cache_salt and ignore it: salted prompts share cached blocks, as on an"
        " engine without salting",
    )
    parser.add_argument(
        "--pooling",
        action="store_true",
        help="also serve a pooling model's endpoints: /pooling, /classify, /v2/embed, /score,"
        " /v1/score, /rerank, /v1/rerank, /v2/rerank",
    )
    parser.add_argument(
        "--enable-scale-out",
        action="store_true",
        help="answer /v1/chat/completions/render and /v1/completions/render with the prompt's"
        " token ids, as vLLM's flag does (without it they answer 403, as vLLM's do)",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters served from the start (as vLLM's flag; implies --enable-lora)",
    )
    parser.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters, with POST /v1/load_lora_adapter and /v1/unload_lora_adapter",
    )
    parser.add_argument(
        "--max-loras",
        type=int,
        default=defaults.max_loras,
        help="adapters resident at once; a request for another swaps one out",
    )
    parser.add_argument(
        "--lora-load-ms", type=float, default=0.0, help="milliseconds a runtime load takes"
    )
    parser.add_argument(
        "--lora-swap-ms",
        type=float,
        default=0.0,
        help="milliseconds added before the prefill of a request whose adapter was swapped in",
    )


def _lora_modules(given: list[str]) -> tuple[tuple[str, str], ...]:
    modules = []
    for spec in given:
        name, _, path = spec.partition("=")
        if not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH, not {spec!r}")
        modules.append((name, path))
    return tuple(modules)


def config_from_args(ns: argparse.Namespace) -> EmulatorConfig:
    return EmulatorConfig(
        model=ns.name,
        host=ns.host,
        port=ns.port,
        block_size=ns.block_size,
        cache_blocks=ns.cache_blocks,
        max_running=ns.max_running,
        prefill_seconds_per_token=ns.prefill_us_per_token / 1e6,
        decode_seconds_per_token=ns.decode_ms_per_token / 1e3,
        slowdown=ns.slowdown,
        chat_template=ns.chat_template,
        default_max_tokens=ns.default_max_tokens,
        seed=ns.seed,
        pooling=ns.pooling,
        enable_scale_out=ns.enable_scale_out,
        prompt_tokens_details=ns.prompt_tokens_details,
        honour_cache_salt=ns.honour_cache_salt,
        lora_modules=_lora_modules(ns.lora_modules),
        enable_lora=ns.enable_lora,
        max_loras=ns.max_loras,
        lora_load_seconds=ns.lora_load_ms / 1e3,
        lora_swap_seconds=ns.lora_swap_ms / 1e3,
    )
