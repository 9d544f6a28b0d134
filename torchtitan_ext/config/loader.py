"""TOML file + ``--section.key value`` overrides -> a validated JobConfig. Every mistake is one ``ConfigError``
line naming the file or flag, the key, the value and what was expected (exit code 2 at ``cli.run_tool``)."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from torchtitan_ext.config.job_config import JobConfig
from torchtitan_ext.errors import ConfigError


def _suggest(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    return f"; did you mean '{close[0]}'?" if close else f"; valid: {', '.join(valid)}"


def _fields(obj: Any) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(obj)}


def _coerce(value: Any, f: dataclasses.Field, where: str, from_cli: bool) -> Any:
    """Convert ``value`` to the field's type (strings come from the command line) and check its rules. A field
    typed ``X | None`` (the [model] keys: None is "not set") takes an X; a key is unset by leaving it out."""
    kind = (f.type if isinstance(f.type, str) else f.type.__name__).removesuffix(" | None")
    try:
        if kind == "bool":  # a TOML boolean, or true / false / 1 / 0 from the command line
            if from_cli and isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
                value = value.lower() in ("true", "1")
            elif not isinstance(value, bool):
                raise TypeError
        elif kind in ("int", "float"):  # a TOML int is a valid float; a bool is neither
            number = int if kind == "int" else float
            if from_cli and isinstance(value, str):
                value = number(value)
            elif isinstance(value, bool) or not isinstance(value, (int, number)):
                raise TypeError
            value = number(value)
        elif kind == "str" and not isinstance(value, str):
            raise TypeError
        elif kind == "list":
            if from_cli and isinstance(value, str):
                value = json.loads(value) if value.strip().startswith("[") else [
                    v for v in value.split(",") if v]
            if not isinstance(value, list):
                raise TypeError
    except (TypeError, ValueError, json.JSONDecodeError):
        raise ConfigError(f"{where}: expected {kind}, got {value!r}") from None
    if kind == "float" and not math.isfinite(value):  # NaN passes every min / max check; no key means infinity
        raise ConfigError(f"{where}: expected a finite float, got {value!r}")
    meta = f.metadata
    if meta.get("choices") and value not in meta["choices"]:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, meta['choices']))}")
    if meta.get("min") is not None and value < meta["min"]:
        raise ConfigError(f"{where}: {value!r} is below the minimum {meta['min']}")
    if meta.get("max") is not None and value > meta["max"]:
        raise ConfigError(f"{where}: {value!r} is above the maximum {meta['max']}")
    return value


def _set(cfg: JobConfig, section: str, key: str, value: Any, where: str, from_cli: bool) -> None:
    sections = _fields(cfg)
    if section not in sections:
        raise ConfigError(f"{where}: unknown section [{section}]{_suggest(section, list(sections))}")
    sec = getattr(cfg, section)
    keys = _fields(sec)
    if key not in keys:
        raise ConfigError(f"{where}: unknown key '{section}.{key}'{_suggest(key, list(keys))}")
    setattr(sec, key, _coerce(value, keys[key], f"{where}: {section}.{key}", from_cli))


def load_toml(cfg: JobConfig, path: str) -> None:
    """Apply the TOML file at ``path`` onto ``cfg``."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path}: not found (expected a TOML file, e.g. train_configs/debug.toml)")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"config file {path}: not UTF-8 text: byte 0x{raw[e.start]:02x} at offset {e.start} "
                          f"(line {line}); TOML files are UTF-8") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path}: TOML syntax error: {e}") from None
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: top-level key '{section}' must be a [section] table")
        if section == "model":
            table = model_table(table)
        for key, value in table.items():
            _set(cfg, section, key, value, f"{path}", from_cli=False)


# The [model] values that meant "the flavor's" before a key was unset by leaving it out (issue 39). A config.toml
# written then holds every key, some at "" or -1, which no model has: such a table is read the old way.
_OLD_UNSET = {"vocab_size": 0, "dim": 0, "n_layers": 0, "n_heads": 0, "n_kv_heads": 0, "head_dim": 0,
              "ffn_hidden": 0, "activation": "", "max_seq_len": 0, "rope_theta": 0, "rope_scaling": "",
              "rope_scaling_factor": 0, "rope_low_freq_factor": 0, "rope_high_freq_factor": 0,
              "rope_original_max_seq_len": 0, "rope_fraction": -1, "nope_every": -1, "qk_norm": "", "norm_eps": 0,
              "tie_embeddings": "", "logit_softcap": -1, "residual_scalars": "", "n_experts": -1, "top_k": 0,
              "moe_hidden": 0, "moe_every": 0, "shared_expert": "", "renormalize_gates": "", "aux_loss_coef": -1,
              "router_z_loss_coef": -1, "bias_update_rate": -1, "kv_share": "", "kv_share_group": -1,
              "parametrization": "", "mup_base_dim": 0, "mup_base_head_dim": 0}


def _old_unset(key: str, value: Any) -> bool:
    return key in _OLD_UNSET and type(value) is not bool and value == _OLD_UNSET[key]


def model_table(table: dict) -> dict:
    """A TOML [model] table's set keys: itself, or for a table written before issue 39 (one holding an old
    unset value no model can have, "" or -1) the keys whose value is not their old unset value."""
    if not any(_old_unset(k, v) and v in ("", -1) for k, v in table.items()):
        return table
    return {k: v for k, v in table.items() if not _old_unset(k, v)}


def repeated_config(first: str, second: str) -> ConfigError:
    """The one line for a second ``--config`` (the loader reads one file; a second would silently replace it)."""
    return ConfigError(f"argument --config: given twice ({first}, then {second}); give one file and override its "
                       "keys with --section.key value")


def parse_args(argv: list[str]) -> JobConfig:
    """``--config FILE`` (once) first, then ``--section.key value`` (or ``--section.key=value``) overrides."""
    cfg = JobConfig()
    overrides: list[tuple[str, str]] = []
    config_file = None
    args = iter(argv)
    for arg in args:
        if not arg.startswith("--"):
            raise ConfigError(f"argument {arg!r}: expected --config FILE or --section.key value")
        name, eq, value = arg[2:].partition("=")
        if not eq and (value := next(args, None)) is None:
            raise ConfigError(f"argument --{name}: missing value")
        if name == "config":
            if config_file is not None:
                raise repeated_config(config_file, value)
            config_file = value
        elif "." not in name:
            raise ConfigError(f"argument --{name}: expected --section.key (e.g. --training.steps 100)")
        else:
            overrides.append((name, value))
    if config_file is not None:
        load_toml(cfg, config_file)
    for name, value in overrides:
        section, key = name.split(".", 1)
        _set(cfg, section, key, value, f"argument --{name}", from_cli=True)
    return cfg


def help_text() -> str:
    """Every key with its default and meaning, grouped by section."""
    lines = ["usage: python -m torchtitan_ext.train --config FILE [--section.key value ...]", ""]
    for sec_field in dataclasses.fields(JobConfig):
        lines.append(f"[{sec_field.name}]")
        for f in dataclasses.fields(sec_field.default_factory()):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            meta = f.metadata
            rules = ["one of " + "|".join(map(str, meta["choices"]))] if meta.get("choices") else []
            rules += [f"{op} {meta[k]}" for k, op in (("min", ">="), ("max", "<=")) if meta.get(k) is not None]
            rule = f" ({', '.join(rules)})" if rules else ""
            value = "(unset)" if default is None else _toml_value(default)
            lines.append(f"  --{sec_field.name}.{f.name} = {value}  {meta['help']}{rule}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool | str):  # true / false, or a quoted string
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(map(_toml_value, v)) + "]"
    if isinstance(v, dict):  # e.g. the [[data.domains]] tables, as inline tables
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return repr(v)


def to_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML (every key that is set, overrides applied; an unset [model] key, None, is
    left out, as TOML has no null), loadable by ``load_toml``."""
    out = []
    for sec_field in dataclasses.fields(cfg):
        out.append(f"[{sec_field.name}]")
        sec = getattr(cfg, sec_field.name)
        for f in dataclasses.fields(sec):
            if getattr(sec, f.name) is not None:
                out.append(f"{f.name} = {_toml_value(getattr(sec, f.name))}")
        out.append("")
    return "\n".join(out)
