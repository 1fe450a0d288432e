"""``--config FILE`` (YAML flag values) for every kvflow command: keys with - or _, typed flags
win wherever they stand, lists, on/off flags, and one-line errors (status 2) naming the key."""

from __future__ import annotations

import pytest

from kvflow.config import EngineConfig, ServerConfig
from kvflow.entrypoints.cli import build_parser, main
from kvflow.entrypoints.config_file import expand_config_file


def _parse(argv: list[str]):
    parser = build_parser()
    return parser.parse_args(expand_config_file(parser, argv))


@pytest.fixture
def config(tmp_path):
    def write(text: str) -> str:
        path = tmp_path / "engine.yaml"
        path.write_text(text)
        return str(path)

    return write


def test_keys_with_dashes_or_underscores_reach_the_engine_config(config):
    path = config("max-num-seqs: 3\nblock_size: 8\nenable-prefix-caching: false\n"
                  "kv_cache_memory: 1GiB\ndtype: float32\ngeneration-config: none\n")
    engine = EngineConfig.from_cli_args(_parse(["generate", "--config", path]))
    assert engine.scheduler_config.max_num_seqs == 3
    assert engine.cache_config.block_size == 8
    assert engine.cache_config.enable_prefix_caching is False
    assert engine.cache_config.kv_cache_memory == "1GiB"
    assert engine.model_config.dtype == "float32"
    assert engine.model_config.generation_config == "none"


@pytest.mark.parametrize("argv", [
    ["generate", "--config", "{path}", "--block-size", "4", "--stop", "x"],
    ["generate", "--block-size", "4", "--stop", "x", "--config", "{path}"],
    ["generate", "--block-size=4", "--config={path}", "--stop=x"],
])
def test_typed_flags_override_the_file_wherever_they_stand(config, argv):
    path = config("block-size: 8\nmax-num-seqs: 5\nstop: [a, '-b']\ntemperature: 0.25\n")
    args = _parse([a.replace("{path}", path) for a in argv])
    assert args.block_size == 4 and args.max_num_seqs == 5 and args.temperature == 0.25
    assert args.stop == ["x"]  # a typed repeated flag replaces the file's list


def test_lists_and_values_starting_with_a_dash(config):
    args = _parse(["generate", "--config", config("stop: [a, '-b']\npresence_penalty: -1.5\n")])
    assert args.stop == ["a", "-b"] and args.presence_penalty == -1.5


def test_serve_takes_model_from_the_file_and_the_positional_wins(config):
    path = config("model: from-file\nport: 9100\nmax-n: 4\n")
    args = _parse(["serve", "--config", path])
    assert args.model == "from-file" and args.model_tag is None
    assert ServerConfig.from_cli_args(args).port == 9100
    args = _parse(["serve", "typed-model", "--config", path, "--port", "9200"])
    assert args.model_tag == "typed-model" and args.port == 9200 and args.max_n == 4


def test_bench_commands_take_a_config_file(config):
    args = _parse(["bench", "throughput", "--config", config("num-prompts: 7\n")])
    assert args.num_prompts == 7


@pytest.mark.parametrize("text, needles", [
    ("max-num-seqs: 3\nno_such_flag: 1\n", ["unknown key 'no_such_flag'", "--no-such-flag",
                                            "see kvflow generate --help"]),
    ("max_token: 5\n", ["unknown key 'max_token' (did you mean max-tokens?)"]),
    ("temperature: 0.5\n", None),  # valid for generate: no error (see below for serve)
    ("- a\n- b\n", ["must be a mapping", "list"]),
    ("block_size: [8\n", ["not valid YAML"]),
    ("block_size: [8, 16]\n", ["key 'block_size'", "takes one value"]),
    ("enable_prefix_caching: 0\n", ["key 'enable_prefix_caching'", "true or false"]),
    ("config: other.yaml\n", ["do not nest"]),
    ("block_size: 0\n", ["{path}: key 'block_size': block_size=0 must be >= 1"]),
    ("dtype: int8\n", ["{path}: key 'dtype': argument --dtype: invalid choice: 'int8'"]),
    ("max-num-seqs: lots\n", ["{path}: key 'max-num-seqs': argument --max-num-seqs:",
                              "invalid int value: 'lots'"]),
    ('{"max_num_seqs": 0}\n', ["{path}: key 'max_num_seqs': max_num_seqs=0"]),  # JSON
    ('{"block_size": 8,,}\n', ["not valid YAML", "line 1, column 18"]),
])
def test_bad_files_exit_2_with_one_line_naming_the_key(tiny_llama, config, capsys, text,
                                                       needles):
    """Each error names the file (and the key at fault): a value refused by argparse or by
    the config's own checks after parsing named neither (``argument --dtype: invalid
    choice``, ``block_size=0 must be >= 1``), as if typed on the command line."""
    path = config(text)
    rc = main(["generate", "--model", tiny_llama.path, "--config", path, "--max-tokens", "1",
               "--num-kv-blocks", "16"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    if needles is None:
        assert rc == 0
        return
    assert rc == 2 and len(err) == 1 and err[0].startswith("kvflow: error:"), err
    assert path in err[0], err[0]
    assert all(n.replace("{path}", path) in err[0] for n in needles), err[0]


@pytest.mark.parametrize("argv, text, line", [
    (["serve"], "port: 70000\n",
     "{path}: key 'port': port=70000 is invalid: it must be in [0, 65535]"),
    (["serve"], "max-n: -3\n", "{path}: key 'max-n': max_n=-3 is invalid: it must be >= 1"),
    (["bench", "throughput"], "num-prompts: 0\n",
     "{path}: key 'num-prompts': --num-prompts must be > 0, got 0"),
    (["generate", "--block-size", "0"], "block-size: 8\n", "--block-size=0 must be >= 1"),
    (["generate", "--prompt", "hi"], "model: no-such-model-xyz\n",
     "{path}: key 'model': Model 'no-such-model-xyz' is neither a local path"),
], ids=["serve_port", "serve_max_n", "bench_num_prompts", "typed_flag_wins", "model"])
def test_values_checked_after_parsing_name_the_file(config, capsys, argv, text, line):
    """A value the command checks after parsing (a config's range, a benchmark's count) was
    reported by field or flag alone (``kvflow: error: port=70000 is invalid``), as if typed;
    now prefixed with the file and key that set it. A flag typed on the command line
    overrides the file's key, so its error names the flag only."""
    path = config(text)
    assert main([*argv, "--config", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvflow: error: {line.replace('{path}', path)}") and \
        err.count("\n") == 1, err  # one line (the model's goes on to list the packaged ones)


def test_a_key_of_another_command_is_unknown(config, capsys):
    assert main(["serve", "--config", config("temperature: 0.5\n")]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'temperature'" in err and "kvflow serve has no flag" in err


@pytest.mark.parametrize("key, guess", [("max_tokns", ""),
                                        ("max_num_seq", " (did you mean max-num-seqs?)")])
def test_an_unknown_key_points_at_help_not_at_every_key(config, capsys, key, guess):
    """An unknown key (a generate flag in a serve file, a typo) is named with the closest flag
    if one is close and a pointer to the command's --help, as a typed unknown flag is: the
    line listed all ~150 valid keys after it (over 2,000 characters)."""
    path = config(f"{key}: 5\n")
    assert main(["serve", "--config", path]) == 2
    err = capsys.readouterr().err
    assert err == (f"kvflow: error: {path}: unknown key {key!r}{guess}: kvflow serve has no "
                   f"flag --{key.replace('_', '-')} (its flags, less the dashes, are the keys: "
                   "see kvflow serve --help)\n")


def test_file_values_are_converted_as_typed_ones(config):
    """The file's values go through argparse's own conversion (a list item too), so a value
    refused there names the file and key while a good one parses as typed."""
    path = config("stop: [a, 5]\ndtype: float32\ntemperature: 1\n")
    args = _parse(["generate", "--config", path])
    assert (args.stop, args.dtype, args.temperature) == (["a", "5"], "float32", 1.0)
    with pytest.raises(ValueError, match=r"key 'cpu_gemm': argument --cpu-gemm: invalid "
                                         r"choice: 'fast'"):
        _parse(["generate", "--config", config("cpu_gemm: fast\n")])


@pytest.mark.parametrize("argv, needle", [
    (["generate", "--config"], "needs a YAML file"),
    (["generate", "--config", "a.yaml", "--config", "b.yaml"], "given 2 times"),
    (["generate", "--config", "/no/such/engine.yaml"], "cannot read config file"),
    (["--config", "a.yaml"], "needs a command first"),
])
def test_config_flag_misuse(argv, needle, capsys):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_binary_config_file_is_named(tmp_path, capsys):
    path = tmp_path / "engine.yaml"
    path.write_bytes(b"block_size: 8\n\xff\xfe")
    assert main(["bench", "latency", "--config", str(path)]) == 2
    assert capsys.readouterr().err == (f"kvflow: error: config file {str(path)!r} is not UTF-8 "
                                       "text (byte 14: invalid start byte)\n")


@pytest.mark.parametrize("text, shape", [
    ("stop: {a: 1}\n", 'a mapping: {"a": 1}'),
    ("stop: [x, [y]]\n", 'a nested list: ["y"]'),
    ("prompt: [{text: hi}]\n", 'a mapping: {"text": "hi"}'),
])
def test_a_text_list_flag_refuses_a_mapping_or_nested_list(config, text, shape):
    """A mapping or a nested list for a repeated text flag was passed on as its JSON text
    (``stop: {a: 1}`` became the stop string '{"a": 1}', silently); it is refused naming the
    key, while a flag that takes JSON items still gets them as JSON text."""
    path = config(text)
    key = text.split(":")[0]
    with pytest.raises(ValueError) as e:
        _parse(["generate", "--config", path])
    flag = "--" + key
    assert str(e.value) == (f"{path}: key {key!r}: {flag} takes text values (a value or a "
                            f"list of them), not {shape}")
    args = _parse(["serve", "--config", config(
        'lora_modules: [{name: a, path: /p}, b=/q]\nallowed-origins: [["https://x"]]\n')])
    assert args.lora_modules == ['{"name": "a", "path": "/p"}', "b=/q"]
    assert args.allowed_origins == ['["https://x"]']


def _single_flags() -> list[tuple[str, str]]:
    """(command, flag) for every single-valued flag that takes a value, of every command."""
    import argparse

    from kvflow.entrypoints.config_file import leaf_parsers

    found = []
    for leaf in leaf_parsers(build_parser()):
        command = leaf.prog.split(" ", 1)[1]
        for action in leaf._actions:
            flag = action.option_strings[0] if action.option_strings else None
            if flag in (None, "-h", "--config") or action.nargs is not None or isinstance(
                    action, (argparse._AppendAction, argparse.BooleanOptionalAction,
                             argparse._StoreTrueAction, argparse._HelpAction)):
                continue
            found.append((command, next(f for f in action.option_strings
                                        if f.startswith("--"))))
    return found


# the single-valued flags that take a JSON object (config_file._JSON_FLAGS)
JSON_FLAGS = {"--hf-overrides", "--override-generation-config", "--limit-mm-per-prompt",
              "--media-io-kwargs", "--speculative-config", "--kv-events-config",
              "--kv-transfer-config", "--default-chat-template-kwargs", "--extra-body",
              "--pooler-config"}


def test_a_single_value_flag_refuses_a_mapping_unless_it_takes_json(config):
    """A mapping for a single-valued flag was passed on as its JSON text
    (``chat-template: {a: 1}`` became the template '{"a": 1}', ``served-model-name: {x: 1}``
    the name '{"x": 1}', silently); it is refused naming the key, as a repeated text flag's
    (d188b2b). The flags that take a JSON object still get it as JSON text."""
    parser = build_parser()
    flags = _single_flags()
    assert JSON_FLAGS <= {flag for _, flag in flags}
    for command, flag in flags:
        key = flag[2:]
        path = config(f"{key}: {{a: 1}}\n")
        argv = [*command.split(), *(["m"] if command == "serve" else []), "--config", path]
        if flag in JSON_FLAGS:
            words = expand_config_file(parser, argv)
            assert f'{flag}={{"a": 1}}' in words, (command, flag)
            continue
        with pytest.raises(ValueError) as e:
            expand_config_file(parser, argv)
        assert str(e.value).startswith(f"{path}: key {key!r}: "), (command, flag)
        assert str(e.value).endswith(' takes one value, not a mapping: {"a": 1}'), \
            (command, flag)


def test_served_model_name_and_chat_template_mappings_exit_2(config, capsys):
    path = config("chat-template: {a: 1}\n")
    assert main(["generate", "--config", path]) == 2
    assert capsys.readouterr().err == (f"kvflow: error: {path}: key 'chat-template': "
                                       '--chat-template takes one value, not a mapping: '
                                       '{"a": 1}\n')
    path = config("served-model-name: {x: 1}\n")  # a repeated flag: refused since d188b2b
    assert main(["serve", "m", "--config", path]) == 2
    assert "'served-model-name': --served-model-name takes text values" in \
        capsys.readouterr().err


@pytest.mark.parametrize("command, key", [
    ("generate", "prompt"), ("generate", "stop"), ("generate", "image"),
    ("serve m", "served-model-name"), ("serve m", "allowed-origins"),
    ("serve m", "lora-modules"), ("bench serve", "goodput"),
])
def test_an_empty_list_for_a_repeated_flag_is_refused(config, capsys, command, key):
    """``prompt: []`` in a kvflow generate config fell back to the default prompt ('Once upon
    a time'), ``allowed-origins: []`` to CORS's default ('*' once another CORS key is set):
    an empty list gave no words, so the flag kept its default, silently; a flag taking one
    or more values failed in argparse without naming the file. Now each is one line naming
    the file and the key, status 2."""
    path = config(f"{key}: []\n")
    assert main([*command.split(), "--config", path]) == 2
    assert capsys.readouterr().err == (
        f"kvflow: error: {path}: key {key!r}: --{key} takes at least one value, not an empty "
        "list (leave the key out, or set it to null, for the default)\n")


def test_text_values_are_taken_as_written(config):
    """YAML 1.1 reads ``no`` as false, ``1.10`` as 1.1 and ``0123`` as 83: a text flag's value
    was that value's str() ('stop: [no]' the stop string 'false', 'api-key: 0123' the key
    '83', 'served-model-name: 1.10' the name '1.1'), silently. A text flag now takes the
    file's text as written; typed flags (YAML's ints: 0x10 is 16) and JSON flags (YAML's
    types inside the object) read YAML's values as before."""
    args = _parse(["generate", "--config", config(
        "stop: [no, 1.10, 0123, '~', on]\nprompt: yes\nmax-tokens: 0x10\n"
        "hf-overrides: {rope_theta: 1.10, tie: yes}\n")])
    assert args.stop == ["no", "1.10", "0123", "~", "on"]
    assert args.prompt == ["yes"]
    assert args.max_tokens == 16
    assert args.hf_overrides == '{"rope_theta": 1.1, "tie": true}'
    args = _parse(["serve", "m", "--config", config(
        "served-model-name: [1.10, v2]\napi-key: 0123\nresponse-role: off\n"
        "chat-template: null\n")])
    assert (args.served_model_name, args.api_key, args.response_role) == \
        (["1.10", "v2"], ["0123"], "off")
    assert args.chat_template is None  # null: the flag unset, as before
    args = _parse(["serve", "m", "--config", config(
        "lora-modules: [{name: a, path: /p, base_model_name: 1.10}, b=/q]\n"
        "allowed-origins: [on]\n")])  # JSON items keep YAML's values, text items as written
    assert args.lora_modules == ['{"name": "a", "path": "/p", "base_model_name": 1.1}', "b=/q"]
    assert args.allowed_origins == ["on"]


def test_a_null_item_of_a_text_list_is_refused(config, capsys):
    """``stop: [".", null]`` gave the stop string 'None'; now refused naming the key."""
    path = config('stop: [".", null]\n')
    assert main(["generate", "--config", path]) == 2
    assert capsys.readouterr().err == (f"kvflow: error: {path}: key 'stop': --stop takes text "
                                       "values; item 1 of the list is null\n")
