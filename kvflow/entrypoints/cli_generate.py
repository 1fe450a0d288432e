"""``kvflow generate``: its flags (the sampling flags generated from SamplingParams), the
``--image`` / ``--video`` files read and checked before the model loads, and the run that
prints each sample as it is generated. The ``kvflow`` command itself (parsing, error lines,
exit status) is :mod:`kvflow.entrypoints.cli`."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from typing import Any

from kvflow.chat_template_source import load_chat_template
from kvflow.config import EngineConfig
from kvflow.entrypoints.generate_output import GeneratePrinter
from kvflow.lora.path_flag import add_lora_path_arg, lora_request_from_flags
from kvflow.models.generation_config import SAMPLING_DEFAULT_FIELDS
from kvflow.sampling_params import SamplingParams

_SAMPLING_FLAGS = ("n", "temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens",
                   "stop", "stop_token_ids", "ignore_eos", "logprobs", "presence_penalty", "frequency_penalty",
                   "repetition_penalty")
_BOOL_FLAG_HELP = {"ignore_eos": "go on past the EOS token, up to --max-tokens"}


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """One flag per SamplingParams field in ``_SAMPLING_FLAGS`` (``--stop`` repeats,
    ``--stop-token-ids`` takes one or more ids and repeats). Unset
    flags are not passed on, so the model's generation_config.json defaults can fill them."""
    group = parser.add_argument_group("sampling")
    for f in dataclasses.fields(SamplingParams):
        if f.name not in _SAMPLING_FLAGS:
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.name == "stop":
            group.add_argument(flag, action="append", default=None, help="stop string (repeat)")
        elif f.name == "stop_token_ids":
            group.add_argument(flag, action="extend", nargs="+", type=int, default=None,
                               metavar="ID", help="token ids that end a sample (one or more; "
                               "repeatable), as SamplingParams.stop_token_ids")
        elif f.type in ("bool", bool):
            group.add_argument(flag, action="store_true", default=None,
                               help=_BOOL_FLAG_HELP[f.name])
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


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    """The ``kvflow generate`` command: prompts, ``--chat`` (and its template), images,
    videos, a LoRA adapter, the engine flags (EngineConfig) and the sampling flags."""
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
    """``kvflow generate``: every flag checked and every ``--image`` / ``--video`` file read
    before the model loads, then the prompts run, each sample printed as it is generated
    (``generate_output.GeneratePrinter``) and the totals at the end. Returns 0.

    Raises:
        ValueError: for a bad flag or file (naming it), or a prompt the engine refuses.
    """
    from kvflow.offline.llm import LLM

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
        outputs = _run_prompts(llm, args, prompts, params, template, images, videos, run)
    finally:
        printer.close()  # Ctrl-C mid-sample: end its line
    printer.print_totals([o.metrics for o in outputs])
    return 0


def _run_prompts(llm: Any, args: argparse.Namespace, prompts: list[str],
                 params: SamplingParams, template: str | None,
                 images: list[tuple[str, Any]], videos: list[tuple[str, Any]],
                 run: dict[str, Any]) -> list[Any]:
    """The outputs of ``prompts`` on ``llm``: with ``--chat`` one user message each (the
    images and videos as ``image_url`` / ``video_url`` parts before the text), else plain
    prompts (with ``multi_modal_data`` when there are images or videos); ``run`` holds
    ``generate`` / ``chat``'s further arguments.

    Raises:
        ValueError: from the engine, naming the ``--image`` / ``--video`` file when the
            model's own limits refuse one (aspect ratio).
    """
    from kvflow.multimodal.video import VideoError

    try:
        if args.chat:
            parts = [*({"type": "image_url", "image_url": {"url": url}} for url, _ in images),
                     *({"type": "video_url", "video_url": {"url": url}} for url, _ in videos)]
            return llm.chat([[{"role": "user", "content": [*parts, {"type": "text",
                                                                     "text": p}]
                              if parts else p}] for p in prompts], params,
                            chat_template=template, **run)
        if images or videos:
            media = {"image": [image for _, image in images],
                     "video": [frames for _, frames in videos]}
            media = {kind: items for kind, items in media.items() if items}
            return llm.generate([{"prompt": p, "multi_modal_data": media} for p in prompts],
                                params, **run)
        return llm.generate(prompts, params, **run)
    except ValueError as e:  # the model's own limits (aspect ratio): name the file
        flag, files = ("--video", args.video) if isinstance(e, VideoError) else \
            ("--image", args.image)
        index = getattr(e, "image_index", None)
        if index is None or not 0 <= index < len(files or []):
            raise
        raise ValueError(f"{flag} {files[index]}: {e}") from None


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
    limits before the model loads; the data URL's type is the bytes' format, not the file
    name's.

    Raises:
        ValueError: for a file that cannot be read, or an image the limits refuse.
    """
    from kvflow.multimodal.media import decode_image_bytes, image_format

    return _read_media("--image", paths,
                       lambda data: decode_image_bytes(data, config.multimodal_config),
                       lambda path, data: f"image/{image_format(data)}")


def _read_videos(paths: list[str], config: EngineConfig) -> list[tuple[str, Any]]:
    """(data URL, RGB PIL frames) of each ``--video`` file (a video file decoded with PyAV,
    ``media_io_kwargs`` ``video.num_frames`` frames sampled uniformly), checked against the
    limits before the model loads.

    Raises:
        ValueError: for a file that cannot be read, PyAV not installed (``pip install
            'kvflow[video]'``), or a video the limits or the decoder refuse.
    """
    from kvflow.multimodal.video import PyAVMissingError, decode_video_bytes

    def decode(data: bytes) -> Any:
        """The frames of video file bytes ``data``.

        Raises:
            ValueError: without PyAV (worded for the command line), or a refused video.
        """
        try:
            return decode_video_bytes(data, config.multimodal_config)
        except PyAVMissingError:  # its own hint is for an API client (video_url parts)
            raise ValueError("decoding video files needs PyAV, which is not installed: pip "
                             "install 'kvflow[video]' (or extract the frames and pass them "
                             "as --image files, which the model then reads as separate "
                             "images, not as one video)") from None

    return _read_media("--video", paths, decode, _video_media_type)


def _video_media_type(path: str, data: bytes) -> str:
    """The data URL type of a ``--video`` file: the file name's ``video/*`` type, but never
    ``video/jpeg`` (vLLM's base64-frames form; a file here is one encoded video), else
    ``video/mp4``."""
    import mimetypes

    guess = mimetypes.guess_type(path)[0] or ""
    return guess if guess.startswith("video/") and guess != "video/jpeg" else "video/mp4"


def _read_media(flag: str, paths: list[str], decode: Callable[[bytes], Any],
                media_type: Callable[[str, bytes], str]) -> list[tuple[str, Any]]:
    """(data URL, ``decode(bytes)``) of each file that ``flag`` (``--image`` / ``--video``)
    names; ``media_type(path, bytes)`` is the data URL's type.

    Raises:
        ValueError: naming the flag and the file, when it cannot be read or ``decode``
            raises a ValueError.
    """
    import base64

    out = []
    for path in paths:
        data = _read_file(flag, path)
        try:
            decoded = decode(data)
        except ValueError as e:
            raise ValueError(f"{flag} {path}: {e}") from None
        url = f"data:{media_type(path, data)};base64,{base64.b64encode(data).decode()}"
        out.append((url, decoded))
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
