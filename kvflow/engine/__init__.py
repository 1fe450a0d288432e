"""The engine layer: the request-level engine around ``EngineCore``.

``llm_engine.LLMEngine`` runs everything in one process (the offline ``LLM``);
``async_llm.AsyncLLM`` runs ``EngineCore`` in a process of its own (``core_proc``) and talks to
it with the messages in ``messages`` (what crosses the process boundary).

The engine-core outputs become RequestOutputs here too, as in vLLM's ``vllm/v1/engine/``:
``output_processor``, with ``detokenizer`` (``detokenizer_stops``, ``detokenizer_tokens``) and
``logprob_tokens``.
"""
