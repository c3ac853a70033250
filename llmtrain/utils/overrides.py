"""Hydra overrides checked against a config schema: an unknown key or preset is refused with the nearest valid one.

    python llmtrain/pretrain.py train.max_step=10      # exit 2: "did you mean train.max_steps=10?"
    python llmtrain/pretrain.py +train.max_step=10     # the same (a `+` key the schema lacks would be dropped)
    problems = override_problems(["model=llama-tinny"], Config, {"model": ["gpt-tiny", "llama-tiny"]}, "python ...")

Hydra alone refuses `train.max_step=10` with "use +train.max_step=10", and a `+` key that a
structured (dataclass) config does not have is silently dropped when the config becomes the
dataclass: the run goes on without the setting. Checked here, before Hydra composes, from the
dataclass fields alone (no file is read but the preset names given): every `key=value`, `+key=value`,
`++key=value` and `~key` names a field of the schema (or a group preset: `model=NAME`,
`+parallel=NAME`); `hydra.*` and `hydra/...` keys are Hydra's own and pass.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Iterable, Mapping, Sequence


OPEN = "*"
"""The mark of a field whose value is a free-form mapping (`Dict`, `Any`): `path.*` in `schema_keys` means any key
below `path` is valid."""


def schema_keys(schema: type) -> set[str]:
    """Every dotted field path of a dataclass tree (`train`, `train.max_steps`, `train.anomaly.policy`, ...); a
    mapping-valued field adds `path.*` (`OPEN`)."""
    out: set[str] = set()

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            path = prefix + f.name
            out.add(path)
            hint = hints.get(f.name)
            inner = _dataclass_of(hint)
            if inner is not None:
                walk(inner, path + ".")
            elif hint is typing.Any or _is_mapping(hint):
                out.add(f"{path}.{OPEN}")

    walk(schema, "")
    return out


def _is_mapping(hint) -> bool:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1:
        hint = args[0]
    return hint is dict or typing.get_origin(hint) in (dict, typing.Mapping) or (
        isinstance(typing.get_origin(hint), type) and issubclass(typing.get_origin(hint), Mapping))


def _dataclass_of(hint):
    """The dataclass a field holds (`X` or `Optional[X]`), else None."""
    if dataclasses.is_dataclass(hint):
        return hint
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1 and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def is_known(key: str, keys: set[str]) -> bool:
    """A field path, or an element of a list field (`data.prefixes.0`)."""
    parts = key.split(".")
    while parts and parts[-1].isdigit():
        parts.pop()
    if ".".join(parts) in keys:
        return True
    return any(".".join(parts[:i]) + "." + OPEN in keys for i in range(1, len(parts)))


def nearest(key: str, names: Iterable[str], cutoff: float = 0.75) -> str | None:
    """The closest name to `key` by spelling (`train.max_step` -> `train.max_steps`), else by its last part
    (`max_steps` -> `train.max_steps`), else None."""
    names = sorted(n for n in names if not n.endswith("." + OPEN))
    close = difflib.get_close_matches(key, names, n=1, cutoff=cutoff)
    if close:
        return close[0]
    leaf = key.rsplit(".", 1)[-1]
    by_leaf: dict[str, list[str]] = {}
    for n in names:
        by_leaf.setdefault(n.rsplit(".", 1)[-1], []).append(n)
    close = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=cutoff)
    if not close:
        return None
    section = key.rsplit(".", 1)[0] if "." in key else ""
    same = [n for n in by_leaf[close[0]] if section and n.startswith(section + ".")]
    return (same or by_leaf[close[0]])[0]


def override_problems(overrides: Sequence[str], schema: type, groups: Mapping[str, Sequence[str]],
                      command: str) -> list[str]:
    """One line per override whose key is not in `schema` or whose preset is not in `groups` (group -> preset
    names), each with the nearest valid override; `command` is how the user prints every key."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception:  # a malformed override: named here when quoting fixes it, else Hydra reports it
        return quoting_problems(overrides)
    keys = schema_keys(schema)
    problems = []
    for o in parsed:
        key, line = o.key_or_group, o.input_line
        if key.startswith(("hydra.", "hydra/")) or key == "hydra" or o.package is not None:
            continue
        value = line.split("=", 1)[1] if "=" in line else ""
        if key in groups and not o.is_delete():
            if value and value not in groups[key] and value != "null":
                near = nearest(value, groups[key], cutoff=0.6)
                problems.append(f"{line}: no preset {key}={value} (conf/{key}/*.yaml: {', '.join(sorted(groups[key]))})"
                                + (f"; did you mean {line.split('=', 1)[0]}={near}?" if near else ""))
            continue
        if is_known(key, keys):
            continue
        near = nearest(key, keys)
        plus = " (a `+` override adds a key the schema does not have: it would be dropped, not used)" \
            if o.is_add() or o.is_force_add() else ""
        fix = f"; did you mean {near}={value}?" if near and value else (f"; did you mean {near}?" if near else "")
        problems.append(f"{line}: {key} is not a config key{plus}{fix} (`{command} --cfg job` prints every key)")
    return problems


def quoting_problems(overrides: Sequence[str]) -> list[str]:
    """Overrides Hydra's grammar refuses whose value it would take quoted: non-ASCII characters (a Chinese path or
    run name), or a comma in a path. Each with the quoted form, as the shell needs it typed."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser, problems = OverridesParser.create(), []
    for line in overrides:
        key, sep, value = line.partition("=")
        if not sep or value[:1] in ("'", '"', "["):
            continue
        try:
            parser.parse_overrides([line])
        except Exception:  # noqa: BLE001 - Hydra's grammar errors have no common public type
            if not value.isascii() or "," in value:
                problems.append(f"{line}: Hydra takes a value with non-ASCII characters or commas only in quotes: "
                                f"give \"{key}='{value}'\" (the double quotes for the shell; spaces inside quotes "
                                "are fine)")
    return problems


def composed_problems(cfg, schema: type, command: str) -> list[str]:
    """Keys of a composed DictConfig that `schema` does not have (put there by `+key=value`), each with the nearest
    valid key; OmegaConf.to_object would drop them silently."""
    from omegaconf import DictConfig, OmegaConf

    keys = schema_keys(schema)
    problems = []

    def walk(node, prefix: str) -> None:
        for k, child in node.items_ex(resolve=False):
            path = prefix + str(k)
            if not is_known(path, keys):
                near = nearest(path, keys)
                problems.append(f"{path}: not a config key (added with +{path}=...: it would be dropped, not used)"
                                + (f"; did you mean {near}?" if near else "") + f" (`{command} --cfg job` prints every key)")
                continue
            if isinstance(child, DictConfig) and not OmegaConf.is_missing(node, k) and node.get(k) is not None:
                walk(child, path + ".")

    walk(cfg, "")
    return problems
