"""What one beam search asks for: ``BeamSearchParams`` (vLLM's, at its path
``kvflow.sampling_params.BeamSearchParams`` too). Pure data; the search itself is
``kvflow/beam_search.py``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvflow.utils.close_names import guess_unknown_keywords
from kvflow.utils.int_limits import INT32_MAX

# Widest beam accepted: each step asks for 2 * beam_width logprobs per beam, and
# beam_width ** 2 candidates are ranked per prompt per step.
MAX_BEAM_WIDTH = 128


@guess_unknown_keywords
@dataclass
class BeamSearchParams:
    """Parameters of one beam search (vLLM's ``BeamSearchParams``).

    Attributes:
        beam_width: beams kept per prompt, and sequences returned per prompt (>= 1, at most
            ``MAX_BEAM_WIDTH``).
        max_tokens: tokens generated at most per beam (>= 1, at most 2**31 - 1).
        ignore_eos: keep beams going past an EOS id (every beam then has ``max_tokens``
            tokens).
        temperature: must be 0: kvflow ranks beams by the model's own logprobs (vLLM's
            temperature only changes which sampled token joins the ranked candidates).
        length_penalty: exponent of the length in ``beam_search_score`` (0: rank by
            cumulative logprob; > 0 favours longer sequences). A finite number.
        include_stop_str_in_output: keep a final EOS token in ``BeamSearchSequence.text``
            (its text shows only with ``skip_special_tokens=False`` when it is a special
            token, as for a sampled request).
        structured_outputs: must be None (vLLM's field; kvflow's beam search does not
            constrain beams to a grammar).
        skip_special_tokens: leave special tokens out of ``BeamSearchSequence.text``
            (vLLM's field; the tokens themselves are unchanged).
        watermarking: vLLM's field, True, False or None; no effect (kvflow does not
            watermark, and vLLM's beam search steps never do).

    Raises:
        ValueError: naming the field, for a value of the wrong type or out of range, or a
            ``structured_outputs`` other than None.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    structured_outputs: Any = None
    skip_special_tokens: bool = True
    watermarking: bool | None = None

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BeamSearchParams.{name}={value!r} is invalid: it must be an "
                                 "integer >= 1")
        if self.max_tokens > INT32_MAX:
            raise ValueError(f"BeamSearchParams.max_tokens={self.max_tokens} is invalid: it "
                             f"must be <= {INT32_MAX} (a signed 32-bit integer, the server's "
                             "limit too)")
        if self.beam_width > MAX_BEAM_WIDTH:
            raise ValueError(f"BeamSearchParams.beam_width={self.beam_width} is above the "
                             f"limit of {MAX_BEAM_WIDTH}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "watermarking"):
            if not isinstance(getattr(self, name), bool) and \
                    (name != "watermarking" or self.watermarking is not None):
                raise ValueError(
                    f"BeamSearchParams.{name}={getattr(self, name)!r} is invalid: it must be "
                    f"True or False{' (or None)' if name == 'watermarking' else ''}")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not math.isfinite(value):
                raise ValueError(f"BeamSearchParams.{name}={value!r} is invalid: it must be "
                                 "a finite number")
        if self.structured_outputs is not None:
            raise ValueError("BeamSearchParams.structured_outputs is not supported: kvflow's "
                             "beam search does not constrain beams to a grammar (leave it None)")
        if self.temperature != 0:
            raise ValueError(f"BeamSearchParams.temperature={self.temperature!r} is not "
                             "supported: kvflow's beam search ranks beams by the model's "
                             "logprobs and is deterministic (send temperature 0)")
