"""``--config FILE``: a YAML file of flag values for any ``kvflow`` command.

Keys are the command's flag names, with ``-`` or ``_`` (``max-num-seqs: 64`` or
``max_num_seqs: 64``); values are YAML scalars, ``true``/``false`` for on/off flags, lists for
repeated flags (``stop: ["\\n", "###"]``; their items are text, mappings only where the flag
takes JSON items, as ``--lora-modules``) and mappings for JSON flags (``hf-overrides``,
``speculative-config``, ...: ``_JSON_FLAGS``; a mapping for any other flag is refused). The
file is expanded into command-line words placed before everything typed after the subcommand,
so argparse converts and checks its values exactly like typed ones, and a flag on the command line wins: a later value
replaces an earlier one, and a repeated flag given on the command line (``--stop``) replaces the
file's list instead of adding to it. Flags themselves are still generated from
``kvflow/config/`` (and the sampling fields); this module only reads values for them.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass, field
from typing import Any

from kvflow.utils.close_names import closest_name

CONFIG_FLAG = "--config"
# Repeated (list) flags whose items may be JSON (vLLM's forms): a mapping or list item of the
# file goes to them as JSON text. Every other repeated flag takes plain text (``--stop``,
# ``--prompt``, ``--image``, ...), where JSON text would be a wrong value taken silently.
_JSON_ITEM_FLAGS = frozenset({"--lora-modules", "--allowed-origins", "--allowed-methods",
                              "--allowed-headers"})
# Single-valued flags that take a JSON object: a mapping of the file goes to them as JSON
# text. Every other single-valued flag refuses one (``chat-template: {a: 1}`` would be the
# template ``{"a": 1}``, silently).
_JSON_FLAGS = frozenset({"--hf-overrides", "--override-generation-config",
                         "--limit-mm-per-prompt", "--media-io-kwargs", "--speculative-config",
                         "--kv-events-config", "--kv-transfer-config",
                         "--default-chat-template-kwargs", "--extra-body",
                         "--pooler-config"})


@dataclass(frozen=True)
class ConfigFileArgs:
    """The command line with a ``--config`` file's flags joined (``argv``), the file
    (``path``, None without one) and the keys it set, by the field each sets (``keys``:
    destination -> the key as the file wrote it)."""

    argv: list[str]
    path: str | None = None
    keys: dict[str, str] = field(default_factory=dict)

    def name_keys(self, message: str, typed: set[str]) -> str:
        """``message`` (an error found after parsing, e.g. ``block_size=0 must be >= 1``)
        prefixed with the file and its keys that the message names (as ``field=...``, as
        its flag ``--field``, or as the word it starts with), as errors found in the file
        itself are (``FILE: key 'block_size': ...``); fields in ``typed`` (given on the
        command line, which overrides the file) are not the file's. Unchanged when it names
        none of them."""
        named = [key for dest, key in self.keys.items()
                 if dest not in typed and re.search(_named(dest), message)]
        if not named:
            return message
        keys = ", ".join(repr(k) for k in named)
        return f"{self.path}: key{'s' if len(named) > 1 else ''} {keys}: {message}"


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    """Add ``--config FILE`` to one command's parser (the value is consumed before parsing)."""
    parser.add_argument(CONFIG_FLAG, metavar="FILE",
                        help="YAML file of flag values (keys: flag names, with - or _); flags "
                        "given on the command line override it")


def leaf_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parsers of every runnable command (those without subcommands) under ``parser``."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [parser]
    return [leaf for a in subs for p in dict.fromkeys(a.choices.values())
            for leaf in leaf_parsers(p)]


def _named(dest: str) -> str:
    """A pattern for where an error message names the field ``dest`` (as its first word in
    any case: ``Model 'x' is neither a local path ...`` names ``model``)."""
    name, flag = re.escape(dest), re.escape("--" + dest.replace("_", "-"))
    return rf"(?:(?i:^{name}\b)|\b{name}=|{flag}(?![\w-]))"


def expand_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``read_config_file(parser, argv).argv``: the command line with the file's flags."""
    return read_config_file(parser, argv).argv


def read_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> ConfigFileArgs:
    """``argv`` with ``--config FILE`` replaced by the file's flags, which go right after the
    subcommand words and any positional arguments that follow them, before the first typed
    option (so typed options override them and no positional lands in a list flag); each
    value is converted and checked as argparse will (type, choices) here, so that an error
    names the file and the key.

    Raises:
        ValueError: the file cannot be read or parsed, is not a mapping, names a key that is no
            flag of this command, or gives a value its flag does not take (the wrong shape,
            type or choice; the message names the file and the key); ``--config`` is given
            twice or without a file.
    """
    argv, path = _pop_config_flag(argv)
    if path is None:
        return ConfigFileArgs(argv)
    leaf, depth = _leaf_for(parser, argv)
    values, written = _load_yaml(path)
    words, keys = [], {}
    for key, value in values.items():
        action = _action_for(leaf, key, path)
        if action.dest == "config":
            raise ValueError(f"{path}: key {key!r}: config files do not nest")
        if _given_on_command_line(action, argv):
            continue  # a repeated flag typed on the command line replaces the file's list
        if _takes_text(action) and str(key) in written:
            value = _as_written(written[str(key)], value)
        words += _words(leaf, action, value, f"{path}: key {key!r}")
        keys[action.dest] = str(key)
    at = next((i for i in range(depth, len(argv)) if argv[i].startswith("-")), len(argv))
    return ConfigFileArgs(argv[:at] + words + argv[at:], path, keys)


def _pop_config_flag(argv: list[str]) -> tuple[list[str], str | None]:
    rest, paths, i = [], [], 0
    while i < len(argv):
        word = argv[i]
        if word == CONFIG_FLAG:
            if i + 1 >= len(argv):
                raise ValueError(f"{CONFIG_FLAG} needs a YAML file")
            paths.append(argv[i + 1])
            i += 2
            continue
        if word.startswith(CONFIG_FLAG + "="):
            paths.append(word.split("=", 1)[1])
        else:
            rest.append(word)
        i += 1
    if len(paths) > 1:
        raise ValueError(f"{CONFIG_FLAG} is given {len(paths)} times; give one file")
    return rest, (paths[0] if paths else None)


def _leaf_for(parser: argparse.ArgumentParser, argv: list[str]
              ) -> tuple[argparse.ArgumentParser, int]:
    """The command's parser, following subcommand words from the start of ``argv``, and how
    many words that took. Raises ValueError when ``argv`` names no command."""
    depth = 0
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return parser, depth
        if depth >= len(argv) or argv[depth] not in subs[0].choices:
            raise ValueError(f"{CONFIG_FLAG} needs a command first (e.g. kvflow serve "
                             f"{CONFIG_FLAG} FILE)")
        parser = subs[0].choices[argv[depth]]
        depth += 1


def _load_yaml(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The file's mapping (``yaml.safe_load``'s values) and each key's value node (by the
    key as written), whose scalars keep their text as written (``_as_written``).

    Raises:
        ValueError: the file cannot be read, is not UTF-8 or YAML, or is not a mapping.
    """
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            loader = yaml.SafeLoader(f)
            try:
                node = loader.get_single_node()
                data = None if node is None else loader.construct_document(node)
            finally:
                loader.dispose()
    except OSError as e:
        raise ValueError(f"cannot read config file {path!r}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"config file {path!r} is not UTF-8 text (byte {e.start}: "
                         f"{e.reason})") from None
    except yaml.YAMLError as e:
        detail = " ".join(str(e).split())
        raise ValueError(f"config file {path!r} is not valid YAML: {detail}") from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
            f"config file {path!r} must be a mapping of flag names to values, not a "
            f"{type(data).__name__}")
    # after construct_document: merge keys (<<) are flattened into node.value
    written = {k.value: v for k, v in node.value if isinstance(k, yaml.ScalarNode)}
    return data, written


def _takes_text(action: argparse.Action) -> bool:
    """Whether ``action`` takes text values (no type conversion, no JSON object): its values
    from the file are taken as written (``stop: [no]`` is the text ``no``, not false; a
    ``_JSON_ITEM_FLAGS`` mapping item stays a mapping, see ``_as_written``)."""
    return action.type in (None, str) and action.nargs != 0 \
        and action.option_strings[0] not in _JSON_FLAGS and not _optional_value(action)


def _optional_value(action: argparse.Action) -> bool:
    """Whether ``action`` is a flag whose value may be left out, standing for True
    (``--hf-token [TOKEN]``): from the file, true is the flag alone and false leaves it
    unset, as vLLM's config file reads booleans."""
    return action.nargs == "?" and action.const is True


def _as_written(node: Any, value: Any) -> Any:
    """``value`` (a key's value as YAML read it) with each scalar replaced by its text as
    written (YAML 1.1 reads ``1.10`` as 1.1, ``0123`` as 83, ``no`` as false); null stays
    None, mappings stay as read."""
    import yaml

    if isinstance(node, yaml.ScalarNode):
        return None if value is None else node.value
    if isinstance(node, yaml.SequenceNode) and isinstance(value, list):
        return [_as_written(item, v) for item, v in zip(node.value, value)]
    return value


def _action_for(parser: argparse.ArgumentParser, key: Any, path: str) -> argparse.Action:
    flag = "--" + str(key).strip().replace("_", "-")
    action = parser._option_string_actions.get(flag)
    if action is None or action.dest == "help":
        valid = sorted(a.option_strings[0][2:] for a in parser._actions
                       if a.option_strings and a.dest not in ("help", "config"))
        close = closest_name(flag[2:], valid)
        guess = f" (did you mean {close}?)" if close else ""
        # the ~150 valid keys are the command's flags: --help lists them (a typed unknown flag
        # points there too), where a list in the message ran to 2,000 characters
        raise ValueError(f"{path}: unknown key {key!r}{guess}: {parser.prog} has no flag "
                         f"{flag} (its flags, less the dashes, are the keys: see "
                         f"{parser.prog} --help)")
    return action


def _given_on_command_line(action: argparse.Action, argv: list[str]) -> bool:
    """Whether a repeated (append) flag is typed on the command line."""
    if not isinstance(action, argparse._AppendAction):
        return False
    return any(w in action.option_strings or w.split("=", 1)[0] in action.option_strings
               for w in argv)


def _words(parser: argparse.ArgumentParser, action: argparse.Action, value: Any,
           where: str) -> list[str]:
    """Command-line words for one flag's value (none for null: leave the flag unset), its
    items checked as ``parser`` will check them (``_check_items``)."""
    flag = action.option_strings[0]
    if value is None:
        return []
    switch = _switch_words(action, flag, value, where)
    if switch is not None:
        return switch
    raw = value if isinstance(value, list) else [value]
    if isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*") \
            or isinstance(action.nargs, int):  # repeated: a list of values
        _check_list(flag, raw, where)
    items = [_text(item) for item in raw]
    if isinstance(action, argparse._AppendAction):  # --flag=value: values may start with "-"
        _check_items(parser, action, items, where)
        return [f"{flag}={item}" for item in items]
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        _check_items(parser, action, items, where)
        return [flag, *items]
    if isinstance(value, list):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
            f"{where}: {flag} takes one value, not a list")
    if isinstance(value, dict) and flag not in _JSON_FLAGS:
        raise ValueError(
            f"{where}: {flag} takes one value, not a mapping: {json.dumps(value)}")
    _check_items(parser, action, items, where)
    return [f"{flag}={items[0]}"]


def _switch_words(action: argparse.Action, flag: str, value: Any, where: str
                  ) -> list[str] | None:
    """The words of an on/off flag's value (``--flag``, ``--no-flag`` or none), or of a bool
    given to a flag whose value is optional; None for any other flag or value.

    Raises:
        ValueError: naming ``where``, for an on/off flag given something other than a bool.
    """
    if isinstance(action, (argparse.BooleanOptionalAction, argparse._StoreTrueAction)):
        if not isinstance(value, bool):
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
                f"{where}: {flag} is an on/off flag; give true or false")
        if isinstance(action, argparse.BooleanOptionalAction):
            return [flag if value else "--no-" + flag[2:]]
        return [flag] if value else []
    if _optional_value(action) and isinstance(value, bool):
        return [flag] if value else []
    return None


def _check_list(flag: str, raw: list[Any], where: str) -> None:
    """Refuse values a repeated flag (a list of values; ``raw``: the file's value as a
    list) cannot take as command-line words.

    Raises:
        ValueError: naming ``where``, for a null item (its text would be the word None), an
            empty list (no words would leave the flag at its default, silently), or a
            mapping or nested list (unless the flag's items are JSON).
    """
    if None in raw:  # its text would be the word None
        raise ValueError(f"{where}: {flag} takes text values; item {raw.index(None)} of the "
                         "list is null")
    if raw == []:  # no words would leave the flag at its default, silently
        raise ValueError(f"{where}: {flag} takes at least one value, not an empty list (leave "
                         "the key out, or set it to null, for the default)")
    if flag not in _JSON_ITEM_FLAGS:
        nested = next((item for item in raw if isinstance(item, (dict, list))), None)
        if nested is not None:
            raise ValueError(
                f"{where}: {flag} takes text values (a value or a list of them), not "
                f"{'a mapping' if isinstance(nested, dict) else 'a nested list'}: "
                f"{json.dumps(nested)}")


def _check_items(parser: argparse.ArgumentParser, action: argparse.Action, items: list[str],
                 where: str) -> None:
    """Convert each of a flag's values from the file as argparse will (its ``type`` and
    ``choices``), so that a bad one is refused naming the file and key (``where``) rather
    than as a typed flag.

    Raises:
        ValueError: ``where`` and argparse's words (``argument --dtype: invalid choice``).
    """
    for item in items:
        try:
            parser._get_values(action, [item])
        except argparse.ArgumentError as e:
            raise ValueError(f"{where}: {e}") from None


def _text(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
