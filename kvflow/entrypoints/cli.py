"""The ``kvflow`` command (also ``python -m kvflow``): ``generate``, ``serve``, ``run-batch``,
``bench throughput|serve|latency|roofline|perplexity``; each takes ``--config FILE`` (YAML flag
values).

Engine flags are generated from the EngineConfig dataclasses, server flags from ServerConfig,
sampling flags from SamplingParams, so each knob is declared once. Bad input exits with status 2 and one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import sys
from typing import Any, NoReturn

from kvflow.chat_template_source import load_chat_template
from kvflow.config import EngineConfig, ServerConfig
from kvflow.entrypoints.config_file import add_config_arg, leaf_parsers, read_config_file
from kvflow.entrypoints.generate_output import GeneratePrinter
from kvflow.lora.path_flag import add_lora_path_arg, lora_request_from_flags
from kvflow.models.generation_config import SAMPLING_DEFAULT_FIELDS
from kvflow.sampling_params import SamplingParams

_SAMPLING_FLAGS = ("n", "temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens",
                   "stop", "ignore_eos", "logprobs", "presence_penalty", "frequency_penalty",
                   "repetition_penalty")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """One flag per SamplingParams field in ``_SAMPLING_FLAGS`` (``--stop`` repeats). Unset
    flags are not passed on, so the model's generation_config.json defaults can fill them."""
    group = parser.add_argument_group("sampling")
    for f in dataclasses.fields(SamplingParams):
        if f.name not in _SAMPLING_FLAGS:
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.name == "stop":
            group.add_argument(flag, action="append", default=None, help="stop string (repeat)")
        elif f.type in ("bool", bool):
            group.add_argument(flag, action="store_true", default=None)
        else:
            kind = float if f.type == "float" else int
            default = f.default if f.default is not dataclasses.MISSING else None
            model_default = "the model's generation_config.json if it sets it, else " \
                if f.name in SAMPLING_DEFAULT_FIELDS else ""
            group.add_argument(flag, type=kind, default=None,
                               help=f"(default: {model_default}{default})")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    """SamplingParams from the flags given on the command line (or in ``--config``)."""
    return SamplingParams(**{k: getattr(args, k) for k in _SAMPLING_FLAGS
                             if getattr(args, k) is not None})


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


def context_note(max_tokens: int | None, max_model_len: int) -> str | None:
    """A note for ``--max-tokens`` at or above ``max_model_len`` (no prompt leaves that much
    room: generation stops when the context is full, with finish_reason "length", as the
    offline API does, rather than being refused); None otherwise."""
    if max_tokens is None or max_tokens < max_model_len:
        return None
    return (f"kvflow: note: --max-tokens {max_tokens} is more than the context leaves "
            f"(max_model_len {max_model_len}, prompt included): each sample stops when the "
            "context is full (finish_reason length)")


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvflow.llm import LLM
    from kvflow.multimodal.video import VideoError

    params = sampling_params_from_args(args)
    config = EngineConfig.from_cli_args(args)
    template = _chat_template_flag(args)
    images = _read_images(args.image or [], config)
    videos = _read_videos(args.video or [], config)
    lora = lora_request_from_flags(args.lora_path, config.lora_config.enable_lora,
                                   "kvflow generate")
    llm = LLM.from_engine_config(config)
    note = context_note(args.max_tokens, llm.engine.processor.max_model_len)
    if note is not None:
        print(note, file=sys.stderr)
    prompts = args.prompt or ["Once upon a time"]
    printer = GeneratePrinter(len(prompts), sys.stdout, args.chat, args.verbose,
                              args.logprobs is not None, config.speculative_config is not None)
    run = {"use_tqdm": False, "on_output": printer.update, "lora_request": lora}
    try:  # printed as generated (generate_output.py)
        if args.chat:
            parts = [*({"type": "image_url", "image_url": {"url": url}} for url, _ in images),
                     *({"type": "video_url", "video_url": {"url": url}} for url, _ in videos)]
            outputs = llm.chat([[{"role": "user", "content": [*parts, {"type": "text",
                                                                        "text": p}]
                                 if parts else p}] for p in prompts], params,
                               chat_template=template, **run)
        elif images or videos:
            media = {"image": [image for _, image in images],
                     "video": [frames for _, frames in videos]}
            media = {kind: items for kind, items in media.items() if items}
            outputs = llm.generate([{"prompt": p, "multi_modal_data": media} for p in prompts],
                                   params, **run)
        else:
            outputs = llm.generate(prompts, params, **run)
    except ValueError as e:  # the model's own limits (too small, aspect ratio): name the file
        flag, files = ("--video", args.video) if isinstance(e, VideoError) else \
            ("--image", args.image)
        index = getattr(e, "image_index", None)
        if index is None or not 0 <= index < len(files or []):
            raise
        raise ValueError(f"{flag} {files[index]}: {e}") from None
    finally:
        printer.close()  # Ctrl-C mid-sample: end its line
    printer.print_totals([o.metrics for o in outputs])
    return 0


def _chat_template_flag(args: argparse.Namespace) -> str | None:
    """``kvflow generate --chat-template``'s template, read and compiled before the model
    loads (None: the model's).

    Raises:
        ValueError: without ``--chat``, or for a template that cannot be used
            (``chat_template_source.load_chat_template``).
    """
    if args.chat_template is None:
        return None
    if not args.chat:
        raise ValueError("--chat-template needs --chat (a template renders conversations)")
    return load_chat_template(args.chat_template)


def _read_images(paths: list[str], config: EngineConfig) -> list[tuple[str, Any]]:
    """(data URL, decoded RGB image) of each ``--image`` file, checked against the image
    limits before the model loads.

    Raises:
        ValueError: for a file that cannot be read, or an image the limits refuse.
    """
    import base64

    from kvflow.multimodal.media import decode_image_bytes, image_format

    out = []
    for path in paths:
        data = _read_file("--image", path)
        try:
            image = decode_image_bytes(data, config.multimodal_config)
        except ValueError as e:
            raise ValueError(f"--image {path}: {e}") from None
        media_type = f"image/{image_format(data)}"  # the bytes', not the file name's
        out.append((f"data:{media_type};base64,{base64.b64encode(data).decode()}", image))
    return out


def _read_file(flag: str, path: str) -> bytes:
    """The bytes of the file ``path`` that ``flag`` names.

    Raises:
        ValueError: naming the flag and the file when it cannot be read.
    """
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read it ({e.strerror})") from None


def _read_videos(paths: list[str], config: EngineConfig) -> list[tuple[str, Any]]:
    """(data URL, RGB PIL frames) of each ``--video`` file (a video file decoded with PyAV,
    ``media_io_kwargs`` ``video.num_frames`` frames sampled uniformly), checked against the
    limits before the model loads.

    Raises:
        ValueError: for a file that cannot be read, PyAV not installed (``pip install
            'kvflow[video]'``), or a video the limits or the decoder refuse.
    """
    import base64
    import mimetypes

    from kvflow.multimodal.video import decode_video_bytes

    out = []
    for path in paths:
        data = _read_file("--video", path)
        try:
            frames = decode_video_bytes(data, config.multimodal_config)
        except ValueError as e:
            raise ValueError(f"--video {path}: {e}") from None
        # any video/* type but video/jpeg (vLLM's base64-frames form) means "a file" here
        guess = mimetypes.guess_type(path)[0] or ""
        media_type = guess if guess.startswith("video/") and guess != "video/jpeg" \
            else "video/mp4"
        out.append((f"data:{media_type};base64,{base64.b64encode(data).decode()}", frames))
    return out


def _cmd_serve(args: argparse.Namespace) -> int:
    from kvflow.entrypoints.api_server import run_server

    if args.model_tag is not None:
        args.model = args.model_tag
    server_config = ServerConfig.from_cli_args(args)
    logging.getLogger("kvflow").setLevel(server_config.uvicorn_log_level.upper())
    try:
        run_server(EngineConfig.from_cli_args(args), server_config)
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
            _command(self, parsed).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvflow", description="kvflow LLM engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text offline")
    gen.add_argument("--prompt", action="append", help="prompt text (repeat for a batch; default: 'Once upon a time')")
    gen.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    gen.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE",
                     help="with --chat, the Jinja chat template to use instead of the "
                     "model's: a file, or the template itself (as kvflow serve takes it)")
    gen.add_argument("--image", action="append", metavar="FILE",
                     help="an image for every prompt (repeat for several; vision-language "
                     "models): with --chat it goes before the text, otherwise the prompt "
                     "holds one image placeholder per image")
    gen.add_argument("--video", action="append", metavar="FILE",
                     help="a video file for every prompt (repeat for several; Qwen2-VL / "
                     "Qwen2.5-VL; decoded with PyAV: pip install 'kvflow[video]'): with "
                     "--chat it goes after the images, before the text, otherwise the prompt "
                     "holds one video placeholder per video")
    add_lora_path_arg(gen, "every prompt")
    gen.add_argument("--verbose", action="store_true",
                     help="print finish reason and timings (with --speculative-config, the "
                          "drafted and accepted tokens and the acceptance rate)")
    EngineConfig.add_cli_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=_cmd_generate)
    _add_serve_parser(sub)
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
    for command in leaf_parsers(parser):
        add_config_arg(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one ``kvflow`` command; returns the exit status (2 for bad input, one line; 130
    for Ctrl-C, without a traceback: ``kvflow serve`` has shut down by then). ``kvflow serve``
    from the process's command line (``argv`` None) ends the process with it instead, at once
    (``_exit_at_once``)."""
    parser = build_parser()
    own_process = argv is None  # the process's command line
    argv = list(sys.argv[1:] if argv is None else argv)
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
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
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
