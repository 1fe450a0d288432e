"""The workload of ``kvflow bench serve``: its requests from ``--dataset`` and the tokenizer
that counts tokens when a server sends no usage."""

from __future__ import annotations

import argparse
import random
from typing import Any

from kvflow.bench.datasets import (
    BenchRequest,
    load_jsonl,
    parse_image_size,
    parse_length_dist,
    random_image_requests,
    random_requests,
    synthetic_chat_requests,
)
from kvflow.bench.sharegpt import is_json_array_file, load_sharegpt


def build_requests(args: argparse.Namespace, tokenizer_factory) -> list[BenchRequest]:
    """The workload of ``args.dataset``. Random prompts are token ids for the completions
    endpoint and the tokenizer's decoding of them for chat. A JSONL file's requests are
    shuffled with ``random.Random(args.seed)`` before the first ``args.num_prompts`` are
    taken (vLLM's custom dataset), unless ``args.disable_shuffle``.

    Raises:
        ValueError: for random prompts on the chat endpoint without a tokenizer, a JSONL
            dataset with chat messages on the completions endpoint, a dataset file that cannot
            be read or has a bad line, a ShareGPT file without a tokenizer or without a
            qualifying conversation, or a bad length distribution.
    """
    if args.dataset == "random":
        return _random_requests(args, tokenizer_factory)
    if args.dataset == "random-image":
        if args.endpoint != "chat":
            raise ValueError("--dataset random-image sends images in chat messages: use "
                             "--endpoint chat")
        return random_image_requests(
            args.num_prompts, args.input_len, args.output_len,
            parse_image_size(args.image_size), args.image_fraction, args.num_unique_images,
            seed=args.seed)
    if args.dataset == "synthetic-chat":
        return synthetic_chat_requests(
            args.num_prompts, args.num_system_prompts, parse_length_dist(args.system_len),
            parse_length_dist(args.user_len), parse_length_dist(args.output_len_dist),
            seed=args.seed)
    if is_json_array_file(args.dataset):
        return _sharegpt_requests(args, tokenizer_factory)
    return _jsonl_requests(args)


def _random_requests(args: argparse.Namespace, tokenizer_factory) -> list[BenchRequest]:
    """``--dataset random``: random token ids (from ``--random-vocab-size``, else the
    tokenizer's vocabulary, else 32,000 ids), decoded to text for the chat endpoint.

    Raises:
        ValueError: on the chat endpoint without a tokenizer.
    """
    vocab = args.random_vocab_size
    if vocab is None:
        tok = tokenizer_factory()
        vocab = len(tok) if tok is not None else 32000
    reqs = random_requests(args.num_prompts, args.input_len, args.output_len,
                           vocab_size=vocab, seed=args.seed,
                           range_ratio=args.random_range_ratio,
                           prefix_len=args.random_prefix_len)
    if args.endpoint == "chat":
        tok = tokenizer_factory()
        if tok is None:
            raise ValueError("--dataset random with --endpoint chat needs a tokenizer "
                             "(--tokenizer)")
        reqs = [BenchRequest(tok.decode(r.prompt), r.prompt_len, r.output_len)
                for r in reqs]
    return reqs


def _sharegpt_requests(args: argparse.Namespace, tokenizer_factory) -> list[BenchRequest]:
    """A ShareGPT JSON file's qualifying conversations (:func:`load_sharegpt`).

    Raises:
        ValueError: for a file that cannot be read, no tokenizer, or no qualifying
            conversation.
    """
    reqs = load_sharegpt(args.dataset, args.num_prompts, tokenizer_factory(), args.seed,
                         args.sharegpt_output_len, shuffle=not args.disable_shuffle)
    if not reqs:
        raise ValueError(f"--dataset {args.dataset}: no conversation qualifies (two turns, "
                         "a prompt of 4-1024 tokens, an output of >= 4, 2048 in all)")
    return reqs


def _jsonl_requests(args: argparse.Namespace) -> list[BenchRequest]:
    """A JSONL file's requests, shuffled with ``random.Random(args.seed)`` (unless
    ``--disable-shuffle``), then the first ``--num-prompts`` (vLLM's custom dataset).

    Raises:
        ValueError: for a file that cannot be read, a bad line, no request, or chat messages
            on the completions endpoint.
    """
    reqs = load_jsonl(args.dataset, args.output_len)
    if not reqs:
        raise ValueError(f"--dataset {args.dataset}: the file holds no requests (only blank "
                         "lines)")
    if not args.disable_shuffle:  # vLLM's custom JSONL dataset: seeded shuffle, first N
        random.Random(args.seed).shuffle(reqs)
    if args.num_prompts < len(reqs):
        reqs = reqs[:args.num_prompts]
    if args.endpoint == "completions" and any(r.messages for r in reqs):
        raise ValueError(f"{args.dataset} has chat messages: use --endpoint chat")
    return reqs


def make_tokenizer_factory(name: str | None, flag: str | None = None):
    """A memoizing zero-argument callable returning the tokenizer of ``name`` (a packaged model,
    HF folder, GGUF file, hub id or tokenizer folder), or None when it cannot be loaded - unless
    ``name`` came from ``flag`` (``--tokenizer``, asked for by name): then that is an error.

    Raises:
        ValueError: from the callable, naming ``flag`` and why, when ``flag`` is given and no
            tokenizer loads from ``name``.
    """
    cache: dict[str, Any] = {}

    def get() -> Any:
        if "tok" not in cache:
            cache["tok"] = _load_tokenizer(name, flag) if name else None
        return cache["tok"]

    return get


def _load_tokenizer(name: str, flag: str | None) -> Any:
    from kvflow.models.loader import load_tokenizer
    from kvflow.models.model_resolver import resolve_model

    try:
        return load_tokenizer(resolve_model(name))
    except Exception as e:  # noqa: BLE001 - not a local model: try the hub cache
        why = e
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(name)
        except Exception:  # noqa: BLE001
            if flag is None:
                return None
            raise ValueError(f"{flag} {name}: no tokenizer loads from it ({why})") from None
