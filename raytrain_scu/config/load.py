"""The strict build: a raw tree (YAML + overrides) -> a typed, checked Config. ``resolve`` (presets, memory fit) is
the front door the CLIs use; this is the step beneath it, for trees that need no card (a worker's own copy)."""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any, Optional

from raytrain_scu.config.checks import validate
from raytrain_scu.config.io import coerce, default_run_name, load_raw, numeric_space
from raytrain_scu.config.schema import Config, check_not_removed
from raytrain_scu.config.secrets import refuse_secret_key
from raytrain_scu.errors import ConfigError


def _build(cls, data: Any, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    for k in data:
        if k not in names:
            where = f"{prefix}.{k}" if prefix else str(k)
            refuse_secret_key(where)
            check_not_removed(where)
            raise ConfigError(f"unknown config key '{where}' (known keys here: {', '.join(sorted(names))})")
    kwargs = {}
    for f in fields(cls):
        if f.name not in data:
            continue
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, data[f.name] if data[f.name] is not None else {}, key)
        else:
            kwargs[f.name] = coerce(key, data[f.name], tp)
    return cls(**kwargs)


def build_config(tree: dict, default_name: str = "run") -> Config:
    """Strictly build and validate a Config from a nested dict."""
    cfg = _build(Config, tree, "")
    cfg.tune.space = numeric_space(cfg.tune.space)
    if not cfg.run.name:
        cfg.run.name = default_name
    cfg.tracking.experiment = cfg.tracking.experiment or default_name  # one MLflow experiment per config file
    validate(cfg)
    return cfg


def load_config(path: Optional[str | Path] = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML config, apply dotted overrides, build strictly and validate (no preset, no memory fit: that is
    :func:`raytrain_scu.driver.resolve.resolve`)."""
    return build_config(load_raw(path, overrides), default_name=default_run_name(path))
