"""ShareGPT-format datasets for ``kvflow bench serve``: the JSON file vLLM's serving benchmark
reads with ``--dataset-name sharegpt`` (e.g. ShareGPT_V3_unfiltered_cleaned_split.json), sampled
by the same rules, so both benchmarks send the same requests for the same ``--seed``.

A file is a JSON array of objects with ``"conversations": [{"from": ..., "value": text}, ...]``.
Sampling (vLLM's definition): keep the conversations with at least two turns, shuffle them with
Python's ``random`` seeded by ``--seed``, then take them in order: the first turn is the prompt,
the second turn's token count is the output length (``max_tokens``; or ``--sharegpt-output-len``
for every request), skipping a conversation whose prompt or output has fewer than 4 tokens (the
output check is skipped for a fixed output length), whose prompt has more than 1024 tokens, or
whose prompt and output together have more than 2048, until ``--num-prompts`` are taken. Token
counts use the tokenizer with its special tokens, as vLLM's.
"""

from __future__ import annotations

import json
import random
from typing import Any

from kvflow.bench.datasets import BenchRequest

MIN_SEQ_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048


def is_json_array_file(path: str) -> bool:
    """Whether the file's first non-blank character is ``[`` (a JSON array, as a ShareGPT
    file, rather than JSON lines). False for a file that cannot be read (the JSON-lines reader
    reports it)."""
    try:
        with open(path, encoding="utf-8") as f:
            while chunk := f.read(4096):
                stripped = chunk.lstrip()
                if stripped:
                    return stripped[0] == "["
    except (OSError, UnicodeDecodeError):
        return False
    return False


def load_sharegpt(path: str, num: int, tokenizer: Any, seed: int,
                  output_len: int | None = None, shuffle: bool = True) -> list[BenchRequest]:
    """Up to ``num`` requests sampled from a ShareGPT file (rules in the module docstring).

    Args:
        path: the JSON file.
        num: requests wanted (fewer when fewer conversations qualify).
        tokenizer: a Hugging Face tokenizer (counts prompt and output tokens).
        seed: seeds the shuffle (``random.Random(seed).shuffle``).
        output_len: a fixed ``max_tokens`` for every request; None takes each conversation's
            second turn length.
        shuffle: False keeps the file's order (vLLM's ``--disable-shuffle``).

    Raises:
        ValueError: naming ``--dataset`` and the file when it cannot be read, is not a JSON
            array of objects, or a turn's ``value`` is not text; or when no tokenizer is given.
    """
    if tokenizer is None:
        raise ValueError(f"--dataset {path}: a ShareGPT file needs a tokenizer to count prompt "
                         "and output tokens: give --tokenizer")
    conversations = _conversations(path)
    if shuffle:
        random.Random(seed).shuffle(conversations)
    requests: list[BenchRequest] = []
    for turns in conversations:
        if len(requests) >= num:
            break
        prompt, completion = turns[0]["value"], turns[1]["value"]
        prompt_len = len(tokenizer(prompt).input_ids)
        out_len = output_len if output_len is not None else \
            len(tokenizer(completion).input_ids)
        if prompt_len < MIN_SEQ_LEN or (output_len is None and out_len < MIN_SEQ_LEN):
            continue
        if prompt_len > MAX_PROMPT_LEN or prompt_len + out_len > MAX_TOTAL_LEN:
            continue
        requests.append(BenchRequest(prompt, prompt_len, out_len))
    return requests


def _conversations(path: str) -> list[list[dict[str, Any]]]:
    """The turn lists of the file's conversations with at least two turns, in file order."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"--dataset {path}: not a readable ShareGPT JSON file "
                         f"({e.__class__.__name__}: {e})") from None
    if not isinstance(data, list) or not all(isinstance(d, dict) for d in data):
        raise ValueError(f"--dataset {path}: a ShareGPT file is a JSON array of objects with "
                         "\"conversations\"")
    kept = []
    for i, entry in enumerate(data):
        turns = entry.get("conversations")
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        if not all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns[:2]):
            raise ValueError(f"--dataset {path}: entry {i}: the first two turns need a text "
                             "\"value\"")
        kept.append(turns)
    return kept
