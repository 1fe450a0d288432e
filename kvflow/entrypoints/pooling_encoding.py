"""How pooled vectors leave the server (/v1/embeddings and /pooling; vLLM's encodings):
``encoding_format`` ``float`` (JSON numbers, the float32 values), ``base64`` (the values cast
to ``embed_dtype``, in ``endianness`` byte order, base64-encoded per input) or ``bytes`` (the
same bytes of every input concatenated as the response body, application/octet-stream, with a
``metadata`` header: JSON with the reply's ``id``, ``created``, ``model``, ``usage`` and per
input ``index``, ``embed_dtype``, ``endianness``, ``start`` / ``end`` byte offsets, ``shape``),
or ``bytes_only`` (vLLM 0.32's: the same body without the ``metadata`` header).

The cast is torch's own ``Tensor.to`` from float32 (round to nearest even; float16 and the
fp8 types give inf / NaN for values beyond their range, as torch does), so a client's
``torch.frombuffer(..., dtype=...)`` gets exactly those values back."""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Sequence
from typing import Any

import torch
from fastapi.responses import Response

from kvflow.entrypoints.openai_errors import OpenAIError

EMBED_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
ENDIANNESS = ("native", "big", "little")


def check_encoding(encoding_format: str, embed_dtype: str, endianness: str) -> None:
    """``embed_dtype`` and ``endianness`` say how bytes are written: with
    ``encoding_format`` ``float`` (JSON numbers) a value other than their defaults would be
    ignored, so it is refused.

    Raises:
        OpenAIError: 400 naming ``embed_dtype`` or ``endianness`` (code ``invalid_value``).
    """
    if encoding_format != "float":
        return
    for name, value, default in (("embed_dtype", embed_dtype, "float32"),
                                 ("endianness", endianness, "native")):
        if value != default:
            raise OpenAIError(f"{name}={value!r} applies to encoding_format base64 or bytes; "
                              "encoding_format float returns JSON numbers (the float32 "
                              "values)", param=name, code="invalid_value")


def vector_bytes(vector: Sequence[float], embed_dtype: str = "float32",
                 endianness: str = "native") -> bytes:
    """``vector`` (float32 values) cast to ``embed_dtype`` (a key of :data:`EMBED_DTYPES`),
    each value's bytes in ``endianness`` order (``native``: this machine's,
    ``sys.byteorder``); ``len(vector) * itemsize`` bytes.

    Raises:
        KeyError: for an ``embed_dtype`` not in :data:`EMBED_DTYPES` (the request model
            refuses one first).
    """
    values = torch.tensor(vector, dtype=torch.float32).to(EMBED_DTYPES[embed_dtype])
    raw = values.view(torch.uint8).numpy()  # each value's bytes, in this machine's order
    if endianness not in ("native", sys.byteorder) and values.element_size() > 1:
        raw = raw.reshape(-1, values.element_size())[:, ::-1]
    return raw.tobytes()


def encode_vector(vector: list[float], encoding_format: str, embed_dtype: str = "float32",
                  endianness: str = "native") -> list[float] | str:
    """One input's JSON value: ``vector`` itself (``float``) or its ``vector_bytes`` in
    base64 (``base64``)."""
    if encoding_format == "base64":
        return base64.b64encode(vector_bytes(vector, embed_dtype, endianness)).decode()
    return vector


def split_rows(values: list[float], num_rows: int) -> list[list[float]]:
    """A per-token output (``num_rows`` rows of D values, flattened row-major) as
    ``num_rows`` lists of D floats: /pooling's ``data`` for token_embed / token_classify.

    Raises:
        ValueError: if ``len(values)`` is not a multiple of ``num_rows``.
    """
    if num_rows < 1 or len(values) % num_rows:
        raise ValueError(f"{len(values)} per-token values do not split into {num_rows} rows")
    width = len(values) // num_rows
    return [values[i:i + width] for i in range(0, len(values), width)]


BYTES_FORMATS = ("bytes", "bytes_only")  # the encodings answered with a binary body


def bytes_response(vectors: Sequence[list[float]], embed_dtype: str, endianness: str,
                   head: dict[str, Any], num_prompt_tokens: int,
                   rows: Sequence[int] | None = None, metadata: bool = True) -> Response:
    """``encoding_format: bytes``: every vector's ``vector_bytes`` in input order as the
    body; the ``metadata`` header holds ``head`` (``id``, ``created``, ``model``), ``data``
    (per input: ``index``, ``embed_dtype``, ``endianness``, ``start``, ``end``, ``shape``)
    and ``usage`` (vLLM's layout). ``rows``: per input, the number of rows its values hold
    (per-token outputs, flattened row-major: ``shape`` [rows, D]); None: one vector each.
    ``metadata`` False (``encoding_format: bytes_only``, vLLM 0.32's): the same body, no
    header."""
    chunks, items, offset = [], [], 0
    for i, vector in enumerate(vectors):
        chunks.append(vector_bytes(vector, embed_dtype, endianness))
        items.append({"index": i, "embed_dtype": embed_dtype, "endianness": endianness,
                      "start": offset, "end": offset + len(chunks[-1]),
                      "shape": [len(vector)] if rows is None else
                      [rows[i], len(vector) // rows[i]]})
        offset += len(chunks[-1])
    body = b"".join(chunks)
    if not metadata:
        return Response(body, media_type="application/octet-stream")
    header = {**head, "data": items, "usage": {"prompt_tokens": num_prompt_tokens,
                                               "total_tokens": num_prompt_tokens}}
    return Response(body, media_type="application/octet-stream",
                    headers={"metadata": json.dumps(header)})
