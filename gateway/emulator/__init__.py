"""An emulated vLLM replica for demos, tests and benchmarks without a GPU (docs/emulator.md);
its cache and time model are pure, so the replay drives them in virtual time.
"""

from gateway.emulator.app import EmulatorApp, build_app
from gateway.emulator.config import EmulatorConfig, add_arguments, config_from_args
from gateway.emulator.engine import Engine
from gateway.emulator.prefix_cache import CacheLease, PrefixCache, block_hashes
from gateway.emulator.process import EmulatorProcess
from gateway.emulator.sampler import Sampler
from gateway.emulator.server import serve
from gateway.emulator.timing import PrefillLane, TimeModel
from gateway.emulator.tokenizer import encode

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
