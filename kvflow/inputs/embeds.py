"""A prompt given as embedding rows instead of token ids (pure data: crosses every process
boundary), its checks, and the server's base64 decoding.

``LLM(enable_prompt_embeds=True).generate({"prompt_embeds": tensor})`` and the server's
``/v1/completions`` ``prompt_embeds`` (base64 of a ``torch.save``d tensor, with
``--enable-prompt-embeds``) both end in :func:`check_prompt_embeds`, which turns a tensor into
a :class:`PromptEmbeds`: the rows as raw bytes, their dtype and shape, and a digest. The
request then carries one placeholder token id (0) per row, so the scheduler's counts, the
KV-cache sizing and the context checks work unchanged; the digest keys the prefix cache (two
prompts with equal placeholders but different rows never share K/V), and the model runner
writes the rows over the embedding lookup of the prompt positions it computes
(``worker/prompt_embeds_runner.py``). Generated tokens are embedded as usual.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass

import torch

# dtypes kept as sent; float64 is narrowed to float32 (no model computes in float64)
_KEPT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class PromptEmbeds:
    """A prompt's embedding rows.

    Attributes:
        dtype: the rows' torch dtype name ("float32", "float16" or "bfloat16"); the runner
            casts them to the model's dtype.
        shape: (num_tokens, hidden_size).
        data: the rows as raw row-major bytes.
        identifier: hex BLAKE2b digest of dtype, shape and data (the prefix-cache key).
    """

    dtype: str
    shape: tuple[int, int]
    data: bytes
    identifier: str

    @property
    def num_tokens(self) -> int:
        return self.shape[0]

    def tensor(self) -> torch.Tensor:
        """The rows: ``dtype`` [num_tokens, hidden_size], a fresh CPU tensor."""
        flat = torch.frombuffer(bytearray(self.data), dtype=getattr(torch, self.dtype))
        return flat.reshape(self.shape)


def check_prompt_embeds(embeds: object, hidden_size: int, max_model_len: int,
                        max_model_len_note: str = "", keep_last: int | None = None
                        ) -> PromptEmbeds:
    """``embeds`` checked and packed: a float tensor [num_tokens, hidden_size] (a leading
    batch dimension of 1 is squeezed, as vLLM does); float64 is narrowed to float32, other
    float dtypes are kept (the runner casts to the model's dtype). ``keep_last`` (a
    ``truncate_prompt_tokens`` length, >= 1): only the last that many rows are kept, cut
    before the length check (vLLM's rule); None keeps every row.

    Raises:
        ValueError: naming what is wrong: not a tensor, a meta tensor, not floating point, a
            rank other than 2 (after the squeeze), a last dimension other than
            ``hidden_size``, zero rows, a NaN or infinite value, or ``max_model_len`` rows
            or more (no room to generate).
    """
    if not isinstance(embeds, torch.Tensor):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
            f"prompt_embeds must be a torch.Tensor, got {type(embeds).__name__}")
    if embeds.is_meta:  # no values to read: copying it out raised NotImplementedError
        raise ValueError("prompt_embeds is a meta tensor (a shape without values): pass the "
                         "embeddings themselves")
    if not embeds.is_floating_point():
        raise ValueError(f"prompt_embeds must be a floating-point tensor, got dtype "
                         f"{str(embeds.dtype).removeprefix('torch.')}")
    if embeds.dim() == 3 and embeds.shape[0] == 1:
        embeds = embeds[0]
    if embeds.dim() != 2:
        raise ValueError(f"prompt_embeds must have shape [num_tokens, hidden_size] (or "
                         f"[1, num_tokens, hidden_size]), got {list(embeds.shape)}")
    width = embeds.shape[1]
    if width != hidden_size:
        raise ValueError(f"prompt_embeds has hidden size {width} but the model's is "
                         f"{hidden_size}")
    if keep_last is not None:
        embeds = embeds[-keep_last:]
    num_tokens = embeds.shape[0]
    if num_tokens == 0:
        raise ValueError("prompt_embeds has no rows: the prompt must have at least one token")
    if num_tokens >= max_model_len:
        raise ValueError(f"prompt_embeds has {num_tokens} rows (tokens) but max_model_len is "
                         f"{max_model_len}{max_model_len_note}: it must be shorter to leave "
                         "room for at least one generated token")
    embeds = embeds.detach().to("cpu")
    if embeds.dtype not in _KEPT_DTYPES:
        embeds = embeds.float()
    if not bool(torch.isfinite(embeds).all()):
        raise ValueError("prompt_embeds holds NaN or infinite values")
    return pack_prompt_embeds(embeds)


def check_packed_prompt_embeds(embeds: object, hidden_size: int) -> None:
    """Check a :class:`PromptEmbeds` handed over as such (``AsyncLLM.add_request``, a
    ``ProcessedPrompt``, the core's own queue), not made here by :func:`check_prompt_embeds`:
    rows that the model cannot take would otherwise fail the engine step they run in.

    Raises:
        ValueError: naming what is wrong: not a ``PromptEmbeds``, a dtype other than
            float32, float16 or bfloat16, a shape that is not two positive sizes, a last
            size other than ``hidden_size`` (0: not checked), or ``data`` whose length is
            not the shape's rows of the dtype.
    """
    if not isinstance(embeds, PromptEmbeds):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
            f"prompt_embeds must be a PromptEmbeds, got {type(embeds).__name__}")
    kept = [str(d).removeprefix("torch.") for d in _KEPT_DTYPES]
    if embeds.dtype not in kept:
        raise ValueError(f"prompt_embeds has dtype {embeds.dtype!r}; expected one of {kept}")
    shape = tuple(embeds.shape)
    if len(shape) != 2 or not all(isinstance(n, int) and n >= 1 for n in shape):
        raise ValueError(f"prompt_embeds must have shape [num_tokens, hidden_size] of "
                         f"positive sizes, got {list(shape)}")
    if hidden_size and shape[1] != hidden_size:
        raise ValueError(f"prompt_embeds has hidden size {shape[1]} but the model's is "
                         f"{hidden_size}")
    size = shape[0] * shape[1] * getattr(torch, embeds.dtype).itemsize
    if not isinstance(embeds.data, bytes) or len(embeds.data) != size:
        raise ValueError(f"prompt_embeds data holds {len(embeds.data)} bytes, but "
                         f"{list(shape)} rows of {embeds.dtype} take {size}")


def pack_prompt_embeds(embeds: torch.Tensor) -> PromptEmbeds:
    """A checked CPU tensor [num_tokens, hidden_size] as a :class:`PromptEmbeds`."""
    embeds = embeds.contiguous()
    dtype = str(embeds.dtype).removeprefix("torch.")
    data = embeds.view(torch.uint8).numpy().tobytes()
    digest = hashlib.blake2b(f"{dtype}:{tuple(embeds.shape)}:".encode(), digest_size=16)
    digest.update(data)
    return PromptEmbeds(dtype, (int(embeds.shape[0]), int(embeds.shape[1])), data,
                        digest.hexdigest())


def decode_prompt_embeds(encoded: str) -> torch.Tensor:
    """The tensor of one ``prompt_embeds`` entry of a request body: base64 of a
    ``torch.save``d tensor, read with ``torch.load(weights_only=True, map_location="cpu")``
    (no code runs; the request-body size limit bounds it).

    Raises:
        ValueError: for text that is not base64, bytes that torch cannot load, or an object
            that is not a tensor.
    """
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("prompt_embeds is not valid base64") from None
    try:
        obj = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - any unpickling failure is the client's input
        raise ValueError(f"prompt_embeds is not a torch.save'd tensor, as torch.load("
                         f"weights_only=True) reads it ({type(e).__name__})") from None
    if not isinstance(obj, torch.Tensor):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
            f"prompt_embeds holds a {type(obj).__name__}, not a tensor")
    return obj

