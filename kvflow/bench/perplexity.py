"""``kvflow bench perplexity``: perplexity of a model (as configured: ``--quantization``,
``--kv-cache-dtype``, ``--dtype``) on a fixed public-domain text, through the engine's own
forward pass.

The text (default: ``tests/data/opticks_excerpt.txt``, from Newton's *Opticks*, about 4,000
tokens) is tokenized once and cut into non-overlapping windows of ``--window`` tokens (at most
the engine's max_model_len: a larger one is refused; default 512, capped by it); each
window is one request with ``prompt_logprobs=0`` and ``max_tokens=1``, so every token but a
window's first is scored given the tokens before it in its window. Perplexity is
``exp(-mean log p)`` over all scored tokens (the usual fixed-window evaluation, e.g. Hugging
Face's "Perplexity of fixed-length models" guide, without a stride).

It also reports the weight bytes, the KV-cache bytes per token, and greedy continuations of
``--num-greedy-prompts`` prompts taken from the text (``--greedy-tokens`` tokens each);
``--compare BASE.json`` (a previous run's ``--output-json``) adds the perplexity ratio and the
greedy agreement: the fraction of positions where both runs chose the same token.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from kvflow.bench.checks import (
    ensure_parent_dir,
    is_finite_positive,
    read_text_file,
    require_one_engine,
    require_positive,
)
from kvflow.config import EngineConfig
from kvflow.lora.path_flag import add_lora_path_arg, lora_request_from_flags

DEFAULT_WINDOW = 512  # tokens per scored window when --window is not given
DEFAULT_TEXT = Path(__file__).resolve().parents[2] / "tests" / "data" / "opticks_excerpt.txt"


def windows(token_ids: list[int], window: int) -> list[list[int]]:
    """Non-overlapping windows of ``window`` tokens (a last window shorter than 2 tokens, which
    would score nothing, is dropped)."""
    chunks = [token_ids[i:i + window] for i in range(0, len(token_ids), window)]
    return [c for c in chunks if len(c) >= 2]


def perplexity_of(llm: Any, chunks: list[list[int]],
                  lora_request: Any = None) -> tuple[float, int]:
    """(perplexity, scored tokens) of the windows through ``llm``'s prompt logprobs (with
    ``lora_request``'s adapter when given)."""
    from kvflow.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    total, count = 0.0, 0
    for out in llm.generate(chunks, params, use_tqdm=False, lora_request=lora_request):
        for token_id, step in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
            total += step[token_id].logprob
            count += 1
    return math.exp(-total / count), count


def greedy_agreement(ours: list[list[int]], base: list[list[int]]) -> float:
    """Fraction of positions at which two runs' greedy continuations hold the same token."""
    pairs = [(a, b) for x, y in zip(ours, base) for a, b in zip(x, y)]
    return sum(a == b for a, b in pairs) / max(1, len(pairs))


def _greedy(llm: Any, token_ids: list[int], num_prompts: int, num_tokens: int,
            lora_request: Any = None) -> list[list[int]]:
    from kvflow.sampling_params import SamplingParams

    step = max(1, len(token_ids) // (num_prompts + 1))
    prompts = [token_ids[i * step:i * step + 32] for i in range(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids
            for o in llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)]


def scoring_window(window: int | None, max_model_len: int, note: str = "") -> int:
    """Tokens per scored window: ``window`` (``--window``), or when None the default
    ``DEFAULT_WINDOW`` capped by the engine's ``max_model_len`` (tokens).

    Raises:
        ValueError: naming ``--window`` and the limit when ``window`` exceeds
            ``max_model_len`` (a window is one request; ``note`` says why the limit is lower
            than the model's context, e.g. a small KV cache).
    """
    if window is None:
        return min(DEFAULT_WINDOW, max_model_len)
    if window > max_model_len:
        raise ValueError(f"--window {window} exceeds the engine's max_model_len "
                         f"{max_model_len}{note}: give --window {max_model_len} or less")
    return window


def run_perplexity(llm: Any, text: str, window: int | None, num_greedy: int,
                   greedy_tokens: int, source: str = "the text",
                   lora_request: Any = None) -> dict[str, Any]:
    """Everything the command reports, as a JSON-ready dict (every request through
    ``lora_request``'s adapter when given). ``window``: see :func:`scoring_window`.

    Raises:
        ValueError: naming ``source`` when the text has fewer than 2 tokens (nothing to
            score); naming ``--window`` when it exceeds the engine's max_model_len.
    """
    core = llm.engine.core
    window = scoring_window(window, core.max_model_len, core.max_model_len_note)
    token_ids = llm.get_tokenizer().encode(text)
    chunks = windows(token_ids, window)
    if not chunks:
        raise ValueError(f"{source} has {len(token_ids)} token(s): at least 2 are needed to "
                         "score one")
    start = time.perf_counter()
    ppl, scored = perplexity_of(llm, chunks, lora_request)
    seconds = time.perf_counter() - start
    return {"perplexity": ppl, "scored_tokens": scored, "window": window, "seconds": seconds,
            "weight_bytes": core.weight_bytes, "kv_bytes_per_token": core.kv_bytes_per_token,
            "greedy": _greedy(llm, token_ids, num_greedy, greedy_tokens, lora_request)
            if num_greedy else []}


def load_compare(path: str) -> dict[str, Any]:
    """A previous run's ``--output-json`` (``--compare``).

    Raises:
        ValueError: naming the flag and the file when it cannot be read or is not such a
            result (a positive ``perplexity`` and a ``greedy`` list of token-id lists).
    """
    try:
        base = json.loads(read_text_file(path, "--compare"))
    except json.JSONDecodeError as e:
        raise ValueError(f"--compare {path}: not JSON ({e})") from None
    greedy = base.get("greedy") if isinstance(base, dict) else None
    ppl = base.get("perplexity") if isinstance(base, dict) else None
    if not (isinstance(ppl, (int, float)) and is_finite_positive(ppl)
            and isinstance(greedy, list) and all(isinstance(g, list) for g in greedy)):
        raise ValueError(f"--compare {path}: not a kvflow bench perplexity --output-json "
                         "result (it needs a positive \"perplexity\" and a \"greedy\" list)")
    return base


def _cmd_perplexity(args: argparse.Namespace) -> int:
    from kvflow.offline.llm import LLM

    require_positive(window=args.window, greedy_tokens=args.greedy_tokens)
    if args.window is not None and args.window < 2:
        raise ValueError(f"--window must be >= 2, got {args.window}")
    if args.num_greedy_prompts < 0:
        raise ValueError(f"--num-greedy-prompts must be >= 0 (0: no greedy check), got "
                         f"{args.num_greedy_prompts}")
    ensure_parent_dir(args.output_json, "--output-json")
    require_one_engine(args.data_parallel_size, "perplexity")
    text = read_text_file(args.text_file, "--text-file")
    if not text.strip():
        raise ValueError(f"--text-file {args.text_file}: the file is empty; give a text to "
                         "score")
    base = load_compare(args.compare) if args.compare else None
    config = EngineConfig.from_cli_args(args)
    lora = lora_request_from_flags(args.lora_path, config.lora_config.enable_lora,
                                   "kvflow bench perplexity")
    llm = LLM.from_engine_config(config)
    result = run_perplexity(llm, text, args.window, args.num_greedy_prompts, args.greedy_tokens,
                            source=f"--text-file {args.text_file}", lora_request=lora)
    result.update(model=args.model, lora_path=args.lora_path, quantization=args.quantization,
                  kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"), dtype=args.dtype)
    print(f"perplexity {result['perplexity']:.4f} over {result['scored_tokens']} tokens "
          f"(windows of {result['window']}, {result['seconds']:.1f} s)")
    print(f"weights {result['weight_bytes'] / 2**20:.1f} MiB, KV cache "
          f"{result['kv_bytes_per_token']} bytes/token")
    if base is not None:
        result["perplexity_ratio"] = result["perplexity"] / base["perplexity"]
        result["greedy_agreement"] = greedy_agreement(result["greedy"], base["greedy"])
        print(f"vs {args.compare}: perplexity x{result['perplexity_ratio']:.4f} "
              f"({(result['perplexity_ratio'] - 1) * 100:+.2f}%), greedy agreement "
              f"{result['greedy_agreement'] * 100:.1f}% over {args.greedy_tokens} tokens")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1))
    return 0


def add_perplexity_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("perplexity", help="perplexity on a fixed text (accuracy gate)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text-file", default=str(DEFAULT_TEXT), help="UTF-8 text to score")
    p.add_argument("--window", type=int, default=None,
                   help=f"tokens per scored window (default: {DEFAULT_WINDOW}, or the "
                   "engine's max_model_len when that is smaller; a larger --window is "
                   "refused)")
    p.add_argument("--num-greedy-prompts", type=int, default=4,
                   help="prompts (from the text) for the greedy-agreement check; 0: none")
    p.add_argument("--greedy-tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--compare", default=None, help="a previous run's --output-json")
    p.add_argument("--output-json", default=None, help="write the results here (JSON)")
    add_lora_path_arg(p, "every request")
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=_cmd_perplexity)
