"""``seed_oss``: Seed-OSS's XML calls, Qwen3-Coder's format in ``<seed:tool_call>`` tags::

    <seed:tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </seed:tool_call>

Read as ``qwen3_coder`` reads its blocks: values typed by the tool's JSON schema, text before
the first block content, text between and after the blocks dropped, a parameter streamed as
it closes, a bare ``<function=`` block without its opening tag read too. The tags are special tokens of Seed-OSS's tokenizer: the reply is decoded with them.
(A ``<seed:think>`` block before the calls is the ``seed_oss`` reasoning parser's.)
"""

from __future__ import annotations

from kvflow.entrypoints.tool_parsers.qwen3_coder import Qwen3CoderToolParser


class SeedOssToolParser(Qwen3CoderToolParser):
    name = "seed_oss"
    keeps_special_tokens = True
    START, END = "<seed:tool_call>", "</seed:tool_call>"
