"""Helpers for loading YAML configuration: ``${ENV}`` substitution, typed values, errors naming the key.

Both ``refresh.config`` and ``enrich.config`` build frozen dataclasses with these helpers so a bad
value is reported as e.g. ``conf/refresh.yaml: datasets.devices.schedule.every: '6x' is not a duration``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, get_args

import yaml

from refstream.errors import ConfigError

__all__ = [
    "OFF_WORDS",
    "Section",
    "allowed_values",
    "duration_arg",
    "format_duration",
    "is_off",
    "kafka_settings",
    "load_config_data",
    "load_yaml",
    "parse_duration",
    "redact_url",
    "substitute_env",
    "substitute_env_values",
]

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


def substitute_env(text: str, source: str, line: int | None = None) -> str:
    """Replace ``${VAR}`` and ``${VAR:-default}`` in one value; an unset variable without default is an
    error naming ``source`` and, when given, the line the value sits on."""

    def repl(m: re.Match[str]) -> str:
        name, default = m.group(1), m.group(2)
        value = os.environ.get(name)
        if value is None or (value == "" and default is not None):
            if default is None:
                where = f"{source}:{line}" if line is not None else source
                raise ConfigError(f"{where}: environment variable {name} is not set")
            return default
        return value

    return _ENV.sub(repl, text)


def _substitute_nodes(node: yaml.Node, source: str) -> None:
    """Substitute environment variables into the string scalars of a composed YAML tree.

    Substitution happens after parsing, so a value (a password with ``#``, ``: ``, a newline or a
    leading zero) comes through exactly as set and can never add keys or change the document's shape.
    """
    if isinstance(node, yaml.ScalarNode):
        if node.tag == "tag:yaml.org,2002:str" and "${" in node.value:
            node.value = substitute_env(node.value, source, node.start_mark.line + 1)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _substitute_nodes(item, source)
    elif isinstance(node, yaml.MappingNode):
        for _key, value in node.value:
            _substitute_nodes(value, source)


def load_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML mapping from ``path`` with environment variables substituted into its values."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {p} not found") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {p}: {exc}") from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            data: Any = {}
        else:
            _substitute_nodes(node, str(p))
            data = loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: invalid YAML: {exc}") from None
    finally:
        loader.dispose()
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping, got {type(data).__name__}")
    return data


def substitute_env_values(data: Any, source: str, path: str = "") -> Any:
    """A copy of ``data`` (a config read some other way than from YAML: nested mappings and lists)
    with environment variables substituted into its string values, as :func:`load_yaml` does for a
    file; keys are left alone. An unset variable without default is an error naming the key path."""
    if isinstance(data, str):
        if "${" not in data:
            return data
        return substitute_env(data, f"{source}: {path or '<top>'}")
    if isinstance(data, Mapping):
        return {k: substitute_env_values(v, source, f"{path}.{k}" if path else str(k)) for k, v in data.items()}
    if isinstance(data, list):
        return [substitute_env_values(v, source, f"{path}[{i}]") for i, v in enumerate(data)]
    return data


def load_config_data(config: str | os.PathLike[str] | Mapping[str, Any],
                     source: str | None = None) -> tuple[dict[str, Any], str]:
    """The data of a config and the name its errors use: a YAML file read by :func:`load_yaml` (named
    by its path; ``source`` is for mappings only), or a mapping given from Python (named ``source``,
    default ``"config"``), its values put through the same ``${VAR}`` substitution. Either then goes
    through the same checks, so the same content fails with the same message."""
    if isinstance(config, str | os.PathLike):
        return load_yaml(config), str(Path(config))
    name = source if source is not None else "config"
    if not isinstance(config, Mapping):
        raise ConfigError(f"{name}: top level must be a mapping or a file path, got {type(config).__name__}")
    data: dict[str, Any] = substitute_env_values(config, name)
    return data, name


_SECRET_PARAM = re.compile(r"(?i)([?&;](?:[^=&;#]*(?:password|passwd|pwd|secret|token)[^=&;#]*)=)[^&;#]*")


def redact_url(url: str) -> str:
    """A URL safe to log, show or put in an error: the password of ``user:password@`` and the values
    of query parameters named like a secret (``?password=``, ``&ssl_key_password=``...) become ``***``."""
    try:
        from sqlalchemy.engine import make_url

        shown = make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a SQLAlchemy URL: drop anything before the host
        shown = url.split("@")[-1]
    return _SECRET_PARAM.sub(r"\1***", shown)


class Section:
    """A mapping read from YAML that remembers where it sits, so every error names the key path.

    ``Section(data, "datasets.devices", source="conf/refresh.yaml")``; ``sec.get("topic", str, None)``;
    ``sec.choice("mode", Mode, "diff")`` with ``Mode = Literal["diff", "incremental"]``;
    ``sec.section("schedule")``; ``sec.done()`` rejects keys nobody read (typos).
    """

    def __init__(self, data: Any, path: str = "", source: str = "config") -> None:
        if data is None:
            data = {}
        self.path, self.source = path, source
        if not isinstance(data, Mapping):
            raise self.error(f"must be a mapping, got {type(data).__name__}")
        self.data: Mapping[str, Any] = data
        self._seen: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def error(self, msg: str, name: str | None = None) -> ConfigError:
        where = self.key(name) if name is not None else (self.path or "<top>")
        return ConfigError(f"{self.source}: {where}: {msg}")

    def has(self, name: str) -> bool:
        return name in self.data

    def raw(self, name: str, default: Any = ...) -> Any:
        self._seen.add(name)
        if name not in self.data or self.data[name] is None:
            if default is ...:
                raise self.error("is required", name)
            return default
        return self.data[name]

    def get(self, name: str, typ: type | tuple[type, ...], default: Any = ...) -> Any:
        value = self.raw(name, default)
        if value is default and default is not ...:
            return value
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if typ in (int, float) and isinstance(value, str):
            # Environment variables are substituted as strings (``port: ${PORT}``); a number-typed key
            # takes the number they spell.
            try:
                return typ(value.strip())
            except ValueError:
                pass
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            names = typ.__name__ if isinstance(typ, type) else " or ".join(t.__name__ for t in typ)
            raise self.error(f"expected {names}, got {value!r}", name)
        return value

    def choice(self, name: str, choices: Any, default: Any = ...) -> Any:
        """A string among ``choices``: a ``Literal[...]`` type (the vocabulary is declared once, as the
        type the config field has) or a tuple of strings. An absent key gives ``default``."""
        allowed = allowed_values(choices)
        value = self.get(name, str, default)
        if value is default and default is not ...:
            return value
        if value not in allowed:
            raise self.error(f"{value!r} is not one of {', '.join(allowed)}", name)
        return value

    def duration(self, name: str, default: Any = ...) -> timedelta:
        value = self.raw(name, default)
        if isinstance(value, timedelta) or (value is default and default is not ...):
            return value
        try:
            return parse_duration(value)
        except ValueError as exc:
            raise self.error(str(exc), name) from None

    def optional_duration(self, name: str, default: timedelta | None) -> timedelta | None:
        """A duration that ``off`` (also ``none``, ``never``, YAML's bare ``off``: false) or ``0``
        turns off: None."""
        if is_off(self.raw(name, default)):
            return None
        out = self.duration(name, default)
        return None if out is not None and out.total_seconds() == 0 else out

    def str_list(self, name: str, default: Any = ...) -> list[str]:
        value = self.raw(name, default)
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise self.error(f"expected a list of names, got {value!r}", name)
        return list(value)

    def choice_lists(self, what: str, allowed: Sequence[str]) -> list[tuple[str, tuple[str, ...]]]:
        """Every key of this section as a column with a list of ``allowed`` names (a single name for
        a one-item list): ``{temperature: [mean, max]}`` -> ``[("temperature", ("mean", "max"))]``,
        in file order; errors name the column and call each name a ``what`` (``aggregate``)."""
        out = []
        for column in list(self.data):
            raw = self.raw(column)
            names = [raw] if isinstance(raw, str) else raw
            if not isinstance(column, str) or not column:
                raise self.error(f"expected a column name, got {column!r}")
            if not isinstance(names, list) or not names:
                raise self.error(f"expected a list of {what}s ({', '.join(allowed)}), got {raw!r}", column)
            for name in names:
                if name not in allowed:
                    raise self.error(f"{name!r} is not one of {', '.join(allowed)}", column)
            if len(set(names)) != len(names):
                article = "an" if what[:1] in "aeiou" else "a"
                raise self.error(f"{article} {what} is listed twice: {names}", column)
            out.append((column, tuple(names)))
        return out

    def topic(self, name: str = "kafka") -> str:
        """An output's ``{name}: {topic: ...}`` subsection: the topic, which must not be empty."""
        sub = self.section(name)
        topic = sub.get("topic", str)
        if not topic:
            raise sub.error("must name a topic", "topic")
        sub.done()
        return str(topic)

    def section(self, name: str, default: Any = ...) -> Section:
        return Section(self.raw(name, {} if default is ... else default), self.key(name), self.source)

    def done(self) -> None:
        extra = sorted(set(self.data) - self._seen)
        if extra:
            raise self.error(f"unknown key(s): {', '.join(map(str, extra))}")


#: The words that turn an optional setting off (YAML 1.1 reads a bare ``off`` as false).
OFF_WORDS = ("off", "none", "never")


def is_off(value: Any) -> bool:
    """Whether a config value turns its setting off: false, or one of :data:`OFF_WORDS`."""
    return value is False or (isinstance(value, str) and value.strip().lower() in OFF_WORDS)


def allowed_values(choices: Any) -> tuple[str, ...]:
    """The strings of a ``Literal[...]`` type (or of a tuple, returned as is)."""
    return get_args(choices) or tuple(choices)


def parse_duration(value: Any) -> timedelta:
    """``"30s"``, ``"6h"``, ``"1.5m"``, ``"250ms"``, ``"2d"`` or a number of seconds -> timedelta."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration")
    try:
        if isinstance(value, int | float):
            if value < 0:
                raise ValueError(f"{value!r} is negative")
            return timedelta(seconds=value)
        if isinstance(value, str):
            m = _DURATION.match(value)
            if m:
                return timedelta(seconds=float(m.group(1)) * _UNITS[m.group(2)])
    except OverflowError:  # inf, 1e300 s: longer than any duration Python holds
        raise ValueError(f"{value!r} is too long a duration") from None
    raise ValueError(f"{value!r} is not a duration (use e.g. 250ms, 30s, 5m, 6h, 1d)")


def format_duration(value: timedelta) -> str:
    """A duration as the config writes it: ``1d``, ``6h``, ``30s``, ``250ms`` (the largest whole unit)."""
    ms = round(value.total_seconds() * 1000)
    for unit in ("d", "h", "m", "s"):
        size = round(_UNITS[unit] * 1000)
        if ms and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def duration_arg(text: str) -> timedelta:
    """:func:`parse_duration` as an ``argparse`` ``type=``: a bad value is a usage error naming it."""
    import argparse

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def kafka_settings(sec: Section) -> dict[str, str]:
    """The ``kafka:`` section as librdkafka settings: ``bootstrap_servers`` -> ``bootstrap.servers``,
    everything else passed through (``security.protocol``, ``sasl.*``...)."""
    out: dict[str, str] = {}
    for name in list(sec.data):
        value = sec.raw(name)
        if isinstance(value, Mapping | list):
            raise sec.error("expected a scalar librdkafka setting", name)
        key = "bootstrap.servers" if name in ("bootstrap_servers", "bootstrap.servers") else str(name)
        out[key] = str(value).lower() if isinstance(value, bool) else str(value)
    if "bootstrap.servers" not in out:
        raise sec.error("is required", "bootstrap_servers")
    return out
