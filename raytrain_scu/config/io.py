"""Config text in and out: YAML file + ``key=value`` overrides -> a raw tree, the tree -> YAML / flat params
(secrets redacted), and the ``--help`` text generated from the dataclass tree and its field comments."""
from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from raytrain_scu.config.schema import Config, leaf_type
from raytrain_scu.config.secrets import redact_uri, refuse_secret_key, secret_name
from raytrain_scu.errors import ConfigError


def parse_override(item: str) -> tuple[str, Any]:
    """Parse ``a.b=value`` into (key, typed value), typed by the field the key names."""
    if "=" not in item:
        raise ConfigError(f"override '{item}': expected key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    try:
        tp = leaf_type(key)
    except ConfigError:
        refuse_secret_key(key)  # an unknown key named like a secret: say where the secret goes instead
        raise
    if dataclasses.is_dataclass(tp):
        raise ConfigError(f"override '{key}': is a section, set one of its keys instead")
    return key, _parse_raw(key, raw, tp)


def _parse_raw(key: str, raw: str, tp):
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        if raw.strip().lower() in ("none", "null", "auto", "~"):
            return None
        tp = [a for a in typing.get_args(tp) if a is not type(None)][0]
        origin = typing.get_origin(tp)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        items = [s.strip() for s in raw.split(",") if s.strip()]
        return [_parse_raw(key, s, item_tp) for s in items]
    if origin is dict:
        value = yaml.safe_load(raw)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping (YAML flow style), got {raw!r}")
        return value
    if tp is str:
        return raw
    if tp is bool:
        low = raw.strip().lower()
        if low in ("true", "yes", "1", "on"):
            return True
        if low in ("false", "no", "0", "off"):
            return False
        raise ConfigError(f"{key}: expected a bool (true/false), got {raw!r}")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    return coerce(key, value, tp)


def type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def coerce(key: str, value: Any, tp) -> Any:
    """Check/convert one leaf value against its annotation; raise ConfigError naming `key`."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return coerce(key, value, inner[0])
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list of {type_name(item_tp)}, got {value!r}")
        return [coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected a bool (true/false), got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an int, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a float, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {tp}")


def get_dotted(cfg, key: str) -> Any:
    """The value at ``a.b.c`` in a Config (or any tree of attributes)."""
    return functools.reduce(getattr, key.split("."), cfg)


def default_run_name(path: Optional[str | Path]) -> str:
    """``run.name`` when the config leaves it empty: the config file's stem (``run`` without a file)."""
    return Path(path).stem if path is not None else "run"


def set_dotted(tree: dict, key: str, value: Any) -> None:
    """Set ``a.b.c`` in a nested dict, creating the levels on the way."""
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        nxt = node.get(p)
        if not isinstance(nxt, dict):
            nxt = {}
            node[p] = nxt
        node = nxt
    node[parts[-1]] = value


def explicit_keys(tree: dict, prefix: str = "") -> set[str]:
    """Dotted keys set explicitly in a raw YAML/override tree (presets never override these)."""
    out = set()
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and key != "tune.space" and dataclasses.is_dataclass(leaf_type(key)):
            out |= explicit_keys(v, key)
        else:
            out.add(key)
    return out


def load_raw(path: Optional[str | Path], overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """YAML file (optional) merged with dotted overrides, as a plain nested dict (not yet validated)."""
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
        if loaded is None:  # an empty file (or only comments) would silently train every default
            raise ConfigError(f"config file {p} is empty: it must be a YAML mapping of sections (model:, data:, ...); "
                              f"see python -m raytrain_scu.train --help for every key")
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p}: expected a mapping at the top level")
        tree = loaded
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(tree, key, value)
    return tree


def _numeric(v):
    """YAML 1.1 reads 1e-4 (no dot) as text: a search-space bound or value that parses as a number is one."""
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return v
    return v


def numeric_space(space: dict) -> dict:
    """``tune.space`` with the numbers inside each ``{kind: [args]}`` entry read as numbers (malformed entries are
    left for validation to name)."""
    out = {}
    for key, spec in space.items():
        if isinstance(spec, dict):
            spec = {kind: [_numeric(a) for a in args] if isinstance(args, list) else args
                    for kind, args in spec.items()}
        out[key] = spec
    return out


def _redact(tree: dict) -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out[k] = _redact(v) if k != "space" else v
        elif isinstance(v, str) and secret_name(k):
            out[k] = "***" if v else v
        elif isinstance(v, str) and "://" in v:
            out[k] = redact_uri(v)
        else:
            out[k] = v
    return out


def to_dict(cfg: Config, redact: bool = False) -> dict:
    tree = asdict(cfg)
    return _redact(tree) if redact else tree


def to_yaml(cfg: Config, redact: bool = False) -> str:
    return yaml.safe_dump(to_dict(cfg, redact=redact), sort_keys=False)


def flatten(cfg: Config, redact: bool = True) -> dict:
    """``{"section.key": value}`` of the whole tree (lists joined by commas), secrets redacted."""
    return flatten_tree(to_dict(cfg, redact=redact))


def flatten_tree(tree: dict) -> dict:
    """:func:`flatten` of a nested config dict (e.g. a saved config.yaml read back), keys as they are."""
    out = {}

    def walk(node: dict, prefix: str) -> None:
        for k, v in node.items():
            key = f"{prefix}.{k}" if prefix else k
            if isinstance(v, dict) and key != "tune.space":
                walk(v, key)
            elif isinstance(v, list):
                out[key] = ",".join(str(x) for x in v)
            else:
                out[key] = json.dumps(v) if isinstance(v, dict) else v

    walk(tree, "")
    return out


def _field_notes(cls) -> dict[str, str]:
    """Each field's comment in the class source: the one on its line, else the comment lines just above it."""
    import inspect
    import re

    notes, above = {}, []
    for line in inspect.getsource(cls).splitlines()[1:]:
        text = line.strip()
        if text.startswith("#"):
            above.append(text.lstrip("# ").strip())
            continue
        m = re.match(r"(\w+)\s*:[^#]*?(?:#\s*(.*))?$", text)
        if m and not text.startswith(("def ", "@", '"')):
            notes[m.group(1)] = m.group(2) or " ".join(above)
        above = []
    return notes


def describe() -> list[tuple[str, list[tuple[str, str, str]]]]:
    """Every config key with its default and description, section by section: ``[(section, [(key, default, note)])]``.
    Generated from the dataclass tree (defaults) and the comments beside its fields (descriptions)."""
    out, top = [], []
    default = Config()
    for f in fields(Config):
        value = getattr(default, f.name)
        if not dataclasses.is_dataclass(value):
            top.append((f.name, json.dumps(value), _field_notes(Config).get(f.name, "")))
            continue
        notes = _field_notes(type(value))
        out.append((f.name, [(f"{f.name}.{g.name}", json.dumps(getattr(value, g.name)), notes.get(g.name, ""))
                             for g in fields(value)]))
    return [("", top)] + out


def help_text() -> str:
    """The ``--help`` of the CLIs that take a config: every section and key, its default and what it means."""
    import re

    lines = ["Config keys, set in the YAML file or as key=value overrides (lists as a,b,c); default, then meaning:"]
    for section, rows in describe():
        lines.append(f"\n{section or 'top level'}:")
        for key, default, note in rows:
            first = re.split(r"\.\s+(?=[A-Z(])", note)[0].rstrip(".")  # its first sentence
            lines.append(f"  {key} = {default}".ljust(44) + f"  {first}")
    return "\n".join(lines)
