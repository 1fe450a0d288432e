"""Lone-surrogate detection (kvflow/utils/text_checks.py) over request bodies: the path of the first
string holding one, whatever containers and token-id lists surround it; lists of numbers
alone (token ids, skipped at C speed) hold none. Oracle: hand-built bodies."""

from __future__ import annotations

import pytest

from kvflow.utils.text_checks import find_lone_surrogate


@pytest.mark.parametrize("body,path", [
    ({"prompt": [1, 2, 3] * 1000}, None),
    ({"prompt": [[1, 2], [3, None, 1.5, True]]}, None),
    ({"prompt": [1, 2, "a\ud800"]}, "prompt.2"),
    ({"prompt": [[1, 2], [3, 4], ["x", "\udc00"]]}, "prompt.2.1"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]},
     "messages.0.content.0.text"),
    ({"logit_bias": {"5\ud800": 1}}, "logit_bias.5\ud800"),
    ({"prompt": "ok", "stop": ["fine", "bad\udfff"]}, "stop.1"),
])
def test_first_lone_surrogate_path(body, path):
    found = find_lone_surrogate(body)
    assert (found[0] if found else None) == path
    if found:
        assert "lone UTF-16 surrogate" in found[1]
