"""YAML configs with ``key=value`` overrides, validated against dataclasses.

Every command loads its config the same way::

    cfg = load_config(SimViewConfig, "configs/sim/view.yaml", ["env.split=dt", "seed=3"])

Unknown keys, wrong types and malformed files raise :class:`ConfigError` with the dotted
key path and the file it came from, so a typo never silently falls back to a default. A key
that was renamed (:data:`RENAMED_KEYS`, e.g. ``out_dir`` → ``out``) still loads, with a warning
naming the new key.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
import warnings
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, TypeVar, Union, get_args, get_origin

import yaml

T = TypeVar("T")

RENAMED_KEYS = {"out_dir": "out"}
"""Old key → its one name across every command. A config class that has the new field accepts
the old key with a warning (both at once is an error); one that still has the old field accepts
the new key as well, so users write the one name everywhere."""


class ConfigError(ValueError):
    """A config file or override is malformed; the message names the key and the source."""


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping; errors name the file (and the line, for syntax errors)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of keys, got {type(data).__name__}")
    return data


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """Turn ``["a.b=3", "name=x"]`` into a nested dict; values are parsed as YAML scalars/lists."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. seed=3 or env.split=dt)")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r} conflicts with an earlier override of {part!r}")
            node = nxt
        node[parts[-1]] = value
    return out


def deep_merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Recursively merge ``update`` into a copy of ``base`` (mappings merge, the rest replaces)."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """Check ``value`` against the annotation ``tp``; returns the converted value."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key, source)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{source}: key '{key}' expects {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(f"{source}: key '{key}' must be one of {list(choices)}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{source}: key '{key}' must be a mapping, got {value!r}")
        return build(tp, value, source, prefix=f"{key}.")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{source}: key '{key}' expects a list, got {value!r}")
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{source}: key '{key}' expects {len(args)} items, got {len(value)}")
            return tuple(_coerce(v, a, f"{key}[{i}]", source) for i, (v, a) in enumerate(zip(value, args)))
        inner = args[0] if args else Any
        items = [_coerce(v, inner, f"{key}[{i}]", source) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{source}: key '{key}' expects a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: key '{key}' expects true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}: key '{key}' expects an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{source}: key '{key}' expects a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{source}: key '{key}' expects a string, got {value!r}")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{source}: key '{key}' expects {_type_name(tp)}, got {value!r}")
    return value


def _renamed_keys(data: Mapping[str, Any], fields: Mapping[str, Any], source: str, prefix: str) -> Mapping[str, Any]:
    """``data`` with renamed keys (:data:`RENAMED_KEYS`) under their new name, each one warned about."""
    out = None
    for old, new in RENAMED_KEYS.items():
        if new in data and new not in fields and old in fields and old not in data:
            out = dict(data if out is None else out)  # a class not yet moved to the new name takes it too
            out[old] = out.pop(new)
            continue
        if old not in data or old in fields or new not in fields:
            continue
        if new in data:
            raise ConfigError(f"{source}: both '{prefix}{old}' and '{prefix}{new}' are set; "
                              f"'{prefix}{old}' is the old name of '{prefix}{new}': keep only '{prefix}{new}'")
        warnings.warn(f"{source}: key '{prefix}{old}' is deprecated, use '{prefix}{new}'", FutureWarning, stacklevel=4)
        out = dict(data if out is None else out)
        out[new] = out.pop(old)
    return data if out is None else out


def build(cls: type[T], data: Mapping[str, Any], source: str = "<config>", prefix: str = "") -> T:
    """Instantiate dataclass ``cls`` from a mapping, rejecting unknown keys by their dotted path."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    data = _renamed_keys(data, fields, source, prefix)
    unknown = [k for k in data if k not in fields]
    if unknown:
        known = ", ".join(sorted(fields))
        raise ConfigError(f"{source}: unknown key '{prefix}{unknown[0]}' (known keys here: {known})")
    kwargs = {name: _coerce(value, hints[name], f"{prefix}{name}", source) for name, value in data.items()}
    missing = [
        name for name, f in fields.items()
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{source}: missing required key '{prefix}{missing[0]}'")
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: {prefix or 'config'}: {exc}") from None
    return obj


def current_key(cls: type, key: str) -> str:
    """The field name ``cls`` has for the setting ``key``: ``key`` itself, or its old name
    (:data:`RENAMED_KEYS`) where the class still uses that one."""
    names = {f.name for f in dataclasses.fields(cls)}
    if key not in names:
        for old, new in RENAMED_KEYS.items():
            if new == key and old in names:
                return old
    return key


def load_config(cls: type[T], path: str | Path | None = None, overrides: Iterable[str] = ()) -> T:
    """Load ``cls`` from an optional YAML file plus ``key=value`` overrides (overrides win)."""
    data: dict[str, Any] = load_yaml(path) if path is not None else {}
    overrides = list(overrides)
    source = str(path) if path is not None else "<defaults>"
    if overrides:
        data = deep_merge(data, parse_overrides(overrides))
        source = f"{source} + overrides"
    return build(cls, data, source)


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass ``cls`` (``name: type = default`` then a string),
    first sentence only, for help texts; fields without one map to ``""``."""
    import ast
    import inspect
    import textwrap

    docs = {f.name: "" for f in dataclasses.fields(cls)}
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return docs
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            text = " ".join(nxt.value.value.split())
            docs[node.target.id] = re.split(r"(?<!e\.g)(?<!i\.e)\.\s+(?=[A-Z(`])", text)[0].rstrip(".")
    return docs


def describe(cls: type, prefix: str = "", depth: int = 1) -> list[str]:
    """``key  type  default — doc`` lines for the fields of dataclass ``cls``, nested dataclasses
    expanded ``depth`` levels (``data.features.cameras``)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    lines = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        nested = tp if dataclasses.is_dataclass(tp) else None
        if nested is not None and depth > 0:
            lines += describe(nested, f"{prefix}{f.name}.", depth - 1)
            continue
        if nested is not None:
            doc = (nested.__doc__ or "").strip()
            doc = "" if doc.startswith(f"{nested.__name__}(") else " ".join(doc.split()).split(". ")[0].rstrip(".")
            keys = ", ".join(x.name for x in dataclasses.fields(nested))
            lines.append(f"{prefix}{f.name}.{{{keys}}}" + (f" — {doc}" if doc else ""))
            continue
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        else:
            default = repr(f.default_factory()) if f.default_factory is not dataclasses.MISSING else "required"
        doc = f" — {docs[f.name]}" if docs.get(f.name) else ""
        lines.append(f"{prefix}{f.name} = {default}{doc}")
    return lines


def to_dict(cfg: Any) -> dict[str, Any]:
    """A dataclass config as plain data (for YAML dumps inside checkpoints and reports)."""
    return dataclasses.asdict(cfg)
