"""The ``kvflow`` command (also ``python -m kvflow``): ``generate``, ``serve``, ``run-batch``,
``bench throughput|serve|latency|roofline|perplexity``; each takes ``--config FILE`` (YAML flag
values).

Engine flags are generated from the EngineConfig dataclasses, server flags from ServerConfig,
sampling flags from SamplingParams, so each knob is declared once. Bad input exits with status 2 and one line.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from typing import NoReturn

from kvflow import __version__
from kvflow.config import EngineConfig, ServerConfig
from kvflow.entrypoints.cli_generate import add_generate_parser
from kvflow.entrypoints.config_file import add_config_arg, leaf_parsers, read_config_file
from kvflow.utils.close_names import closest_name


def flag_names(message: str, flags: dict[str, str]) -> str:
    """``message`` with each field named as ``<field>=`` or ``SamplingParams.<field>`` that
    is in ``flags`` (field -> the flag that sets it) written as that flag, as the user typed
    it: ``SamplingParams.max_tokens=-1 is invalid`` becomes ``--max-tokens=-1 is invalid``,
    ``num_kv_blocks=-1 must be >= 2`` becomes ``--num-kv-blocks=-1 ...``; other names are
    left as they are."""
    return _FIELD_RE.sub(lambda m: flags.get(m.group(1), m.group(0)), message)


_FIELD_RE = re.compile(r"(?:SamplingParams\.)?\b([a-z][a-z0-9_]*)(?==)")


def command_flags(parser: argparse.ArgumentParser, typed: list[str]) -> dict[str, str]:
    """The options of ``parser`` found in ``typed`` (the command line as typed, before any
    ``--config`` file's values joined it: a value from the file keeps its key's name): the
    destination (the field each sets) -> the flag as typed."""
    words = {w.split("=", 1)[0] for w in typed if w.startswith("--")}
    flags = {}
    for action in parser._actions:
        for option in action.option_strings:
            if option in words:
                flags.setdefault(action.dest, option)
    return flags


def same_setting_twice(parser: argparse.ArgumentParser, typed: list[str]
                       ) -> tuple[str, str] | None:
    """Two names of one option (``--kv-cache-memory`` and its alias
    ``--kv-cache-memory-bytes``) both typed in ``typed``, as typed; None when there are none
    (argparse would keep the later value and drop the other in silence). A flag typed twice
    under one name is argparse's usual last-wins, not this."""
    words = {w.split("=", 1)[0] for w in typed if w.startswith("--")}
    for action in parser._actions:
        names = [o for o in action.option_strings if o in words]
        if len(names) > 1 and not isinstance(action, argparse.BooleanOptionalAction):
            return names[0], names[1]
    return None


def _model_named_twice(args: argparse.Namespace, words: list[str]) -> str | None:
    """Why ``kvflow serve MODEL --model OTHER`` is refused (the positional model replaced
    ``--model`` silently, serving another model than the flag asked for), or None when at
    most one of them is given or both name the same model."""
    tag = getattr(args, "model_tag", None)
    flagged = any(w == "--model" or w.startswith("--model=") for w in words)
    if tag is None or not flagged or args.model == tag:
        return None
    return (f"the positional MODEL {tag!r} and --model {args.model!r} name different "
            "models: give one")


def _cmd_serve(args: argparse.Namespace) -> int:
    from kvflow.entrypoints.api_server import run_server

    if args.model_tag is not None:
        args.model = args.model_tag
    server_config = ServerConfig.from_cli_args(args)
    logging.getLogger("kvflow").setLevel(server_config.uvicorn_log_level.upper())
    try:
        run_server(EngineConfig.from_cli_args(args), server_config,
                   fresh_process=getattr(args, "fresh_process", False))
    except RuntimeError as e:
        print(f"kvflow: error: {e}", file=sys.stderr)
        return 1
    return 0


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                           description="Serve MODEL over an OpenAI-compatible HTTP API.")
    serve.add_argument("model_tag", nargs="?", metavar="MODEL",
                       help="packaged model name, HF folder, GGUF path or Hub repo id "
                       "org/name[@revision] (same as --model)")
    EngineConfig.add_cli_args(serve)
    ServerConfig.add_cli_args(serve)
    serve.set_defaults(func=_cmd_serve)


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (exit status 2) instead of the whole usage block, in
    kvflow's own style (``kvflow: error: ...``), the command's help named at the end."""

    def __init__(self, *args, **kwargs) -> None:
        # no prefix matching: a typo such as --max-token would silently mean --max-tokens
        # (vLLM's parser turns abbreviations off too)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"kvflow: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        """argparse's, but unrecognized arguments are reported by the command's parser (so
        the line names ``kvflow generate --help``, not ``kvflow --help``)."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:  # the command's parser says so, naming its own --help
            command = _command(self, parsed)
            command.error(f"unrecognized arguments: {' '.join(extras)}"
                          f"{_did_you_mean(command, extras)}")
        return parsed


def _did_you_mean(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """`` (did you mean --x?)`` naming the closest option of ``parser`` to each unrecognized
    ``--flag`` in ``extras`` (``--flag=value`` too; ``closest_name``), or ``''``."""
    options = [o for action in parser._actions for o in action.option_strings
               if o.startswith("--")]
    guesses = []
    for extra in extras:
        if extra.startswith("--"):
            guess = closest_name(extra.split("=", 1)[0], options)
            if guess is not None and guess not in guesses:
                guesses.append(guess)
    return f" (did you mean {' or '.join(guesses)}?)" if guesses else ""


# Commands whose parser needs no other command's module: for them ``main`` leaves out the
# run-batch and bench parsers, whose modules cost 0.4-0.5 s of CPU to import at every
# ``kvflow serve`` start (measured on 2 busy cores; ``kvflow serve`` imports none of them).
_SELF_CONTAINED_COMMANDS = ("generate", "serve")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``kvflow`` parser, every command's; with ``command`` one of
    ``_SELF_CONTAINED_COMMANDS``, only the ``generate`` and ``serve`` parsers (a line of that
    command parses the same; ``main`` passes the first word it got)."""
    parser = _Parser(prog="kvflow", description="kvflow LLM engine")
    parser.add_argument("-v", "--version", action="version", version=__version__,
                        help="print kvflow's version and exit (vLLM's vllm --version)")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    _add_serve_parser(sub)
    if command not in _SELF_CONTAINED_COMMANDS:
        _add_other_parsers(sub)
    for command_parser in leaf_parsers(parser):
        add_config_arg(command_parser)
    return parser


def _add_other_parsers(sub: argparse._SubParsersAction) -> None:
    """The ``run-batch`` and ``bench ...`` parsers (their modules imported here)."""
    from kvflow.entrypoints.run_batch import add_run_batch_parser

    add_run_batch_parser(sub)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench",
                                                                      required=True)
    from kvflow.bench.latency import add_latency_parser
    from kvflow.bench.perplexity import add_perplexity_parser
    from kvflow.bench.roofline import add_roofline_parser
    from kvflow.bench.serve import add_serve_parser
    from kvflow.bench.throughput import add_throughput_parser

    add_throughput_parser(bench)
    add_serve_parser(bench)
    add_latency_parser(bench)
    add_roofline_parser(bench)
    add_perplexity_parser(bench)


def main(argv: list[str] | None = None) -> int:
    """Run one ``kvflow`` command; returns the exit status (2 for bad input, one line; 130
    for Ctrl-C, without a traceback: ``kvflow serve`` has shut down by then). ``kvflow serve``
    from the process's command line (``argv`` None) ends the process with it instead, at once
    (``_exit_at_once``)."""
    own_process = argv is None  # the process's command line
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv[0] if argv else None)
    typed = argv
    try:
        expanded = read_config_file(parser, argv)
    except ValueError as e:
        print(f"kvflow: error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(expanded.argv)
    twice = same_setting_twice(_command(parser, args), typed)
    if twice is not None:
        print(f"kvflow: error: {twice[0]} and {twice[1]} name the same setting (one is "
              "vLLM's name for it): give one", file=sys.stderr)
        return 2
    conflict = _model_named_twice(args, expanded.argv)
    if conflict is not None:
        print(f"kvflow: error: {conflict}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # this process runs only this command: serve / run-batch may fork their engine cores
    args.fresh_process = own_process  # (kvflow/engine/start_method.py)
    try:
        status = args.func(args)
    except ValueError as e:  # name the flags the user typed (or the file's keys), not the
        flags = command_flags(_command(parser, args), typed)  # fields behind them
        message = expanded.name_keys(str(e), set(flags))
        print(f"kvflow: error: {flag_names(message, flags)}", file=sys.stderr)
        status = 2
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled; 128 + SIGINT
        status = 130
    except BrokenPipeError:  # stdout's reader left (kvflow generate | head): end quietly
        _silence_stdout()
        status = 141  # 128 + SIGPIPE, as a tool that SIGPIPE ended
    if own_process and args.command == "serve":
        _exit_at_once(status)
    return status


def _silence_stdout() -> None:
    """Point stdout's file descriptor at /dev/null, so the interpreter's final flush of what
    is still buffered for a closed pipe prints no second BrokenPipeError (Python's
    documented recipe, docs.python.org/3/library/signal.html#note-on-sigpipe)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # no file descriptor (a test's stdout)
        pass


def _exit_at_once(status: int) -> NoReturn:
    """End ``kvflow serve``'s process now, skipping the interpreter's teardown: with torch
    loaded it took 2.8 s on 2 busy cores after the server had stopped (its engine processes
    stopped and sockets closed by then), so Ctrl-C seemed to hang; the engine-core process
    ends the same way (``core_proc.engine_core_process``)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _command(parser: argparse.ArgumentParser, args: argparse.Namespace
             ) -> argparse.ArgumentParser:
    """The leaf parser of the command ``args`` were parsed for (``kvflow bench serve``)."""
    words = " ".join(w for w in (getattr(args, "command", None), getattr(args, "bench", None))
                     if w)
    return next((p for p in leaf_parsers(parser) if p.prog == f"{parser.prog} {words}"),
                parser)


if __name__ == "__main__":
    sys.exit(main())
