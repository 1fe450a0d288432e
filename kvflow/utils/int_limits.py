"""The integer limits a request's count fields are held to, offline and on the server alike:
a signed 32-bit integer for counts (samples, tokens, top-k, priority, stream interval) and a
signed 64-bit one for seeds and ``truncate_prompt_tokens``. A value past them would overflow a
C long / int64 where it reaches a tensor or msgpack, or asks for more than any engine can do
(2**31 samples, 2**31 tokens); ``SamplingParams`` (``sampling/fields.py``), ``BeamSearchParams``,
the scheduler's priority rule and the OpenAI request models (``entrypoints/protocol``) use
these one set of numbers, so a value is refused the same way by both."""

from __future__ import annotations

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
