"""The one typed config loader: frozen dataclasses from YAML, then nested values, then dotted ``key=value``
overrides; values are coerced to the field types, unknown keys are refused by their dotted name (with the closest
known key), and the dataclasses validate themselves in ``__post_init__``. Every run config of the project
(pre-training, fine-tuning, shard builds) loads through `load_dataclass`; `keys_help` and `add_field_flags`
derive ``--help`` text and CLI flags from the same field docstrings."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import math
import re
import textwrap
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml


def _has_type(option: Any, value: Any) -> bool:
    if option is type(None):
        return value is None
    if option is bool:
        return isinstance(value, bool)
    if option is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if option is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if option is str:
        return isinstance(value, str)
    if typing.get_origin(option) is tuple:
        return isinstance(value, (tuple, list)) and all(_has_type(float, v) for v in value)
    if typing.get_origin(option) is dict:
        return isinstance(value, dict)
    return True


def check_field_types(instance: Any, prefix: str = "") -> None:
    """Every field of dataclass ``instance`` holds a value of its annotated type (a bool is not a number, an int
    serves where a float is expected) and every number is finite; the error names the key. Config
    ``__post_init__`` methods call this before their range checks, so a config built from any source (YAML,
    CLI flags, code) is checked before anything is built from it."""
    hints = typing.get_type_hints(type(instance))
    for f in dataclasses.fields(instance):
        hint, value = hints[f.name], getattr(instance, f.name)
        if dataclasses.is_dataclass(hint):
            continue
        options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        if not any(_has_type(option, value) for option in options):
            raise ValueError(f"{prefix}{f.name}={value!r} is not a valid {_type_name(hint)}")
        numbers = value if isinstance(value, (tuple, list)) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in numbers):
            raise ValueError(f"{prefix}{f.name}={value!r}: must be a finite number")


def _coerce(hint: Any, value: Any, name: str) -> Any:
    """Check a YAML value against the field type; numbers written as strings (YAML reads ``2e-3`` as a string)
    become numbers."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if value is None and type(None) in options:
        return None
    for option in options:
        try:
            if option is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
                return float(value)
            if option is int and isinstance(value, (int, str)) and not isinstance(value, bool) \
                    and str(value).lstrip("-").isdigit():
                return int(value)
            if option is bool and isinstance(value, bool):
                return value
            if option is str and isinstance(value, str):
                return value
            if typing.get_origin(option) is tuple and isinstance(value, (list, tuple)):
                return tuple(float(v) for v in value)
            if typing.get_origin(option) is dict and isinstance(value, dict):
                return value
        except ValueError:
            continue
    raise ValueError(f"{name}={value!r} is not a valid {_type_name(hint)}")


def _type_name(hint: Any) -> str:
    """``int``, ``float | None``, ``tuple[float, float]``: a field type as it is written."""
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def _build(cls: type, values: dict[str, Any], prefix: str, replaced: Mapping[str, str]) -> Any:
    """Build dataclass ``cls`` from a nested dict, refusing unknown keys by their dotted name, coercing values to
    the field types (a ``dict`` field with a ``schema`` dataclass in its metadata to that one's field types)."""
    if not isinstance(values, dict):
        raise ValueError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"unknown config key(s): {', '.join(_suggest(prefix, k, fields, replaced) for k in unknown)}")
    required = [name for name, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [name for name in required if name not in values and not dataclasses.is_dataclass(hints[name])]
    if missing:
        raise ValueError(f"missing required config key(s): {', '.join(prefix + m for m in missing)}")
    # an absent section is an empty one: its own checks name the keys it needs (data.shards)
    values = {**{name: {} for name in required if dataclasses.is_dataclass(hints[name])}, **values}
    kwargs = {}
    for name, value in values.items():
        hint = hints[name]
        schema = fields[name].metadata.get("schema")
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            value = _build(hint, value or {}, f"{prefix}{name}.", replaced)
        elif schema is not None and isinstance(value, dict):
            value = _coerce_to_schema(schema, value, f"{prefix}{name}.", replaced)
        else:
            value = _coerce(hint, value, prefix + name)
        kwargs[name] = value
    return cls(**kwargs)


def _suggest(prefix: str, key: str, known: Iterable[str], replaced: Mapping[str, str]) -> str:
    """``prefix + key``, with what replaced it (``replaced``: dotted key -> its successor, in words) or the closest
    known key when one is close (a typo)."""
    if prefix + key in replaced:
        return f"{prefix + key} (replaced by {replaced[prefix + key]})"
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.75)
    return prefix + key + (f" (did you mean {prefix + close[0]}?)" if close else "")


def _coerce_to_schema(schema: type, values: dict[str, Any], prefix: str,
                      replaced: Mapping[str, str]) -> dict[str, Any]:
    """A partial set of ``schema``'s fields (e.g. ``model.overrides``), each coerced to its field type."""
    hints = typing.get_type_hints(schema)
    unknown = sorted(set(values) - set(hints))
    if unknown:
        raise ValueError(f"unknown config key(s): {', '.join(_suggest(prefix, k, hints, replaced) for k in unknown)} "
                         f"({schema.__name__} has {', '.join(f.name for f in dataclasses.fields(schema))})")
    return {name: _coerce(hints[name], value, prefix + name) for name, value in values.items()}


def apply_overrides(values: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of nested ``values`` with ``a.b.c=value`` overrides applied (values parsed as YAML)."""
    result = yaml.safe_load(yaml.safe_dump(values)) or {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} is not of the form key=value")
        node = result
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {part} is not a section")
        try:
            node[leaf] = yaml.safe_load(raw)
        except yaml.YAMLError as error:
            raise ValueError(f"override {item!r}: not valid YAML: {_yaml_problem(error)}") from None
    return result


def _yaml_problem(error: yaml.YAMLError) -> str:
    """What yaml found wrong, in one line: ``expected ',' or ']', but got '<stream end>' (while parsing a flow
    sequence)``."""
    problem, context = getattr(error, "problem", None), getattr(error, "context", None)
    if not problem:
        return " ".join(str(error).split())
    return f"{problem} ({context})" if context else problem


T = typing.TypeVar("T")


def _names_a_file(path: str | Path) -> bool:
    """Whether ``path`` is something a config can be read from: a file, or a pipe (``<(...)``), not a directory."""
    return Path(path).exists() and not Path(path).is_dir()


def config_error(path: str | Path, error: BaseException, overrides: Sequence[str] = ()) -> str:
    """One line for ``error`` from loading the config at ``path`` (with ``overrides``), naming the file once: a
    YAML error names it already, with the line; other messages (a missing file, a bad key or value) leave it out,
    and what may come from an override says so (not a missing file: ``error`` may have crossed ranks as a string,
    so this looks at the path, not the error's class)."""
    message = str(error)
    if message.startswith(f"{path}:"):
        return message
    from_overrides = overrides and _names_a_file(path)
    return f"{path}{' + overrides' if from_overrides else ''}: {message}"


def load_dataclass(cls: type[T], path: str | Path | None, overrides: Sequence[str] = (),
                   values: dict[str, Any] | None = None, replaced_keys: Mapping[str, str] | None = None) -> T:
    """The config ``cls`` from a YAML file (``path``, optional), then ``values`` (nested keys), then dotted
    ``key=value`` overrides; values are coerced to the field types and the dataclasses validate themselves.
    ``replaced_keys`` (dotted key -> what replaced it) turns a key of an earlier schema into a pointer to its
    successor."""
    if path and not _names_a_file(path):  # the callers name the path
        what = "a directory, not a config file" if Path(path).is_dir() else "no such config file"
        others = sorted(Path(path).parent.glob("*.yaml")) if Path(path).parent.is_dir() else []
        listed = f" ({Path(path).parent} has {', '.join(other.name for other in others)})" if others else ""
        raise FileNotFoundError(what + listed)
    try:
        loaded = (yaml.safe_load(Path(path).read_text()) or {}) if path else {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ValueError(f"{where}: not valid YAML: {_yaml_problem(error)}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: expected a mapping of config keys")
    loaded.update(values or {})
    return _build(cls, apply_overrides(loaded, list(overrides)), "", replaced_keys or {})


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of dataclass ``cls`` (the string literal after the field)."""
    definition = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(definition, ast.ClassDef), cls
    body = definition.body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(inspect.cleandoc(following.value.value).split())
    return docs


def reference_rows(cls: type, prefix: str, required: str = "required") -> list[str]:
    """One Markdown table row per key of dataclass ``cls``: `` | `prefix.key` | `type` | default | docstring | ``."""
    docs = field_docs(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(typing.get_type_hints(cls)[f.name]):
            continue  # a section: documented by its own table
        if f.default is not dataclasses.MISSING:
            default = f"`{f.default!r}`" if f.default not in (None, "") else ("`null`" if f.default is None else "`''`")
        elif f.default_factory is not dataclasses.MISSING:
            default = f"`{f.default_factory()!r}`"
        else:
            default = required
        doc = docs.get(f.name)
        if doc is None:
            raise ValueError(f"{cls.__name__}.{f.name} has no docstring: every config key is documented")
        doc = doc.replace("``", "`").replace("|", "\\|")
        kind = str(f.type).replace("|", "\\|")
        rows.append(f"| `{prefix}{f.name}` | `{kind}` | {default} | {doc} |")
    return rows


def keys_help(cls: type, prefix: str = "") -> str:
    """One line per key of config dataclass ``cls`` (sections flattened to dotted keys): name, type, default and
    the first sentence of its docstring; the epilog of an entry point's ``--help``."""
    docs, hints, lines = field_docs(cls), typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            lines.append(keys_help(hints[f.name], f"{prefix}{f.name}."))
            continue
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = repr(f.default_factory())
        else:
            default = "required"
        first = _first_sentence(" ".join(docs.get(f.name, "").replace("``", "`").split()))
        lines.append(f"  {prefix}{f.name} ({str(f.type).replace(' ', '')}, {default}): {first}")
    return "\n".join(lines)


def _first_sentence(doc: str) -> str:
    # sentences end at ". " before a capital (not after "e.g."); what null means is kept with the first
    sentences = re.split(r"(?<!e\.g\.)(?<!i\.e\.)(?<=\.)\s+(?=[A-Z`(])", doc)
    return " ".join([sentences[0]] + [s for s in sentences[1:] if s.startswith(("Null:", "None:"))])


def _flag_type(hint: Any) -> Any:
    """What argparse converts a flag's text with: the field type's non-None member."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    kinds = [option for option in options if option is not type(None)]
    return kinds[0] if len(kinds) == 1 and kinds[0] in (int, float, str, bool) else str


def add_field_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
                    names: Iterable[str], help_overrides: Mapping[str, str] | None = None) -> None:
    """Add one ``--kebab-name`` flag per field ``names`` of config dataclass ``cls``, typed by the field and
    helped by its docstring's first sentence (``help_overrides``: another text for some). Every flag defaults to
    None (not given), so `given_fields` passes on only what the user set and the YAML's values stay otherwise;
    a bool field becomes a switch that sets it true."""
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in names:
        if name not in fields:
            raise ValueError(f"{cls.__name__} has no field {name!r} to make a flag of")
        doc = " ".join(docs.get(name, "").replace("``", "`").split())
        text = (help_overrides or {}).get(name) or _first_sentence(doc)
        text = text.replace("%", "%%")
        kind = _flag_type(hints[name])
        if kind is bool:
            parser.add_argument("--" + name.replace("_", "-"), dest=name, action="store_true", default=None, help=text)
        else:
            parser.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None,
                                metavar=name.upper(), help=text)


def given_fields(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of ``cls`` that ``args`` (parsed with `add_field_flags`) set: name -> value, None left out."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {name: value for name, value in vars(args).items() if name in names and value is not None}
