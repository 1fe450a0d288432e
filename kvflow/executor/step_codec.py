"""msgspec encoding of what crosses between the executor and its worker processes each step.

A step message is ``(SchedulerOutput, GrammarBitmask | None)``, encoded once per step and sent
to every rank; the reply is whatever ``ModelRunner.execute_model`` returns (decoded by its
return annotation, so the codec follows the runner's output type without naming it). A split
step (a draft model's constrained requests) sends the step message with a flag first, may
answer requests for grammar rows (drafts so far in, a bitmask out), gets the proposed drafts
back (``dict[str, list[int]]``), then sends the grammar bitmask alone. Both are
plain dataclasses of lists, dicts and numbers; the only tensor, a grammar bitmask, travels as
``(dtype name, shape, raw bytes)``.
"""

from __future__ import annotations

import typing
from typing import Any

import msgspec
import torch

from kvflow.sched_output import GrammarBitmask, SchedulerOutput
from kvflow.worker.model_runner import ModelRunner

StepMessage = tuple[SchedulerOutput, typing.Optional[GrammarBitmask]]  # noqa: UP045
BitmaskMessage = typing.Optional[GrammarBitmask]  # noqa: UP045
# a split step's first message: the step, the grammar rows before draft 1, and whether the
# driver asks for the rows of later drafts
ProposeMessage = tuple[SchedulerOutput, typing.Optional[GrammarBitmask], bool]  # noqa: UP045
Drafts = dict[str, list[int]]
RowsRequest = tuple[int, Drafts]  # (the propose it is for, counted from 1; drafts so far)


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        return (str(t.dtype).removeprefix("torch."), list(t.shape),
                t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is torch.Tensor:
        dtype_name, shape, data = obj
        dtype = getattr(torch, dtype_name)
        if not data:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)
    raise NotImplementedError(f"cannot decode {kind}")


class StepCodec:
    """Encoder/decoders for step messages and step results (one per process; not
    thread-safe)."""

    def __init__(self) -> None:
        result_type = typing.get_type_hints(ModelRunner.execute_model)["return"]
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self._step_decoder = msgspec.msgpack.Decoder(StepMessage, dec_hook=_dec_hook)
        self._result_decoder = msgspec.msgpack.Decoder(result_type, dec_hook=_dec_hook)
        self._bitmask_decoder = msgspec.msgpack.Decoder(BitmaskMessage, dec_hook=_dec_hook)
        self._propose_decoder = msgspec.msgpack.Decoder(ProposeMessage, dec_hook=_dec_hook)
        self._drafts_decoder = msgspec.msgpack.Decoder(Drafts)
        self._rows_request_decoder = msgspec.msgpack.Decoder(RowsRequest)

    def encode(self, obj: Any) -> bytes:
        """Encode a step message, a step result, a grammar bitmask or drafts."""
        return self._encoder.encode(obj)

    def decode_step(self, data: bytes) -> tuple[SchedulerOutput, GrammarBitmask | None]:
        """Raises msgspec.DecodeError for bytes that are not a step message."""
        return self._step_decoder.decode(data)

    def decode_result(self, data: bytes) -> Any:
        """Raises msgspec.DecodeError for bytes that are not a step result."""
        return self._result_decoder.decode(data)

    def decode_bitmask(self, data: bytes) -> GrammarBitmask | None:
        """A split step's grammar bitmask (``verify``, ``rows``). Raises msgspec.DecodeError
        for other bytes."""
        return self._bitmask_decoder.decode(data)

    def decode_propose(self, data: bytes
                       ) -> tuple[SchedulerOutput, GrammarBitmask | None, bool]:
        """A split step's ``propose`` message. Raises msgspec.DecodeError for other bytes."""
        return self._propose_decoder.decode(data)

    def decode_drafts(self, data: bytes) -> dict[str, list[int]]:
        """A split step's proposed drafts, request id -> draft tokens. Raises
        msgspec.DecodeError for other bytes."""
        return self._drafts_decoder.decode(data)

    def decode_rows_request(self, data: bytes) -> tuple[int, dict[str, list[int]]]:
        """A ``rows?`` request: (which ``propose`` it is for, counted from 1; the drafts so
        far by request id). Raises msgspec.DecodeError for other bytes."""
        return self._rows_request_decoder.decode(data)
