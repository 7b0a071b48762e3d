"""Where settings come from, highest first: command-line flag, `GATEWAY_*` variable, YAML file,
default."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import os
import typing
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from prefix_gateway.config.adapters import parse_adapters
from prefix_gateway.config.sections import sectioned_fields
from prefix_gateway.config.settings import ConfigError, Settings
from prefix_gateway.config.tenants import parse_tenants


def _env_name(f: dataclasses.Field[Any]) -> str:
    return "GATEWAY_" + str(f.metadata.get("env", f.name.upper()))


@functools.cache
def _settings_types() -> dict[str, Any]:
    # Evaluating every annotation costs milliseconds; a start-up asks once per flag.
    return typing.get_type_hints(Settings)


def _field_type(f: dataclasses.Field[Any]) -> Any:
    return _settings_types()[f.name]


def _coerce(f: dataclasses.Field[Any], raw: Any) -> Any:
    kind = _field_type(f)
    if typing.get_origin(kind) is tuple:
        if isinstance(raw, str):
            return tuple(part.strip() for part in raw.split(",") if part.strip())
        if isinstance(raw, Sequence):
            return tuple(str(part) for part in raw)
        raise ConfigError(f"{f.name} must be a list")
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off", ""):
            return False
        raise ConfigError(f"{f.name} must be true or false, not {raw!r}")
    try:
        return kind(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{f.name}: cannot read {raw!r} as {kind.__name__}") from exc


def flag_name(f: dataclasses.Field[Any]) -> str:
    return "--" + f.name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every setting as a flag, in the argument groups of `sections.SECTIONS`."""
    parser.add_argument("--config", help="YAML file of settings (keys as the flags, with _)")
    for title, fields in sectioned_fields():
        group = parser.add_argument_group(title)
        for f in fields:
            if not f.metadata.get("file_only"):
                _add_flag(group, f)


def _add_flag(group: argparse._ArgumentGroup, f: dataclasses.Field[Any]) -> None:
    flag = flag_name(f)
    help_text = f"{f.metadata['help']} (env {_env_name(f)}; default {f.default!r})"
    kind = _field_type(f)
    if typing.get_origin(kind) is tuple:
        group.add_argument(flag, action="append", default=None, help=help_text)
    elif kind is bool:
        group.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
    else:
        group.add_argument(flag, default=None, help=help_text)


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One warning per `GATEWAY_*` variable in `environ` that no setting reads, naming the
    closest known variable: a misspelt one is otherwise ignored without a word."""
    known = {_env_name(f) for f in dataclasses.fields(Settings) if not f.metadata.get("file_only")}
    known.add("GATEWAY_CONFIG")
    warnings = []
    for name in sorted(environ):
        if name.startswith("GATEWAY_") and name not in known:
            closest = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f"; did you mean {closest[0]}?" if closest else ""
            warnings.append(f"unknown variable {name} is ignored{hint}")
    return warnings


def read_file(path: str) -> dict[str, Any]:
    """The settings of the YAML file at `path`; `ConfigError` in one line for a file that is
    not YAML, not a mapping, or names a setting that does not exist."""
    try:
        with open(path, encoding="utf-8") as handle:
            loaded = yaml.safe_load(handle) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(exc)}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from exc
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: expected a mapping of settings")
    known = [f.name for f in dataclasses.fields(Settings)]
    unknown = [_unknown_key(str(key), known) for key in loaded if key not in known]
    if unknown:
        raise ConfigError(f"{path}: unknown settings {', '.join(sorted(unknown))}")
    return loaded


def _unknown_key(key: str, known: list[str]) -> str:
    closest = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f"{key!r} (did you mean {closest[0]}?)" if closest else repr(key)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """What the parser objected to and where (1-based line and column), in one line."""
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem_mark is None:
        return " ".join(str(exc).split())
    mark = exc.problem_mark
    return f"line {mark.line + 1}, column {mark.column + 1}: {exc.problem}"


def load_settings(
    args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    environ = os.environ if environ is None else environ
    given = vars(args) if args is not None else {}
    from_file: dict[str, Any] = {}
    config_path = given.get("config") or environ.get("GATEWAY_CONFIG")
    if config_path:
        from_file = read_file(config_path)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(Settings):
        if f.metadata.get("file_only"):
            if f.name == "tenants":
                values[f.name] = parse_tenants(from_file.get(f.name), environ)
            elif f.name == "lora_adapters":
                values[f.name] = parse_adapters(from_file.get(f.name))
        elif given.get(f.name) is not None:
            raw = given[f.name]
            if isinstance(raw, list):
                raw = [part for item in raw for part in str(item).split(",") if part]
            values[f.name] = _coerce(f, raw)
        elif _env_name(f) in environ:
            values[f.name] = _coerce(f, environ[_env_name(f)])
        elif f.name in from_file:
            values[f.name] = _coerce(f, from_file[f.name])
    return Settings(**values).validate()
