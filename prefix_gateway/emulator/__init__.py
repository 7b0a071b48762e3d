"""An emulated vLLM replica for demos, tests and benchmarks without a GPU (docs/emulator.md);
its cache and time model are pure, so the replay drives them in virtual time.
"""

from prefix_gateway.emulator.app import EmulatorApp, build_app
from prefix_gateway.emulator.config import EmulatorConfig, add_arguments, config_from_args
from prefix_gateway.emulator.engine import Engine
from prefix_gateway.emulator.prefix_cache import CacheLease, PrefixCache, block_hashes
from prefix_gateway.emulator.process import EmulatorProcess
from prefix_gateway.emulator.sampler import Sampler
from prefix_gateway.emulator.server import serve
from prefix_gateway.emulator.timing import PrefillLane, TimeModel
from prefix_gateway.emulator.tokenizer import encode

__all__ = [
    "CacheLease",
    "EmulatorApp",
    "EmulatorConfig",
    "EmulatorProcess",
    "Engine",
    "PrefillLane",
    "PrefixCache",
    "Sampler",
    "TimeModel",
    "add_arguments",
    "block_hashes",
    "build_app",
    "config_from_args",
    "encode",
    "serve",
]
