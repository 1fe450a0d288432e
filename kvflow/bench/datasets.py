"""Benchmark workloads: request arrival times and prompt datasets.

- ``arrival_intervals``: gaps between request arrivals, gamma-distributed with shape
  ``burstiness`` and mean ``1 / rate`` (shape 1 = a Poisson process; < 1 burstier, > 1 more
  regular), as in vLLM's serving benchmark.
- ``random_requests``: prompts of random token ids (exact prompt lengths).
- ``synthetic_chat_requests``: chat conversations that share a few long system prompts and have
  varied user turns, so prefix caching and mixed lengths are exercised. Lengths are counted in
  words of a fixed English vocabulary (about 1.3 tokens per word with a BPE tokenizer).
- ``random_image_requests``: chat requests of which a given share carries one random-pixel
  image (PNG data URL) of a fixed size before its text, for vision-language models; images
  may repeat (a pool of distinct images) to exercise the encoder cache.
- ``load_jsonl``: one request per line of a user file.
"""

from __future__ import annotations

import base64
import io
import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_VOCABULARY = ("the of and to in is that for it as was with be by on not he this are or his from "
          "at which but have an they you were her she there been one all we their has would "
          "when if so what out up more who can time some could them into only then now after "
          "over also new most may such first well any these way our where many before must "
          "through back years much should still between own never same another while last "
          "might great since against right three world under house again place small found "
          "thought went large water every light night point early kind cache block token page "
          "model server request batch queue memory engine prefix decode prefill layer")
_WORDS = tuple(_VOCABULARY.split())


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload.

    Attributes:
        prompt: text, or token ids (completions endpoint only).
        prompt_len: prompt length in tokens (words for synthetic chat before tokenization;
            0 when unknown).
        output_len: ``max_tokens`` to ask for.
        messages: chat messages (chat endpoint); built from ``prompt`` when None. A
            message's ``content`` is text or a list of OpenAI content parts (``text``,
            ``image_url``).
        num_images: images the request carries.
    """

    prompt: str | list[int]
    prompt_len: int
    output_len: int
    messages: list[dict[str, Any]] | None = field(default=None)
    num_images: int = 0


@dataclass(frozen=True)
class LengthDist:
    """A length distribution: ``uniform`` on [low, high], or ``normal``/``lognormal`` with the
    given mean and standard deviation, clipped to [low, high]. Units are the caller's (tokens
    or words)."""

    kind: str = "uniform"
    low: int = 16
    high: int = 256
    mean: float = 0.0
    std: float = 0.0

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` integer lengths in [low, high]. Raises ValueError for an unknown kind."""
        if self.kind == "uniform":
            values = rng.integers(self.low, self.high + 1, n)
        elif self.kind == "normal":
            values = rng.normal(self.mean, self.std, n)
        elif self.kind == "lognormal":
            sigma2 = np.log1p((self.std / self.mean) ** 2)
            values = rng.lognormal(np.log(self.mean) - sigma2 / 2, np.sqrt(sigma2), n)
        else:
            raise ValueError(f"unknown length distribution {self.kind!r}")
        return np.clip(np.rint(values), self.low, self.high).astype(int)


def parse_length_dist(spec: str) -> LengthDist:
    """``"uniform:LOW:HIGH"``, ``"normal:MEAN:STD:LOW:HIGH"`` or
    ``"lognormal:MEAN:STD:LOW:HIGH"`` -> LengthDist.

    Raises:
        ValueError: on a malformed spec, or bounds that are not 0 <= LOW <= HIGH, a STD that
            is not a finite number >= 0, or a lognormal MEAN that is not > 0.
    """
    kind, *nums = spec.split(":")
    dist = None
    try:
        if kind == "uniform" and len(nums) == 2:
            dist = LengthDist("uniform", int(nums[0]), int(nums[1]))
        elif kind in ("normal", "lognormal") and len(nums) == 4:
            dist = LengthDist(kind, int(nums[2]), int(nums[3]), float(nums[0]), float(nums[1]))
    except ValueError:
        pass
    if dist is None:
        raise ValueError(f"bad length distribution {spec!r}: use uniform:LOW:HIGH or "
                         "normal|lognormal:MEAN:STD:LOW:HIGH")
    if not 0 <= dist.low <= dist.high:
        raise ValueError(f"bad length distribution {spec!r}: need 0 <= LOW <= HIGH")
    if not (0 <= dist.std < np.inf and np.isfinite(dist.mean)):
        raise ValueError(f"bad length distribution {spec!r}: MEAN must be a number and STD a "
                         "number >= 0")
    if kind == "lognormal" and not dist.mean > 0:
        raise ValueError(f"bad length distribution {spec!r}: a lognormal MEAN must be > 0")
    return dist


def arrival_intervals(num_requests: int, rate: float, burstiness: float = 1.0,
                      seed: int = 0) -> np.ndarray:
    """Seconds to wait before each request (float64, length ``num_requests``).

    Gamma(shape=burstiness, scale=1 / (rate * burstiness)) gaps have mean ``1 / rate``;
    shape 1 gives exponential gaps (Poisson arrivals), ``burstiness=inf`` equal gaps of
    ``1 / rate`` (the limit; vLLM accepts it too). As in vLLM's serving benchmark the
    gaps are then scaled so that they sum to exactly ``num_requests / rate``: the last request
    is sent at that time, so every seed offers the load ``rate`` (unscaled, 64 Poisson gaps
    sum to within +-12.5% (one standard deviation) of it). ``rate=inf`` sends everything at
    once. The draws come from numpy's legacy generator seeded with ``seed``
    (``np.random.RandomState``; vLLM seeds the global one with ``np.random.seed(seed)`` and
    draws each gap from it), so one ``seed`` gives the send times of ``vllm bench serve
    --seed`` (before 2026-12-07 they came from ``np.random.default_rng(seed)``: other times).

    Raises:
        ValueError: for a non-positive rate or burstiness.
    """
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate ({rate}) and burstiness ({burstiness}) must be > 0")
    if np.isinf(rate):
        return np.zeros(num_requests)
    if np.isinf(burstiness):
        return np.full(num_requests, 1.0 / rate)
    gaps = np.random.RandomState(seed).gamma(burstiness, 1.0 / (rate * burstiness),
                                             num_requests)
    total = gaps.sum()
    return gaps * (num_requests / rate / total) if total > 0 else gaps


def random_lengths(num: int, length: int, range_ratio: float, rng: np.random.Generator,
                   least: int = 0) -> np.ndarray:
    """``num`` lengths drawn uniformly from the integers of [floor(length * (1 - range_ratio)),
    ceil(length * (1 + range_ratio))], both raised to ``least`` (vLLM's
    ``get_sampling_params``; ``range_ratio`` 0 draws nothing from ``rng``)."""
    if range_ratio == 0:
        return np.full(num, max(length, least))
    low = max(math.floor(length * (1 - range_ratio)), least)
    high = max(math.ceil(length * (1 + range_ratio)), least)
    return rng.integers(low, high + 1, num)


def random_requests(num: int, input_len: int, output_len: int, vocab_size: int = 32000,
                    seed: int = 0, range_ratio: float = 0.0,
                    prefix_len: int = 0) -> list[BenchRequest]:
    """``num`` prompts of token ids drawn uniformly from [3, min(vocab, 32000)).

    With the defaults every prompt is ``input_len`` ids and every output ``output_len`` tokens
    (workload CPU-W1's draw for the same seed; see docs/benchmarks.md). As vLLM's random
    dataset (``--random-range-ratio``, ``--random-prefix-len``): ``range_ratio`` > 0 draws
    each prompt's own length from [floor(input_len * (1 - r)), ceil(input_len * (1 + r))] and
    each output length likewise around ``output_len`` (at least 1), before the ids;
    ``prefix_len`` ids, drawn last and the same for every request, come first in every prompt
    (``prompt_len`` counts them).

    Raises:
        ValueError: for a ``range_ratio`` outside [0, 1), a negative ``prefix_len``, or
            prompts that could be empty.
    """
    if not 0 <= range_ratio < 1 or prefix_len < 0:
        raise ValueError(f"range_ratio ({range_ratio}) must be in [0, 1) and prefix_len "
                         f"({prefix_len}) >= 0")
    if prefix_len + math.floor(input_len * (1 - range_ratio)) < 1:
        raise ValueError(f"input_len {input_len} with range_ratio {range_ratio} and prefix_len "
                         f"{prefix_len} can draw an empty prompt")
    rng = np.random.default_rng(seed)
    in_lens = random_lengths(num, input_len, range_ratio, rng)
    out_lens = random_lengths(num, output_len, range_ratio, rng, least=1)
    high = min(vocab_size, 32000)
    if range_ratio == 0:
        ids = rng.integers(3, high, (num, input_len)).tolist()
    else:
        ids = [rng.integers(3, high, int(n)).tolist() for n in in_lens]
    prefix = rng.integers(3, high, prefix_len).tolist() if prefix_len else []
    return [BenchRequest(prefix + p, prefix_len + len(p), int(o))
            for p, o in zip(ids, out_lens)]


def _words(rng: np.random.Generator, n: int) -> str:
    return " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), n))


def synthetic_chat_requests(num: int, num_system_prompts: int = 4,
                            system_len: LengthDist = LengthDist("uniform", 200, 400),
                            user_len: LengthDist = LengthDist("uniform", 16, 256),
                            output_len: LengthDist = LengthDist("uniform", 32, 128),
                            seed: int = 0) -> list[BenchRequest]:
    """``num`` chat requests: each uses one of ``num_system_prompts`` shared system prompts
    (round-robin) and a user turn of its own; system and user lengths are in words, output
    lengths in tokens, each drawn from its distribution."""
    rng = np.random.default_rng(seed)
    systems = [f"You are assistant {i}. " + _words(rng, n)
               for i, n in enumerate(system_len.sample(rng, num_system_prompts))]
    user_lens, out_lens = user_len.sample(rng, num), output_len.sample(rng, num)
    requests = []
    for i in range(num):
        system = systems[i % num_system_prompts]
        user = _words(rng, int(user_lens[i]))
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        prompt_words = len(system.split()) + int(user_lens[i])
        requests.append(BenchRequest(system + "\n" + user, prompt_words, int(out_lens[i]),
                                     messages))
    return requests


# PIL's Image.MAX_IMAGE_PIXELS: it warns above this many pixels (a decompression bomb) and
# refuses twice as many; a random-image workload larger than that only exhausts memory
MAX_BENCH_IMAGE_PIXELS = 89_478_485


def parse_image_size(spec: str) -> tuple[int, int]:
    """``"WIDTHxHEIGHT"`` -> (width, height) in pixels. Raises ValueError when malformed or
    above ``MAX_BENCH_IMAGE_PIXELS``."""
    try:
        width, height = (int(v) for v in spec.lower().split("x"))
    except ValueError:
        raise ValueError(f"bad image size {spec!r}: use WIDTHxHEIGHT, e.g. 448x448") from None
    if width < 1 or height < 1:
        raise ValueError(f"bad image size {spec!r}: both sides must be >= 1 pixel")
    if width * height > MAX_BENCH_IMAGE_PIXELS:  # else numpy's MemoryError, a traceback
        raise ValueError(f"bad image size {spec!r}: {width * height} pixels is more than "
                         f"{MAX_BENCH_IMAGE_PIXELS} (PIL's decompression-bomb limit, past "
                         "which PIL-based image loaders warn, then refuse)")
    return width, height


def random_image_url(width: int, height: int, rng: np.random.Generator) -> str:
    """A PNG data URL of uniform random RGB pixels (incompressible: the largest PNG of that
    size, the worst case for transfer and decoding)."""
    from PIL import Image

    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def random_image_requests(num: int, input_len: int, output_len: int,
                          image_size: tuple[int, int] = (448, 448), image_fraction: float = 0.5,
                          num_unique_images: int = 0, seed: int = 0) -> list[BenchRequest]:
    """``num`` chat requests with a user turn of ``input_len`` words; a share
    ``image_fraction`` of them (spread evenly) carry one ``image_size`` random image before
    the text. ``num_unique_images`` > 0 draws the images round-robin from that many distinct
    ones (repeats hit the encoder cache); 0 makes every image distinct.

    Raises:
        ValueError: for an ``image_fraction`` outside [0, 1] or a negative
            ``num_unique_images``.
    """
    if not 0.0 <= image_fraction <= 1.0 or num_unique_images < 0:
        raise ValueError(f"image_fraction ({image_fraction}) must be in [0, 1] and "
                         f"num_unique_images ({num_unique_images}) >= 0")
    rng = np.random.default_rng(seed)
    pool: list[str] = []
    requests, num_with_image = [], 0
    for i in range(num):
        text = _words(rng, input_len)
        content: str | list[dict[str, Any]] = text
        if int((i + 1) * image_fraction) > int(i * image_fraction):  # evenly spread
            if num_unique_images == 0:
                url = random_image_url(*image_size, rng)
            else:
                if len(pool) < num_unique_images:
                    pool.append(random_image_url(*image_size, rng))
                url = pool[num_with_image % num_unique_images]
            content = [{"type": "image_url", "image_url": {"url": url}},
                       {"type": "text", "text": text}]
            num_with_image += 1
        requests.append(BenchRequest(text, input_len, output_len,
                                     [{"role": "user", "content": content}],
                                     num_images=int(isinstance(content, list))))
    return requests


def load_jsonl(path: str, default_output_len: int) -> list[BenchRequest]:
    """Requests from a JSON-lines file. Each line is an object with ``prompt`` (text or a list
    of token ids) or ``messages`` (a list of ``{"role", "content"}`` objects, for chat), and
    optionally one of ``output_len``, ``max_tokens`` or ``output_tokens`` (vLLM's custom
    dataset name): a positive integer.

    Raises:
        ValueError: when the file cannot be read, or naming the first line that is not such an
            object.
    """
    try:
        with open(path) as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--dataset {path}: cannot read it ({e.__class__.__name__}: "
                         f"{e.strerror if isinstance(e, OSError) else e})") from e
    requests = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            requests.append(_jsonl_request(json.loads(line), default_output_len))
        except ValueError as e:
            raise ValueError(f"{path}:{lineno}: {e}") from e
    return requests


# A JSON-lines request's output length (max_tokens): kvflow's names and vLLM's custom-dataset
# name (``output_tokens``).
OUTPUT_LEN_KEYS = ("output_len", "max_tokens", "output_tokens")


def _jsonl_request(obj: Any, default_output_len: int) -> BenchRequest:
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")  # noqa: TRY004
    given = [k for k in OUTPUT_LEN_KEYS if k in obj]
    if len(given) > 1:
        raise ValueError(f"give one of {', '.join(given)}, not several")
    out = obj[given[0]] if given else default_output_len
    if isinstance(out, bool) or not isinstance(out, int) or out < 1:
        raise ValueError(f"{given[0] if given else 'the output length'} must be a positive "
                         f"integer, got {out!r}")
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and _is_content(m.get("content")) for m in messages):
            raise ValueError("messages must be a non-empty list of {\"role\": str, "
                             "\"content\": str or a list of content parts} objects")
        texts = [_content_text(m["content"]) for m in messages]
        num_images = sum(_num_images(m["content"]) for m in messages)
        return BenchRequest("\n".join(texts), 0, out, list(messages), num_images)
    if "prompt" not in obj:
        raise ValueError("a line needs \"prompt\" (text or token ids) or \"messages\"")
    prompt = obj["prompt"]
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return BenchRequest(prompt, len(prompt), out)
    if isinstance(prompt, str) and prompt:
        return BenchRequest(prompt, 0, out)
    raise ValueError(f"prompt must be non-empty text or a non-empty list of token ids, got "
                     f"{type(prompt).__name__}")


def _is_content(content: Any) -> bool:
    """Text, or a list of OpenAI content parts (objects with a string ``type``)."""
    return isinstance(content, str) or (isinstance(content, list) and all(
        isinstance(p, dict) and isinstance(p.get("type"), str) for p in content))


def _content_text(content: str | list[dict[str, Any]]) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(p["text"] for p in content if isinstance(p.get("text"), str))


def _num_images(content: str | list[dict[str, Any]]) -> int:
    return 0 if isinstance(content, str) else \
        sum(p["type"] == "image_url" for p in content)
