"""LoRA adapters on the emulated replica, as vLLM serves them.

Each adapter is a model of its own: `/v1/models` lists it with `root` (its path) and `parent`
(the base model), and a request names it in `model`. Only `max_loras` adapters are resident in
the engine's slots at once: a request for another evicts the least recently used one (a
*swap*, counted in `/metrics`, and costing `swap_seconds` before its prefill). The prefix cache
is keyed by adapter: the same prompt under two adapters, or under an adapter and the base
model, shares no block. With LoRA enabled, `POST /v1/load_lora_adapter` and
`POST /v1/unload_lora_adapter` answer as vLLM's do when it runs with
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`; no file is read: any non-empty path loads.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefix_gateway.emulator.errors import EmulatorError


class InvalidAdapterRequest(EmulatorError):
    """vLLM's answer to a load or unload it refuses (its error type, not the status name)."""

    status = 400
    error_type = "InvalidUserInput"


class AdapterNotFound(EmulatorError):
    """vLLM's answer to unloading an adapter it does not hold."""

    status = 404
    error_type = "NotFoundError"


class Adapters:
    """The adapters one replica serves, its slots, and the counts of loads, unloads and swaps."""

    def __init__(
        self,
        base_model: str,
        modules: Iterable[tuple[str, str]] = (),
        max_loras: int = 1,
        load_seconds: float = 0.0,
        swap_seconds: float = 0.0,
    ) -> None:
        self.base_model = base_model
        self.served: dict[str, str] = dict(modules)
        """Adapter name to the path it was loaded from, in load order."""
        self.max_loras = max_loras
        self._load_seconds = load_seconds
        self._swap_seconds = swap_seconds
        self._slots: OrderedDict[str, None] = OrderedDict()
        self.loads = 0
        self.loading = 0
        """Loads under way (they take `--lora-load-ms`)."""
        self.unloads = 0
        self.swaps = 0

    def adapter_of(self, body: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
        """The adapter a request body names, and the body as the base model's request."""
        model = body.get("model")
        if isinstance(model, str) and model in self.served:
            return model, {**body, "model": self.base_model}
        return None, body

    async def activate(self, adapter: str) -> None:
        """Bring `adapter` into a slot for a request: a swap when the slots hold others."""
        if adapter in self._slots:
            self._slots.move_to_end(adapter)
            return
        if len(self._slots) >= self.max_loras:
            self._slots.popitem(last=False)
            self.swaps += 1
            if self._swap_seconds > 0:
                await asyncio.sleep(self._swap_seconds)
        self._slots[adapter] = None

    async def load(self, body: Mapping[str, Any]) -> bytes:
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise InvalidAdapterRequest("Both 'lora_name' and 'lora_path' must be provided.")
        if name == self.base_model:
            raise InvalidAdapterRequest(
                f"The lora adapter '{name}' conflicts with a served base model."
            )
        if name in self.served and not body.get("load_inplace", False):
            raise InvalidAdapterRequest(
                f"The lora adapter '{name}' has already been loaded. If you want to load the"
                " adapter in place, set 'load_inplace' to True."
            )
        if self._load_seconds > 0:
            self.loading += 1
            try:
                await asyncio.sleep(self._load_seconds)
            finally:
                self.loading -= 1
        self.served[name] = path
        self.loads += 1
        return f"Success: LoRA adapter '{name}' added successfully.".encode()

    def unload(self, body: Mapping[str, Any]) -> bytes:
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise InvalidAdapterRequest(
                "'lora_name' needs to be provided to unload a LoRA adapter."
            )
        if name not in self.served:
            raise AdapterNotFound(f"The lora adapter '{name}' cannot be found.")
        del self.served[name]
        self._slots.pop(name, None)
        self.unloads += 1
        return f"Success: LoRA adapter '{name}' removed successfully.".encode()


def adapter_salt(adapter: str | None, salt: str | None) -> str | None:
    """The prefix-cache key of a request: its adapter goes into it, as in vLLM's block hashes."""
    if adapter is None:
        return salt
    return f"lora:{adapter}\x00{salt or ''}"


class AdapterCollector(Collector):
    """`/metrics` series of the adapters (the emulator's own: vLLM has no swap counter)."""

    def __init__(self, adapters: Adapters, model_name: str) -> None:
        self._adapters = adapters
        self._model_name = model_name

    def collect(self) -> Iterable[Metric]:
        adapters = self._adapters
        for name, documentation, value in (
            ("emulator:lora_loads", "LoRA adapters loaded at runtime.", adapters.loads),
            ("emulator:lora_unloads", "LoRA adapters unloaded at runtime.", adapters.unloads),
            (
                "emulator:lora_swaps",
                "Adapters evicted from a --max-loras slot to make room for another.",
                adapters.swaps,
            ),
        ):
            family = CounterMetricFamily(name, documentation, labels=["model_name"])
            family.add_metric([self._model_name], value)
            yield family
        loading = GaugeMetricFamily(
            "emulator:lora_loads_running", "LoRA adapter loads under way.", labels=["model_name"]
        )
        loading.add_metric([self._model_name], adapters.loading)
        yield loading
