"""The `lora_adapters:` list of the YAML file given with `--config`: LoRA adapters the gateway
loads on a replica when a request names one that no replica serves yet (docs/adapters.md).
Read once at start-up; a bad entry is an error that names it.

    lora_adapters:
      - name: sql-lora                    # the model name clients send
        path: /models/adapters/sql-lora   # where the replica reads it (vLLM's lora_path)
        base_model: llama-3-8b            # optional: only replicas serving it load the adapter
"""

from __future__ import annotations

from dataclasses import dataclass

from prefix_gateway.config.errors import ConfigError

_FIELDS = frozenset({"name", "path", "base_model"})
_LONGEST = 256


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    path: str
    base_model: str = ""
    """The base model whose replicas may load it; empty: any replica."""


def parse_adapters(raw: object) -> tuple[AdapterSpec, ...]:
    """The adapters a YAML `lora_adapters:` value describes; `ConfigError` naming the first
    bad one."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError("lora_adapters must be a list of adapters")
    specs: list[AdapterSpec] = []
    for position, entry in enumerate(raw):
        spec = _adapter(position, entry)
        if any(spec.name == earlier.name for earlier in specs):
            raise ConfigError(f"lora_adapters[{position}] ({spec.name}): the name is given twice")
        specs.append(spec)
    return tuple(specs)


def _adapter(position: int, entry: object) -> AdapterSpec:
    where = f"lora_adapters[{position}]"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a mapping with name and path")
    name = entry.get("name")
    if not _plain(name):
        raise ConfigError(
            f"{where}: name must be 1-{_LONGEST} printable characters without spaces, not {name!r}"
        )
    where = f"{where} ({name})"
    unknown = set(entry) - _FIELDS
    if unknown:
        raise ConfigError(f"{where}: unknown fields {sorted(unknown)}")
    path = entry.get("path")
    if not isinstance(path, str) or not path.strip() or not path.isprintable():
        raise ConfigError(f"{where}: path must be a non-empty string, not {path!r}")
    base_model = entry.get("base_model", "")
    if base_model != "" and not _plain(base_model):
        raise ConfigError(f"{where}: base_model must name a model, not {base_model!r}")
    if base_model == name:
        raise ConfigError(f"{where}: an adapter cannot be its own base model")
    return AdapterSpec(str(name), path, str(base_model))


def _plain(value: object) -> bool:
    return (
        isinstance(value, str)
        and 0 < len(value) <= _LONGEST
        and value.isprintable()
        and not any(char.isspace() for char in value)
    )
