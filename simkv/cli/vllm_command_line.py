"""Reading a vLLM command line (`vllm serve ...`, `vllm bench serve ...`) as vLLM's own parser
reads it, against a table of its flags written from that parser (vllm_serve_flags.json,
vllm_bench_flags.json: scripts/vllm_serve_flags.py): underscores or dashes in flag names,
`--x=v`, `--disable-x` / `--no-x` for a switch's negative, `-O3`, several values for a flag that
takes them, JSON options given whole or key by key (`--speculative-config.method ngram`), and a
`--config` YAML file of flags. What each flag means is the caller's (cli/vllm_serve.py,
cli/vllm_bench_command.py)."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

from simkv.config import ConfigError


class CommandLineError(ConfigError):
    """A vLLM command line simkv cannot take, with what to do instead."""


@dataclass(frozen=True)
class Flag:
    """One flag as vLLM reads it: its name (vLLM's `dest`), the words that gave it, whether
    that was its negative form, and its values."""

    name: str
    word: str
    negative: bool
    values: tuple[str, ...]

    @property
    def value(self) -> str | None:
        return self.values[0] if self.values else None


class FlagTable:
    """vLLM's flags of one command: option strings, negative ones, arity, default (by `dest`)."""

    def __init__(self, filename: str, command: tuple[str, ...]) -> None:
        data = json.loads(Path(__file__).with_name(filename).read_text())
        self.flags: dict[str, dict] = data["flags"]
        self.vllm_version: str = data["vllm_version"]
        self.command = command  # ("serve",) or ("bench", "serve")
        self.index: dict[str, tuple[str, bool]] = {}
        for name, flag in self.flags.items():
            for opt in flag["options"]:
                self.index[opt] = (name, False)
            for opt in flag["negative"]:
                self.index[opt] = (name, True)

    @property
    def title(self) -> str:
        return "vllm " + " ".join(self.command)

    def nargs(self, name: str) -> str:
        return self.flags[name]["nargs"]

    def default(self, name: str):
        return self.flags[name]["default"]


@cache
def flag_table(filename: str, command: tuple[str, ...]) -> FlagTable:
    return FlagTable(filename, command)


def human_int(text: str, flag: str) -> int:
    """vLLM's human-readable integers: 32k = 32,000 and 32K = 32,768 (decimals only with k, m, g, t)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", text.strip())
    if m:
        number, suffix = m.groups()
        if not suffix:
            if "." not in number:
                return int(number)
        elif suffix.islower():
            return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
        elif "." not in number:
            return int(number) * 1024 ** ("KMGT".index(suffix) + 1)
    raise CommandLineError(f"{flag} {text!r}: not a whole number (vLLM takes 32768, 32k or 32K)")


def read_command(text: str, table: FlagTable, source: str) -> tuple[str | None, list[Flag]]:
    """The positional argument (serve's model) and the flags of a command line (`@FILE`: the
    file's text), its --config YAML's flags first, the command line's winning, and each JSON
    option merged into one object where it stood first."""
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as exc:
            raise CommandLineError(f"{source} {text}: {exc}") from None
    positional, flags = _parse_words(_words(text, table.command), table, source)
    for flag in [f for f in flags if f.name == "config"]:
        config_positional, config_flags = _parse_words(_config_words(flag.value, table), table,
                                                       f"{table.title} --config {flag.value}")
        positional = positional or config_positional
        given = {f.name for f in flags}
        flags = [f for f in config_flags if f.name not in given] + flags
    return positional, _merged(flags)


def json_object(text: str, word: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise CommandLineError(f"{word}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CommandLineError(f"{word}: expected a JSON object")
    return value


def _words(text: str, command: tuple[str, ...]) -> list[str]:
    """The command's words, less a leading `vllm serve` (`vllm bench serve`; or `python -m
    vllm.entrypoints...`), environment assignments and line continuations."""
    try:
        words = shlex.split(text.replace("\\\n", " "))
    except ValueError as exc:
        raise CommandLineError(f"vllm {' '.join(command)} command: {exc}") from None
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        words.pop(0)  # (CUDA_VISIBLE_DEVICES=0,1 vllm serve ...)
    n = len(command)
    if words[:1] == ["vllm"] and tuple(words[1:1 + n]) == command:
        words = words[1 + n:]
    elif tuple(words[:n]) == command:
        words = words[n:]
    elif len(words) >= 3 and words[1] == "-m" and words[2].startswith("vllm."):
        words = words[3:]
    return words


def _normalize(word: str) -> tuple[str, str | None]:
    """A flag word as vLLM reads it: underscores to dashes in the name, `--x=v` split, `-O3`
    as --optimization-level 3."""
    if word.startswith("--"):
        name, eq, value = word.partition("=")
        head, dot, rest = name[2:].partition(".")
        return "--" + head.replace("_", "-") + dot + rest, (value if eq else None)
    if word.startswith("-O") and word != "-O":
        return "--optimization-level", word[3:] if word[2:3] == "=" else word[2:]
    if word == "-O":
        return "--optimization-level", None
    name, eq, value = word.partition("=")
    return name, (value if eq else None)


def _is_value(word: str) -> bool:
    return not word.startswith("-") or re.fullmatch(r"-\d+(\.\d+)?", word) is not None


def _parse_words(words: list[str], table: FlagTable, source: str) -> tuple[str | None, list[Flag]]:
    positional, flags, i = None, [], 0
    while i < len(words):
        word = words[i]
        i += 1
        if _is_value(word):
            if positional is None and not flags:
                positional = word
                continue
            raise CommandLineError(f"{source}: '{word}' is neither a flag nor a flag's value")
        opt, inline = _normalize(word)
        base = opt.split(".", 1)[0]
        if base not in table.index:
            raise CommandLineError(f"{source}: {word} is not a flag of vLLM {table.vllm_version}'s `{table.title}`")
        name, negative = table.index[base]
        arity = "1" if "." in opt else table.nargs(name)  # (--compilation-config.mode 3: one key)
        values = [] if inline is None else [inline]
        if inline is None and arity != "0":
            while i < len(words) and _is_value(words[i]):
                values.append(words[i])
                i += 1
                if arity in ("1", "?"):
                    break
            if not values and arity != "?":
                raise CommandLineError(f"{source}: {word} needs a value")
        if arity == "0" and values:
            raise CommandLineError(f"{source}: {word} takes no value")
        if "." in opt:
            word, values = base, [json.dumps(_nested(opt.split(".")[1:], values[0]))]
        flags.append(Flag(name, word, negative, tuple(values)))
        if name == "model" and values:
            positional = values[0]
    return positional, flags


def _nested(keys: list[str], text: str) -> dict:
    """--x.a.b V as x's JSON {"a": {"b": V}} (V read as JSON where it is, else a string)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = text
    for key in reversed(keys):
        value = {key.replace("-", "_"): value}
    return value


def _merged(flags: list[Flag]) -> list[Flag]:
    """A JSON option given several times (whole, or key by key) as one object, merged in order as
    vLLM merges them, where its first mention stood."""
    objects: dict[str, dict] = {}
    for flag in flags:
        value = _json_object(flag.values)
        if value is not None:
            _merge_into(objects.setdefault(flag.name, {}), value)
    out, seen = [], set()
    for flag in flags:
        if flag.name not in objects or _json_object(flag.values) is None:
            out.append(flag)
        elif flag.name not in seen:
            seen.add(flag.name)
            out.append(Flag(flag.name, flag.word, flag.negative, (json.dumps(objects[flag.name]),)))
    return out


def _json_object(values: tuple[str, ...]) -> dict | None:
    if len(values) != 1 or not values[0].lstrip().startswith("{"):
        return None
    try:
        value = json.loads(values[0])
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _merge_into(target: dict, update: dict) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge_into(target[key], value)
        else:
            target[key] = value


def _config_words(path: str, table: FlagTable) -> list[str]:
    """vLLM's --config YAML as flag words (its keys are flag names; true flags stand alone,
    false ones take their --no- form, lists give several values, mappings JSON)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise CommandLineError(f"{table.title} --config {path}: {exc}") from None
    if not isinstance(data, dict):
        raise CommandLineError(f"{table.title} --config {path}: expected a mapping of flag: value")
    words = []
    for key, value in data.items():
        if isinstance(value, bool):
            words.append(f"--{key}" if value else f"--no-{key}")
        elif isinstance(value, list):
            words += [f"--{key}", *map(str, value)] if value else []
        elif isinstance(value, dict):
            words += [f"--{key}", json.dumps(value)]
        elif value is not None:
            words += [f"--{key}", str(value)]
    return words
