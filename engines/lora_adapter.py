"""A LoRA adapter with random weights for the tiny model, in PEFT's on-disk format.

vLLM reads an adapter folder's `adapter_config.json` and `adapter_model.safetensors`. Here
both are written by hand (the safetensors layout is an 8-byte header length, a JSON header and
the raw little-endian tensors), so that no torch or peft is needed: the adapter changes what
the model computes, which is all a test of caching and routing needs.
"""

from __future__ import annotations

import json
import random
import struct
from array import array
from pathlib import Path

from engines.tiny_model import Shape

RANK = 8
TARGETS = ("q_proj", "v_proj")


def make_adapter(folder: Path, seed: int, shape: Shape | None = None) -> Path:
    """Write a rank-8 adapter of the tiny model's `q_proj` and `v_proj` into `folder`."""
    shape = shape or Shape()
    head_dim = shape.hidden_size // shape.heads
    outputs = {"q_proj": shape.heads * head_dim, "v_proj": shape.kv_heads * head_dim}
    rng = random.Random(seed)
    tensors: dict[str, tuple[list[int], array[float]]] = {}
    for layer in range(shape.layers):
        for target in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{prefix}.lora_A.weight"] = _random((RANK, shape.hidden_size), rng)
            tensors[f"{prefix}.lora_B.weight"] = _random((outputs[target], RANK), rng)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_model.safetensors").write_bytes(_safetensors(tensors))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(TARGETS),
        "fan_in_fan_out": False,
        "base_model_name_or_path": None,
        "modules_to_save": None,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def _random(dims: tuple[int, int], rng: random.Random) -> tuple[list[int], array[float]]:
    values = array("f", (rng.gauss(0.0, 0.02) for _ in range(dims[0] * dims[1])))
    return list(dims), values


def _safetensors(tensors: dict[str, tuple[list[int], array[float]]]) -> bytes:
    header: dict[str, object] = {}
    offset = 0
    blobs: list[bytes] = []
    for name, (dims, values) in tensors.items():
        blob = values.tobytes()  # float32, the machine's order: little-endian here
        header[name] = {"dtype": "F32", "shape": dims, "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs)
