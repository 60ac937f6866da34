"""Reading values as the user wrote them: YAML files (a key written twice is refused),
``KEY=VALUE`` flags, and typed options dataclasses built from a mapping (a wrong type or an
unknown key is a ConfigError naming it)."""

from __future__ import annotations

import difflib
import os
from dataclasses import fields
from typing import Any, Dict, List, Optional, Type, get_type_hints

import yaml

from ..errors import ConfigError


def coerce_value(value: Any, typ: Any, where: str) -> Any:
    """Convert a YAML/CLI value to a dataclass field's type, with a clear error."""
    if value is None and typ in (bool, int, float, str):
        # YAML reads `out:` with nothing after it as null; str(None) would be a folder named 'None'
        raise ConfigError(f"{where} has no value (YAML reads an empty `key:` line as null); give it one, or "
                          f"remove the line to use the default")
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if typ in (int, float, str):
        if typ is int and isinstance(value, float) and not value.is_integer():
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        if typ is not str and isinstance(value, bool):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        try:
            return typ(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be of type {typ.__name__}, got {value!r}")
    return value


def build_options(cls: Optional[Type], values: Dict[str, Any], what: str) -> Any:
    """Instantiate an options dataclass from a dict, rejecting unknown keys."""
    if cls is None:
        if values:
            raise ConfigError(f"{what} takes no options, got {sorted(values)}")
        return None
    hints = get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - names, key=str)
    if unknown:
        near = difflib.get_close_matches(str(unknown[0]), names, n=1) if len(unknown) == 1 else []
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(f"{what} has no option(s) {unknown}{hint}; valid: {sorted(names)}")
    opts = cls(**{k: coerce_value(v, hints[k], f"{what} option {k!r}") for k, v in values.items()})
    if hasattr(opts, "validate"):
        opts.validate()
    return opts


def flag_for(name: str) -> str:
    return "--" + name.replace("_", "-")


def parse_key_values(items: List[str], what: str) -> Dict[str, Any]:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"{what} expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k.strip()] = yaml.load(v, Loader=UniqueKeyLoader)
        except DuplicateKeyError as e:
            raise ConfigError(f"{what} {item!r}: the value sets {e.key!r} twice; keep one")
        except yaml.YAMLError as e:
            problem = str(getattr(e, "problem", None) or e).splitlines()[0]
            raise ConfigError(f"{what} {item!r}: the value {v!r} is not valid YAML ({problem}); write a number, "
                              f"true/false, a list such as [4, 8], or a string in quotes: {k.strip()}=\"{v}\"")
    return out


class DuplicateKeyError(yaml.YAMLError):
    """A mapping that names one key twice (see :class:`UniqueKeyLoader`)."""

    def __init__(self, key: Any, first_line: int, line: int):
        super().__init__(f"key {key!r} appears twice (lines {first_line} and {line})")
        self.key, self.first_line, self.line = key, first_line, line


class UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping: PyYAML silently keeps the
    last one, so a setting edited further up a long file would be ignored without a word."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: Dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may be overridden key by key
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise DuplicateKeyError(key, seen[key], line)
                    seen[key] = line
                except TypeError:  # an unhashable key: SafeLoader's own error names it
                    continue
        return super().construct_mapping(node, deep)


def load_yaml(path: str, what: str = "config file") -> Dict[str, Any]:
    """A user's YAML file (launch config, sweep grid) as a mapping; every problem is a ConfigError."""
    if not os.path.isfile(path):
        raise ConfigError(f"{what} {path!r} does not exist; pass an existing YAML file "
                          f"(examples in launch/ and sweeps/)")
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {path!r} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                          f"{e.start}); save it as UTF-8 (editors that write UTF-16 or Latin-1 do this)")
    except OSError as e:
        raise ConfigError(f"{what} {path!r} cannot be read ({e.strerror}); check its permissions")
    try:
        data = yaml.load(text, Loader=UniqueKeyLoader) or {}
    except DuplicateKeyError as e:
        raise ConfigError(f"{what} {path!r} sets {e.key!r} twice (lines {e.first_line} and {e.line}); "
                          f"YAML would silently keep the last, so delete the one you do not mean")
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {path!r} is not valid YAML: {e}")
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path!r} must hold a mapping of settings, got {type(data).__name__}")
    return data


def option_names(cls: Optional[Type]) -> set:
    """The option names of an options dataclass (none for a method or dataset without options)."""
    return {f.name for f in fields(cls)} if cls is not None else set()
