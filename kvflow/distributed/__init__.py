"""Process groups and collectives for tensor, pipeline, expert, data and context parallelism
(``parallel_state.py``: the groups of one worker; ``comm.py``: the collectives on a group)."""
