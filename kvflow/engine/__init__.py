"""The engine layer: the request-level engine around ``EngineCore``.

``llm_engine.LLMEngine`` runs everything in one process (the offline ``LLM``);
``async_llm.AsyncLLM`` runs ``EngineCore`` in a process of its own (``core_proc``) and talks to
it with the messages in ``messages`` (what crosses the process boundary).
"""
