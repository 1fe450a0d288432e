"""The offline API, shaped like vLLM's ``LLM``: ``llm`` (the class: generate, beam_search)
and its mixins, ``chat``, ``queue`` (enqueue / wait_for_completion and the engine stepping
every call shares), ``pooling``, ``score``, ``ops`` (sleep mode, collective_rpc, profiling, ...);
``arguments`` its per-call argument checks, ``stats`` its ``get_metrics`` series.
"""
