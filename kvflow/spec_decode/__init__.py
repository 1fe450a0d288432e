"""Speculative decoding: draft tokens proposed cheaply, verified by the target in one step.

The modules sit at different import layers (``tests/test_import_layers.py``), by where they run:

* engine core (scheduler side): ``ngram`` (prompt-lookup proposals from the token history),
  ``cost_model`` (measured step times), ``speculator`` (which requests get how many drafts
  each step: adaptive length; the acceptance bookkeeping);
* worker (model-runner side): ``draft_model`` (a smaller model and its paged KV cache, proposing
  at the start of a step), ``verification`` (the draft tokens in the input batch, the sampling
  rows they add, the runner's output);
* layers: ``rejection_sampler`` (the accept / resample rule that keeps the target distribution).

This package's ``__init__`` imports nothing, so a worker importing its worker-level modules
does not pull in the engine core.
"""
