"""``SamplingParams``' own helpers (foundation, no engine imports): ``fields`` (its field checks),
``stop_limits``, ``repetition_detection`` and ``token_masks`` (allowed_token_ids, bad_words).
The class itself stays at vLLM's path, ``kvflow.sampling_params``.
"""
