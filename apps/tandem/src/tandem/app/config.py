"""Loading configs: a msgspec Struct from TOML, with dotted command-line overrides.

Configs are plain data (no torch import), so a bad key or value fails at start with the
offending key's name, long before any model is built. `dump_config` prints every setting,
the ones whose value is unset (None, which TOML cannot write) as comments.
"""

from __future__ import annotations

import copy
import re
import tomllib
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import tomli_w

from tandem.app.errors import ConfigError

T = TypeVar("T", bound=msgspec.Struct)


class LoggingConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How the app logs: `format = "auto"` renders for humans on a TTY, JSON lines otherwise."""

    level: str = "info"
    format: str = "auto"

    def __post_init__(self) -> None:
        if self.level.lower() not in {"debug", "info", "warning", "error", "critical"}:
            raise ValueError(
                f"level must be one of debug/info/warning/error/critical, not {self.level!r}"
            )
        if self.format not in {"auto", "console", "json"}:
            raise ValueError(f"format must be one of auto/console/json, not {self.format!r}")


def parse_override(item: str) -> tuple[list[str], Any]:
    """Parse one ``a.b.c=value`` override; the value is read as a TOML value, else as a string.

    ``--set trainer.lr=1e-6`` gives a float, ``--set run.name=x`` a string,
    ``--set a.ids=[1,2]`` a list.
    """
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {item!r} must look like key.path=value")
    parts = key.split(".")
    if any(not p for p in parts):
        raise ConfigError(f"override {item!r} has an empty key segment")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each dotted override set (creating tables as needed)."""
    out = copy.deepcopy(data)
    for item in overrides:
        parts, value = parse_override(item)
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                prefix = ".".join(parts[: i + 1])
                raise ConfigError(f"override {item!r}: {prefix} is a value, not a table")
            node = child
        node[parts[-1]] = value
    return out


def read_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file, turning missing files and syntax errors into `ConfigError`."""
    p = Path(path)
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {p} cannot be read: {e}") from None


BASE_KEY = "base"
"""A config file's top-level key naming the config it changes (a path relative to the file)."""


def merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``top``'s values set over it: tables merge key by key, any other value
    (lists included) replaces the base's."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


MODEL_RUN_KEYS = ("path", "kv_split_size")
"""``[model]`` keys that say how a model is run, not what shape it has."""


def _sets_model_path(data: dict[str, Any]) -> bool:
    model = data.get("model")
    return isinstance(model, dict) and bool(model.get("path"))


def without_shapes(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without its ``[model]`` shapes (the run keys stay).

    Shapes describe a model built from scratch. A layer of config (a file over its ``base``,
    ``--set`` over a file) that points ``model.path`` at a checkpoint takes them from the
    checkpoint's config.json instead, so the shapes of the layers below are dropped, not
    compared: the demo's tiny model does not stand in the way of ``--set model.path=...``.
    Shapes set in the same layer as the path are kept and checked against the checkpoint."""
    model = data.get("model")
    if not isinstance(model, dict):
        return data
    kept = {k: v for k, v in model.items() if k in MODEL_RUN_KEYS}
    return {**data, "model": kept}


def read_config_file(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A TOML config with its ``base`` resolved: a file that names a base lists only what it
    changes, so a variant of a run (a quick check, a bigger model) cannot drift from it."""
    p = Path(path)
    data = read_toml(p)
    base = data.pop(BASE_KEY, None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"config file {p}: {BASE_KEY} must be a file name, not {base!r}")
    base_path = p.parent / base
    if base_path.resolve() in (*_seen, p.resolve()):
        raise ConfigError(f"config file {p}: {BASE_KEY} = {base!r} leads back to itself")
    below = read_config_file(base_path, (*_seen, p.resolve()))
    return merge(without_shapes(below) if _sets_model_path(data) else below, data)


def _describe(err: msgspec.ValidationError) -> str:
    """Turn msgspec's ``... - at `$.a.b` `` into ``a.b: ...`` so the key comes first."""
    head, sep, path = str(err).rpartition(" - at `")
    if not sep:
        head, path = str(err), ""
    key = path.rstrip("`").removeprefix("$").lstrip(".")
    unknown = re.fullmatch(r"Object contains unknown field `(.+)`", head)
    if unknown:
        full = f"{key}.{unknown.group(1)}" if key else unknown.group(1)
        return f"unknown key `{full}` (check its spelling and section)"
    return f"{key}: {head}" if key else head


def build_config(cls: type[T], data: dict[str, Any], source: str = "config") -> T:
    """Validate a plain dict into ``cls``; unknown keys and wrong types raise `ConfigError`."""
    try:
        return msgspec.convert(data, cls, strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(f"invalid {source}: {_describe(e)}") from None


def load_config(
    cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None
) -> T:
    """Load ``cls`` from an optional TOML file (on top of its ``base``, if it names one) plus
    dotted overrides (later wins)."""
    data = read_config_file(path) if path is not None else {}
    if _sets_model_path(apply_overrides({}, overrides or [])):
        data = without_shapes(data)
    data = apply_overrides(data, overrides or [])
    return build_config(cls, data, source=str(path) if path is not None else "config")


UNSET = "@@unset@@"


def _mark_unset(value: Any) -> Any:
    if value is None:
        return UNSET
    if isinstance(value, dict):
        return {k: _mark_unset(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_mark_unset(v) for v in value]
    return value


def dump_config(config: msgspec.Struct) -> str:
    """Render a resolved config back to TOML (what `--dump-config` prints); a setting that
    is unset appears as ``# key = (unset)``, so every setting is shown and the output loads
    back to the same config."""
    text = tomli_w.dumps(_mark_unset(msgspec.to_builtins(config)))
    return re.sub(rf'^(\s*)([^\s=]+) = "{UNSET}"$', r"\1# \2 = (unset)", text, flags=re.MULTILINE)
