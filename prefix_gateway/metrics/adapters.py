"""The LoRA adapter series (docs/metrics.md): labelled only by the adapters replicas list or the
`lora_adapters:` list declares, so that clients cannot mint series."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class AdapterSeries:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.replicas = Gauge(
            "gateway_lora_adapter_replicas",
            "Replicas serving each LoRA adapter now (healthy and not draining).",
            ["adapter"],
            multiprocess_mode="livemax",
            registry=registry,
        )
        self.loads = Counter(
            "gateway_lora_adapter_loads",
            "On-demand loads of a `lora_adapters` adapter on a replica, by outcome (`loaded`,"
            " `failed`).",
            ["adapter", "outcome"],
            registry=registry,
        )
        self.unloads = Counter(
            "gateway_lora_adapter_unloads",
            "Adapters of `lora_adapters` unloaded from a replica that had not served them for"
            " --lora-idle-unload seconds, by outcome (`unloaded`, `failed`).",
            ["adapter", "outcome"],
            registry=registry,
        )
