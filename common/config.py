"""Typed configuration: dataclasses grouped by concern become grouped command-line flags and YAML/JSON files.

A config is a dataclass whose fields are *groups*; a group is a dataclass whose fields are *settings*, each
declared with `option(default, help, ...)`. Every setting is a flag of the same name (`--batch_size`), so
names are unique across groups, and `--help` lists them group by group. Values come, lowest first, from the
dataclass defaults, the entry point's own defaults (e.g. SFT's smaller learning rate), `--config FILE`, and
the command line:

    python train_pretrain.py --config recipes/minimind-26m-pretrain.yaml --batch_size 8

A config file is YAML (or JSON), nested by group or flat; `to_dict()` writes the nested form, so a run's
`train_config.json` is itself a valid `--config`. Its "resolved" section (what the run derived: device,
step counts, the model) is informational and ignored on reading.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import operator
import types
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Protocol, Sequence, TypeVar

from .errors import ConfigError

RESOLVED_KEY = "resolved"
C = TypeVar("C")


class Scope(Protocol):
    """What an entry point is, as far as its settings go: a name for messages, and the features it has. A
    setting declared with `feature="x"` exists only in entry points whose features include "x" (a training
    stage is a Scope: trainer_utils/stages)."""

    name: str
    features: frozenset[str]


def option(default: Any, help: str, *, choices: Sequence[Any] | None = None, at_least: float | None = None,
           above: float | None = None, below: float | None = None, at_most: float | None = None,
           feature: str | tuple[str, ...] | None = None,
           persist: bool = True, hidden: bool = False, aliases: tuple[str, ...] = (),
           metavar: str | None = None, several: bool = False, positional: bool = False) -> Any:
    """A setting: its default, its help line and its checks.

    at_least / above / below / at_most: numeric bounds checked after parsing (None values pass).
    feature: the setting exists only for entry points (Scopes) with this feature (e.g. "adapters"), or with one of
    several (a tuple: e.g. --beta, DPO's and GRPO's); others reject it.
    persist=False: an action of one invocation (--resume), left out of the written config.
    several=True (list settings): one flag takes several values (--data_path a b); otherwise it repeats
    (--prompt a --prompt b).
    aliases: more names of the flag; for a bool setting, an alias like --no_near_dedup (no_ and the setting's name)
    turns it off, beside argparse's --no-near_dedup (a flag's name from before the setting had parse_config's).
    positional=True (a list setting, one per command): its values are the command's arguments that are not
    flags (`python -m dataset.ingest docs/ papers/ --out x.jsonl`), not a flag.
    """
    features = (feature,) if isinstance(feature, str) else feature
    meta = dict(help=help, choices=choices, at_least=at_least, above=above, below=below, at_most=at_most,
                features=features, persist=persist, hidden=hidden, aliases=aliases, metavar=metavar, several=several,
                positional=positional)
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass
class Setting:
    """One setting as the parser sees it: its group, field and resolved type."""

    group: str
    field: dataclasses.Field
    base: type  # int | float | str | bool
    optional: bool
    is_list: bool
    choices: tuple[Any, ...] | None

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def meta(self) -> Any:
        return self.field.metadata

    def applies_to(self, scope: Scope | None) -> bool:
        features = self.meta["features"]
        return scope is None or features is None or not scope.features.isdisjoint(features)

    def coerce(self, value: Any, where: str) -> Any:
        """`value` (from a file) as this setting's type, or ConfigError naming where it came from."""
        if value is None:
            if self.optional:
                return None
            raise ConfigError(f"{where}: {self.name} cannot be null")
        if self.is_list:
            items = value if isinstance(value, list) else [value]
            return [self._scalar(v, where) for v in items]
        return self._scalar(value, where)

    def _scalar(self, value: Any, where: str) -> Any:
        base = self.base
        ok = False
        if base is bool:
            ok = isinstance(value, bool)
        elif base is int:
            if isinstance(value, str):
                try:
                    value = int(value)
                except ValueError:
                    pass
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif base is float:
            if isinstance(value, str):  # YAML reads 3e-4 (no dot) as a string
                try:
                    value = float(value)
                except ValueError:
                    pass
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            value = float(value) if ok else value
        elif base is str:
            ok = isinstance(value, str)
        if not ok:
            raise ConfigError(f"{where}: {self.name} must be {base.__name__}, got {value!r}")
        if self.choices is not None and value not in self.choices:
            raise ConfigError(f"{where}: {self.name} must be one of {list(self.choices)}, got {value!r}")
        return value


def _resolve(annotation: Any) -> tuple[type, bool, bool, tuple[Any, ...] | None]:
    """(base type, optional, is_list, Literal choices) of an annotation such as `int | None`."""
    optional = False
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        annotation = args[0]
        origin = typing.get_origin(annotation)
    if origin is list:
        base, _, _, choices = _resolve(typing.get_args(annotation)[0])
        return base, optional, True, choices
    if origin is Literal:
        choices = typing.get_args(annotation)
        return type(choices[0]), optional, False, choices
    return annotation, optional, False, None


def settings(config_cls: type) -> dict[str, Setting]:
    """Every setting of a config class by name (names are unique across groups)."""
    out: dict[str, Setting] = {}
    for group in dataclasses.fields(config_cls):
        group_cls = typing.get_type_hints(config_cls)[group.name]
        hints = typing.get_type_hints(group_cls, include_extras=False)
        for f in dataclasses.fields(group_cls):
            base, optional, is_list, choices = _resolve(hints[f.name])
            choices = tuple(f.metadata["choices"]) if f.metadata.get("choices") else choices
            if f.name in out:
                raise TypeError(f"setting {f.name} is declared in groups {out[f.name].group} and {group.name}")
            out[f.name] = Setting(group.name, f, base, optional, is_list, choices)
    return out


def _default(s: Setting, defaults: dict[str, Any]) -> Any:
    if s.name in defaults:
        return defaults[s.name]
    if s.field.default_factory is not dataclasses.MISSING:
        return s.field.default_factory()
    return s.field.default


def build_parser(config_cls: type, description: str | None = None, scope: Scope | None = None,
                 defaults: dict[str, Any] | None = None, prog: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser with `--config` and one flag per setting, grouped as the config is.

    Flags default to "not given" (argparse.SUPPRESS), so parse_config can tell the command line from the file.
    """
    defaults = defaults or {}
    active = [s for s in settings(config_cls).values() if s.applies_to(scope)]
    positional = [s for s in active if s.meta["positional"]]
    for s in positional[1:]:  # argparse would give every value to the first
        raise TypeError(f"{s.name}: a command has one setting for its arguments; {positional[0].name} has them")
    arguments = "".join(f" [{s.meta['metavar'] or s.name.upper()} ...]" for s in positional)
    p = argparse.ArgumentParser(prog=prog, description=description, usage=f"%(prog)s{arguments} [--config FILE] "
                                "[flags: see below]", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="FILE", help="YAML/JSON file of settings (nested by group or flat); "
                                                    "flags given here win over it")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for s in active:
        if s.group not in groups:
            group_cls = typing.get_type_hints(config_cls)[s.group]
            groups[s.group] = p.add_argument_group(getattr(group_cls, "title", s.group))
        default = _default(s, defaults)
        help_text = s.meta["help"]
        if s.base is bool:
            help_text += " (on by default)" if default else ""
        elif default not in (None, []):
            help_text += f" (default: {default})"
        help_text = argparse.SUPPRESS if s.meta["hidden"] else help_text.replace("%", "%%")  # argparse formats help
        names = [f"--{s.name}", *s.meta["aliases"]]
        negative = [n for n in names if s.base is bool and n[2:] == f"no_{s.name}"]
        names = [n for n in names if n not in negative]
        kw: dict[str, Any] = dict(dest=s.name, default=argparse.SUPPRESS, help=help_text)
        if s.meta["positional"]:
            if not s.is_list:
                raise TypeError(f"{s.name}: only a list setting can take the command's arguments")
            names, kw["nargs"], kw["type"] = [s.name], "*", s.base
            kw["metavar"] = s.meta["metavar"] or s.name.upper()
            del kw["dest"]  # a positional argument's dest is its name
        elif s.base is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = s.base
            if s.choices is None:
                kw["metavar"] = s.meta["metavar"] or {int: "N", float: "X"}.get(s.base, "STR")
            else:
                kw["choices"] = s.choices
            if s.is_list and s.meta["several"]:
                kw["nargs"] = "+"  # one flag, several values; given again, it replaces them like any flag
            elif s.is_list:
                kw["action"] = "append"
        groups[s.group].add_argument(*names, **kw)
        if negative:
            groups[s.group].add_argument(*negative, dest=s.name, action="store_false", default=argparse.SUPPRESS,
                                         help=argparse.SUPPRESS if s.meta["hidden"] else f"the same as --no-{s.name}")
    return p


def read_config_file(config_cls: type, path: str | Path, scope: Scope | None = None) -> dict[str, Any]:
    """The settings in a YAML/JSON file as {name: value}, checked against the config class."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read config file ({getattr(e, 'strerror', None) or e})") from None
    try:
        if path.suffix == ".json":
            raw = json.loads(text)
        else:
            import yaml
            raw = yaml.safe_load(text)
    except Exception as e:  # yaml.YAMLError / json.JSONDecodeError: report where the file is broken
        raise ConfigError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'} "
                          f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of settings, got {type(raw).__name__}")
    known = settings(config_cls)
    groups = {f.name for f in dataclasses.fields(config_cls)}
    flat: dict[str, Any] = {}

    def take(name: str, value: Any, group: str | None) -> None:
        s = known.get(name)
        if s is None:
            near = difflib.get_close_matches(name, list(known) + list(groups), n=1)
            raise ConfigError(f"{path}: unknown setting {name!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
        if group is not None and s.group != group:
            raise ConfigError(f"{path}: {name} belongs to group {s.group!r}, not {group!r}")
        if not s.applies_to(scope):
            raise ConfigError(f"{path}: {name} is a {' or '.join(s.meta['features'])} setting, which {scope.name} "
                              "runs do not have")
        flat[name] = s.coerce(value, str(path))

    for key, value in raw.items():
        if key == RESOLVED_KEY:
            continue
        if key in groups:
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: group {key!r} must be a mapping of settings")
            for name, v in value.items():
                take(name, v, key)
        else:
            take(key, value, None)
    return flat


def build_config(config_cls: type[C], values: dict[str, Any], defaults: dict[str, Any] | None = None,
                 typed: Iterable[str] = ()) -> C:
    """The config from explicit values over the entry point's defaults over the dataclass defaults, checked.
    `typed` names the settings given on the command line (`config.typed`, for its check): a recipe file may set
    what the command line then makes moot (a Muon setting under --optimizer adamw), where a typed flag is a
    mistake."""
    defaults = defaults or {}
    groups: dict[str, dict[str, Any]] = {f.name: {} for f in dataclasses.fields(config_cls)}
    for s in settings(config_cls).values():
        groups[s.group][s.name] = values[s.name] if s.name in values else _default(s, defaults)
    hints = typing.get_type_hints(config_cls)
    config = config_cls(**{g: hints[g](**kw) for g, kw in groups.items()})
    config.typed = frozenset(typed)  # type: ignore[attr-defined]
    check_bounds(config)
    check = getattr(config, "check", None)
    if check is not None:
        check()
    return config


BOUNDS = (("at_least", operator.ge, ">="), ("above", operator.gt, ">"), ("below", operator.lt, "<"),
          ("at_most", operator.le, "<="))


def check_bounds(config: Any) -> None:
    """ConfigError for the first setting outside its declared bounds."""
    for s in settings(type(config)).values():
        value = getattr(getattr(config, s.group), s.name)
        if value is None or s.base not in (int, float):
            continue
        for key, within, sign in BOUNDS:
            bound = s.meta[key]
            if bound is not None and not within(value, bound):
                raise ConfigError(f"--{s.name} must be {sign} {bound}, got {value}")


def parse_config(config_cls: type[C], argv: Sequence[str] | None = None, description: str | None = None,
                 scope: Scope | None = None,
                 defaults: dict[str, Any] | Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                 prog: str | None = None) -> C:
    """Parse the command line (and its --config file) into a checked config.

    `defaults` may be a function of the settings given (flags and file), for defaults that depend on them
    (continued pretraining's learning rate on --init_from); --help shows what it gives for none.
    Usage errors exit through argparse (status 2); a bad config file or value raises ConfigError. `prog`: the
    command as --help names it (default: the script's file name).
    """
    resolve = defaults if callable(defaults) else (lambda _: defaults)
    parser = build_parser(config_cls, description, scope, resolve({}), prog)
    given = vars(parser.parse_args(argv))
    path = given.pop("config", None)
    values = read_config_file(config_cls, path, scope) if path else {}
    values.update(given)
    return build_config(config_cls, values, resolve(values), typed=given)


def to_dict(config: Any, scope: Scope | None = None) -> dict[str, dict[str, Any]]:
    """The config nested by group, as a config file for `scope` holds it: actions of one invocation (--resume)
    and settings of features it lacks are left out."""
    out: dict[str, dict[str, Any]] = {}
    for s in settings(type(config)).values():
        if not s.meta["persist"] or not s.applies_to(scope):
            continue
        out.setdefault(s.group, {})[s.name] = getattr(getattr(config, s.group), s.name)
    return out
