"""The real vLLM replicas shared by the modules that test against them (`real_fleet`, a
session fixture in tests/conftest.py): two engines of the tiny model, pinned to different
cores, started once for every module that needs them instead of once per module.

They are started with everything those modules need: replica 0 serves `tiny-llama` and
`tiny-llama-a`, replica 1 `tiny-llama` and `tiny-llama-b` (each module's gateway learns those
pools from their `/v1/models`); each publishes its KV-cache events on an endpoint of its own;
stored responses are on (vLLM ignores `store` without them), and so is LoRA, with random-weight
adapters made here: `only-a` served by replica 0 from its start, `only-b` by replica 1, `both` by
both, and `lazy` by neither until a gateway loads it (runtime LoRA updating is on).

What one module does to them must not change what another asserts: each test sends prompts of
its own, and an adapter a test loads is unloaded again by the gateway that loaded it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from engines.fleet import VLLMFleet, model_folder
from engines.kv_events import events_config
from engines.lora_adapter import RANK, make_adapter
from engines.replica import VLLMReplica
from engines.tiny_model import ensure_model
from engines.venv import VLLMVenv
from tests.support import GatewayProcess

MODEL = "tiny-llama"
BLOCK = 32
"""The tokens a block of the pair's engines holds (VLLMReplica's default)."""
ONLY = (f"{MODEL}-a", f"{MODEL}-b")  # the model each replica alone serves
ADAPTERS = ("only-a", "only-b", "both", "lazy")
# The adapters each replica serves from its start.
STARTED_WITH = ({"only-a", "both"}, {"only-b", "both"})


@dataclass
class RealReplicas:
    """The session's replicas, their KV-event endpoints and the adapters' folders."""

    replicas: list[VLLMReplica]
    endpoints: list[str]
    adapters: dict[str, Path]

    @property
    def urls(self) -> list[str]:
        return [replica.url for replica in self.replicas]

    def name(self, index: int) -> str:
        """The replica's name in a gateway (`x-gateway-backend`, /admin/backends)."""
        return self.replicas[index].address

    def index(self, name: str) -> int:
        """The position of the replica a gateway calls `name`."""
        return [self.name(index) for index in range(len(self.replicas))].index(name)

    def replica_named(self, name: str) -> VLLMReplica:
        """The replica an `x-gateway-backend` value names."""
        try:
            return self.replicas[self.index(name)]
        except ValueError:
            raise AssertionError(f"no replica is named {name!r}: {self.urls}") from None


class RealFleet(RealReplicas):
    """The session's replicas and a module's gateway in front of them."""

    def __init__(self, engines: RealReplicas, gateway: GatewayProcess) -> None:
        super().__init__(engines.replicas, engines.endpoints, engines.adapters)
        self.gateway = gateway


@contextlib.contextmanager
def started_real_replicas(folder: Path) -> Iterator[RealReplicas]:
    """The two replicas, started together; their sockets and adapters in `folder`."""
    venv = VLLMVenv().ensure()
    model = ensure_model(venv.python, model_folder())
    endpoints = [f"ipc://{folder}/replica-{index}.sock" for index in range(2)]
    adapters = {
        name: make_adapter(folder / name, seed=seed) for seed, name in enumerate(ADAPTERS, start=1)
    }
    replicas = [
        VLLMReplica(
            model,
            venv=venv,
            served_model_names=(MODEL, ONLY[index]),
            cpu_cores=str(index),
            extra_args=(
                "--kv-events-config",
                events_config(endpoints[index]),
                "--enable-lora",
                "--max-lora-rank",
                str(RANK),
                "--max-loras",
                "3",
                "--lora-modules",
                *(f"{name}={adapters[name]}" for name in sorted(STARTED_WITH[index])),
            ),
            env={
                "VLLM_ENABLE_RESPONSES_API_STORE": "1",
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            },
            # Kept after the run: a failure's report shows a record's beginning only.
            log_path=folder / f"replica-{index}.log",
        )
        for index in range(2)
    ]
    with VLLMFleet(replicas) as fleet:
        yield RealReplicas(fleet.replicas, endpoints, adapters)
