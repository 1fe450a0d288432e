"""Conversations -> prompt text, the same for ``LLM.chat`` and the server: ``template`` (rendering
with the chat template), ``messages`` (the messages checked and normalized), ``tool_calls``
(an assistant's tool calls and their answers checked), ``tools_text`` (tools as text for a
template that reads none). Where a template comes from is ``kvflow.chat_template_source``
(a public path).
"""
