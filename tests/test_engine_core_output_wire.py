"""``EngineCoreOutput`` on the wire between the engine core and the API process: its msgpack
form is a map of every field, in declaration order (what the slotted dataclass it replaced
encoded to, so a core and a front end of either kind read each other), and it decodes back
to an equal value, logprobs and both kinds of stop reason included."""

from __future__ import annotations

import msgspec

from kvflow.engine_outputs import EngineCoreOutput

FIELDS = ["request_id", "new_token_ids", "new_logprobs", "finish_reason", "stop_reason",
          "num_cached_tokens", "prompt_logprobs", "num_draft_tokens", "num_accepted_tokens",
          "pooling_output", "error", "retry_after_s", "error_field", "internal_error"]


def test_encodes_as_a_map_of_every_field_in_order():
    out = EngineCoreOutput("r1", [7, 8])
    encoded = msgspec.msgpack.decode(msgspec.msgpack.encode(out))
    assert list(encoded) == FIELDS
    assert encoded == {"request_id": "r1", "new_token_ids": [7, 8], "new_logprobs": None,
                       "finish_reason": None, "stop_reason": None, "num_cached_tokens": 0,
                       "prompt_logprobs": None, "num_draft_tokens": 0,
                       "num_accepted_tokens": 0, "pooling_output": None, "error": None,
                       "retry_after_s": None, "error_field": None, "internal_error": False}


def test_round_trips_positional_fields_logprobs_and_stop_reasons():
    logprobs = [([5, 9], [-0.25, -1.5], -0.25, 1)]
    for stop_reason in (3, "###", None):
        out = EngineCoreOutput("r2", [5], logprobs, "stop", stop_reason, 16, [None], 2, 1)
        back = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=EngineCoreOutput)
        assert back == out
        assert (back.request_id, back.new_token_ids, back.finish_reason, back.stop_reason,
                back.num_cached_tokens, back.num_draft_tokens, back.num_accepted_tokens) == \
            ("r2", [5], "stop", stop_reason, 16, 2, 1)
        assert back.new_logprobs == [([5, 9], [-0.25, -1.5], -0.25, 1)]
