"""The flag checks of ``kvflow bench serve``: every bad flag is refused, naming it, before
anything is loaded or sent."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any
from urllib.parse import urlsplit

from kvflow.bench.checks import ensure_parent_dir, require_positive
from kvflow.bench.datasets import parse_image_size, parse_length_dist
from kvflow.bench.result_file import check_result_flags
from kvflow.bench.sharegpt import is_json_array_file

# The largest seed of numpy's legacy generator (np.random.RandomState), which draws the
# arrival gaps as vLLM's benchmark does
MAX_SEED = 2**32 - 1


def parse_rates(spec: str) -> list[float]:
    """``"1,2,inf"`` -> [1.0, 2.0, inf]. Raises ValueError for anything but positive numbers
    or inf."""
    try:
        rates = [float(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        rates = []
    if not rates or any(not r > 0 for r in rates):  # NaN fails r > 0
        raise ValueError(f"bad --sweep-rates {spec!r}: give positive numbers or inf, "
                         f"comma-separated")
    return rates


def check_base_url(url: str) -> None:
    """``--base-url`` must be an http(s) URL with a host (and a valid port, if any); a server
    that does not answer there is found later, by the probe request.

    Raises:
        ValueError: naming ``--base-url`` for anything else.
    """
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a port that is not 0-65535)
    except ValueError as e:
        raise ValueError(f"--base-url {url!r}: not a URL ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--base-url {url!r}: not an http(s) URL with a host; give the "
                         "server's root, e.g. http://127.0.0.1:8000")


def check_args(args: argparse.Namespace) -> None:
    """Reject bad flags before anything is loaded or sent. Raises ValueError naming the flag."""
    check_base_url(args.base_url)
    _check_length_flags(args)
    _check_dataset_flags(args)
    require_positive(num_prompts=args.num_prompts, output_len=args.output_len,
                     input_len=args.input_len if args.dataset in ("random", "random-image")
                     else None,
                     max_concurrency=args.max_concurrency, request_rate=args.request_rate,
                     sharegpt_output_len=args.sharegpt_output_len,
                     request_timeout=args.request_timeout)
    _check_seed(args)
    _check_workload_args(args)
    if not args.burstiness > 0:  # NaN fails too; inf = evenly spaced arrivals
        raise ValueError(f"--burstiness must be a positive number or inf, got "
                         f"{args.burstiness}")
    _check_extra_body(args.extra_body)
    _check_rate_flags(args)
    for path in args.compare or []:
        load_compare(path)
    ensure_parent_dir(args.result_json, "--result-json")
    check_result_flags(args)
    ensure_parent_dir(args.plot, "--plot")


def _check_seed(args: argparse.Namespace) -> None:
    """Raises ValueError naming ``--seed`` for one below 0, or one whose last sweep rate's
    seed (a sweep's i-th rate uses seed + i) numpy's legacy generator cannot take: the arrival
    gaps are drawn from ``np.random.RandomState(seed)`` (vLLM's generator), which takes seeds
    below 2**32."""
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    num_rates = len(parse_rates(args.sweep_rates)) if args.sweep_rates else 1
    if args.seed + num_rates - 1 > MAX_SEED:
        raise ValueError(f"--seed must be <= {MAX_SEED - num_rates + 1} (numpy's legacy "
                         f"generator takes seeds below 2**32; the i-th rate of --sweep-rates "
                         f"uses --seed + i), got {args.seed}")


def _check_workload_args(args: argparse.Namespace) -> None:
    """Raises ValueError naming the flag for a dataset flag the chosen ``--dataset`` would
    ignore or a bad value of one it reads (``_check_random_args``, ``_check_image_args``,
    ``_check_synthetic_chat_args``)."""
    if args.sharegpt_output_len is not None and (
            args.dataset in ("random", "random-image", "synthetic-chat")
            or not is_json_array_file(args.dataset)):
        raise ValueError("--sharegpt-output-len applies to a ShareGPT JSON file only; "
                         f"--dataset {args.dataset} is not one, so it would be ignored")
    if args.dataset == "random" and args.random_vocab_size is not None \
            and args.random_vocab_size < 4:
        raise ValueError(f"--random-vocab-size must be >= 4 (ids are drawn from [3, size)), got "
                         f"{args.random_vocab_size}")
    if args.dataset == "random":
        _check_random_args(args)
    if args.dataset == "random-image":
        _check_image_args(args)
    if args.dataset == "synthetic-chat":
        _check_synthetic_chat_args(args)


def _check_extra_body(extra_body: str | None) -> None:
    """Raises ValueError naming ``--extra-body`` unless it is None or a JSON object."""
    if extra_body is None:
        return
    try:
        extra = json.loads(extra_body)
    except ValueError as e:
        raise ValueError(f"--extra-body is not valid JSON: {e}") from e
    if not isinstance(extra, dict):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
            "--extra-body must be a JSON object, e.g. '{\"top_k\": 5}'")


def _check_rate_flags(args: argparse.Namespace) -> None:
    """Raises ValueError for a bad ``--sweep-rates`` ("" too: an empty sweep would run only
    the default) or one given with ``--request-rate``."""
    if args.sweep_rates is None:
        return
    parse_rates(args.sweep_rates)
    if args.request_rate is not None:
        raise ValueError("give --request-rate (one run) or --sweep-rates (one run per "
                         "rate), not both")


def _check_length_flags(args: argparse.Namespace) -> None:
    """``--input-len`` / ``--output-len`` left out become 128 / 64. Raises ValueError for one
    given with a dataset that would ignore it: prompts of every dataset but random and
    random-image are its own, and synthetic-chat / ShareGPT requests take their output
    lengths from ``--output-len-dist`` / the file (or ``--sharegpt-output-len``)."""
    generated = args.dataset in ("random", "random-image")
    if args.input_len is not None and not generated:
        raise ValueError(f"--input-len sets the prompt length of --dataset random and "
                         f"random-image only; --dataset {args.dataset} brings its own prompts "
                         "(synthetic-chat: --system-len, --user-len), so it would be ignored")
    if args.output_len is not None and not generated and (
            args.dataset == "synthetic-chat" or is_json_array_file(args.dataset)):
        other = ("--output-len-dist (e.g. uniform:64:64 for 64 every time)"
                 if args.dataset == "synthetic-chat" else "--sharegpt-output-len")
        raise ValueError(f"--output-len is not read by --dataset {args.dataset} (it would be "
                         f"ignored): use {other}")
    args.input_len = 128 if args.input_len is None else args.input_len
    args.output_len = 64 if args.output_len is None else args.output_len


# flag (argparse dest) -> (the one dataset that reads it, its default there)
DATASET_FLAGS = {
    "image_size": ("random-image", "448x448"), "image_fraction": ("random-image", 0.5),
    "num_unique_images": ("random-image", 0), "num_system_prompts": ("synthetic-chat", 4),
    "system_len": ("synthetic-chat", "uniform:200:400"),
    "user_len": ("synthetic-chat", "uniform:16:256"),
    "output_len_dist": ("synthetic-chat", "uniform:32:128"),
    "random_range_ratio": ("random", 0.0), "random_prefix_len": ("random", 0),
}


def _check_dataset_flags(args: argparse.Namespace) -> None:
    """Each of one dataset's own flags left out takes its default. Raises ValueError for one
    given with another dataset, which would ignore it."""
    for dest, (dataset, default) in DATASET_FLAGS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
        elif args.dataset != dataset:
            raise ValueError(f"--{dest.replace('_', '-')} applies to --dataset {dataset} "
                             f"only; --dataset {args.dataset} would ignore it")


def _check_synthetic_chat_args(args: argparse.Namespace) -> None:
    """Raises ValueError naming the flag for a bad synthetic-chat workload."""
    if args.num_system_prompts < 1:
        raise ValueError(f"--num-system-prompts must be >= 1, got {args.num_system_prompts}")
    for flag, spec, least in (("--system-len", args.system_len, 0),
                              ("--user-len", args.user_len, 1),
                              ("--output-len-dist", args.output_len_dist, 1)):
        try:
            dist = parse_length_dist(spec)
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from None
        if dist.low < least:
            raise ValueError(f"{flag} {spec!r}: LOW must be >= {least}")


def _check_random_args(args: argparse.Namespace) -> None:
    """Raises ValueError naming the flag for a bad ``--random-range-ratio`` (vLLM's: [0, 1)) or
    ``--random-prefix-len``, or for a pair with ``--input-len`` that can draw an empty
    prompt."""
    if not 0.0 <= args.random_range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if args.random_prefix_len < 0:
        raise ValueError(f"--random-prefix-len must be >= 0, got {args.random_prefix_len}")
    if args.random_prefix_len + math.floor(args.input_len * (1 - args.random_range_ratio)) < 1:
        raise ValueError(f"--input-len {args.input_len} with --random-range-ratio "
                         f"{args.random_range_ratio} can draw an empty prompt: raise "
                         "--input-len or --random-prefix-len, or lower the ratio")


def _check_image_args(args: argparse.Namespace) -> None:
    """Raises ValueError naming the flag for a bad random-image workload."""
    parse_image_size(args.image_size)
    if not 0.0 <= args.image_fraction <= 1.0:
        raise ValueError(f"--image-fraction must be in [0, 1], got {args.image_fraction}")
    if args.num_unique_images < 0:
        raise ValueError(f"--num-unique-images must be >= 0, got {args.num_unique_images}")
    if args.endpoint != "chat":
        raise ValueError("--dataset random-image sends images in chat messages: use "
                         "--endpoint chat")


def load_compare(path: str) -> tuple[str, list[dict[str, Any]]]:
    """The label and runs of another server's sweep result (``--compare``).

    Raises:
        ValueError: naming the flag and the file if it cannot be read or is not a sweep.
    """
    from kvflow.bench.plot import load_sweep

    try:
        return load_sweep(path)
    except OSError as e:
        raise ValueError(f"--compare {path}: cannot read it ({e.strerror})") from None
    except ValueError as e:
        raise ValueError(f"--compare {path}: not a kvflow bench serve result ({e})") from None
