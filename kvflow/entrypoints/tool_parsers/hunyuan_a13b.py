"""``hunyuan_a13b``: Hunyuan-A13B's JSON list of calls in ``<tool_calls>`` tags, Jamba's
format (``jamba`` reads it)::

    <tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_calls>

Text before the tag is content, text after the list is dropped; Hunyuan's ``<think>`` /
``<answer>`` blocks are the ``hunyuan_a13b`` reasoning parser's to split off first. Unlike
Jamba's, Hunyuan's tags are plain text: the reply is decoded as the request says.
"""

from __future__ import annotations

from kvflow.entrypoints.tool_parsers.jamba import JambaToolParser


class HunyuanA13BToolParser(JambaToolParser):
    name = "hunyuan_a13b"
    keeps_special_tokens = False
