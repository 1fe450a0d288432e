"""The data-parallel load balancer's rule on its own (no processes): least-loaded replica by
depth (unfinished samples), prefix-cache affinity by the longest known prefix of the first
blocks, and the slack beyond which affinity yields to load. Every expected replica below is
worked out by hand from the rule in kvflow/engine/dp_balancer.py (block size 4 here)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvflow.engine.dp_balancer import DPLoadBalancer, cache_key
from kvflow.inputs.embeds import PromptEmbeds
from kvflow.inputs.multimodal import MultiModalFeature
from kvflow.lora.request import LoRARequest
from kvflow.models.loader import load_tokenizer
from kvflow.models.model_resolver import resolve_model

BS = 4
LIVE2 = [True, True]


def prompt(*blocks: int, tail: int = 0) -> list[int]:
    """Full blocks of token ``b`` (one block per argument), then ``tail`` extra tokens."""
    return [t for b in blocks for t in [b] * BS] + [999] * tail


def test_without_a_known_prefix_the_least_loaded_replica_wins():
    lb = DPLoadBalancer(3, BS)
    short = [1, 2, 3]  # under one block: no prefix to remember
    assert lb.prefix_hashes(short) == []
    picks = []
    for i in range(5):
        r = lb.choose(short, [True] * 3)
        lb.assign(f"r{i}", r, 1)
        picks.append(r)
    assert picks == [0, 1, 2, 0, 1]  # ties go to the lowest index
    assert lb.depth == [2, 2, 1]
    lb.finish("r0")
    lb.finish("r0")  # finishing twice (an abort after the end) changes nothing
    lb.finish("unknown")
    assert lb.depth == [1, 2, 1]
    assert lb.choose(short, [True] * 3) == 0


def test_samples_count_in_the_depth():
    lb = DPLoadBalancer(2, BS)
    lb.assign("a", 0, 4)  # n=4
    lb.assign("b", 1, 1)
    assert lb.depth == [4, 1] and lb.choose([1], LIVE2) == 1
    assert lb.replica_of("a") == 0 and lb.requests_on(0) == ["a"]


def test_equal_depths_go_to_the_replica_with_the_emptier_kv_cache():
    lb = DPLoadBalancer(3, BS)
    lb.assign("a", 0, 1)
    # depths [1, 0, 0]: replicas 1 and 2 tie on depth; 2 holds less KV (0.1 < 0.6)
    assert lb.choose([1], [True] * 3, kv_usage=[0.0, 0.6, 0.1]) == 2
    # depth outranks KV use: replica 0 is one deeper even with an empty cache
    lb.assign("b", 1, 1)
    lb.assign("c", 2, 1)
    lb.assign("d", 1, 1)
    lb.assign("e", 2, 1)  # depths [1, 2, 2]
    assert lb.choose([1], [True] * 3, kv_usage=[0.9, 0.0, 0.0]) == 0
    # equal depths and equal KV use: the lowest index
    lb.assign("f", 0, 1)  # depths [2, 2, 2]
    assert lb.choose([1], [True] * 3, kv_usage=[0.5, 0.5, 0.5]) == 0


def test_a_shared_prefix_follows_its_replica_within_the_slack():
    lb = DPLoadBalancer(2, BS, slack=4, slack_ratio=0.5)
    first = lb.choose(prompt(7, 8, tail=2), LIVE2)
    assert first == 0
    lb.assign("first", 0, 1)
    # replica 0 one deeper than replica 1, but same first blocks: affinity
    assert lb.choose(prompt(7, 8, 9), LIVE2) == 0
    for i in range(4):
        lb.assign(f"x{i}", 0, 1)
    assert lb.depth == [5, 0]
    # 5 > 0 + max(4, 0 * 0.5): much deeper, so the least-loaded replica takes it
    assert lb.choose(prompt(7, 8), LIVE2) == 1
    # ... and the prefix now points to replica 1
    assert lb.preferred(lb.prefix_hashes(prompt(7, 8))) == 1


def test_the_slack_grows_with_the_least_depth():
    lb = DPLoadBalancer(2, BS, slack=4, slack_ratio=0.5)
    lb.choose(prompt(5), LIVE2)  # prefix (5) -> replica 0
    lb.assign("a", 0, 30)
    lb.assign("b", 1, 20)
    # allowance max(4, 0.5 * 20) = 10: 30 <= 20 + 10 keeps the affinity
    assert lb.choose(prompt(5, tail=1), LIVE2) == 0
    lb.assign("c", 0, 1)
    # 31 > 30: the least-loaded replica
    assert lb.choose(prompt(5, tail=1), LIVE2) == 1


def test_the_longest_known_prefix_names_the_replica():
    lb = DPLoadBalancer(2, BS)
    assert lb.choose(prompt(1), LIVE2) == 0  # records (1) -> 0
    lb.assign("a", 0, 1)
    one_two = lb.prefix_hashes(prompt(1, 2))
    lb._record(one_two[1:], 1)  # as if a request starting (1, 2) had gone to replica 1
    assert lb.choose(prompt(1, 4), LIVE2) == 0  # only (1) is known: replica 0
    assert lb.choose(prompt(1, 2, 3), LIVE2) == 1  # (1, 2) is longer than (1)
    assert lb.choose(prompt(1, 5), LIVE2) == 1  # (1) -> 1: recorded by the (1, 2, 3) call
    assert lb.choose(prompt(1, 4), LIVE2) == 0  # (1, 4) -> 0: recorded by the first call
    assert lb.choose(prompt(6, 2), LIVE2) == 1  # nothing known: least loaded (0 has "a")


def test_a_short_shared_opening_does_not_pull_every_prompt():
    """Prompts that share only their first block (a chat template's opening) of the 9 tokens
    the balancer sees: 4 < 0.5 * 9, too short a share to name a replica, so 8 queued at
    once alternate (least loaded, ties to the lowest index). Was: all followed the first
    one's replica until it was 5 deeper ([0, 0, 0, 0, 0, 1, 1, 1], depths [5, 3]). A prompt
    that shares half or more of what the balancer sees still follows its replica."""
    lb = DPLoadBalancer(2, BS)
    picks = []
    for i in range(8):
        picks.append(lb.choose(prompt(1, 10 + i, tail=1), LIVE2))
        lb.assign(f"r{i}", picks[-1], 1)
    assert picks == [0, 1, 0, 1, 0, 1, 0, 1] and lb.depth == [4, 4]
    lb.assign("one more", 0, 1)  # depths [5, 4]: prompt(1, 11) was sent to replica 1
    assert lb.choose(prompt(1, 11), LIVE2) == 1
    assert lb.choose(prompt(1, 11, tail=1), LIVE2) == 1  # 8 of 9 shared
    assert lb.choose(prompt(1, 20, 21, 22), LIVE2) == 1  # least loaded: 4 of 16 shared
    assert lb.choose(prompt(1, 12, 13, 14), LIVE2) == 0  # (1, 12) went to 0: 8 of 16


def test_eight_chat_requests_split_four_four():
    """The reported case: 8 chat requests of SmolLM2's template (its default system prompt,
    24 tokens shared, then the question: 35-39 tokens, 2 full blocks of 16) queued at once
    on 2 replicas go 4/4 (the shared block is under half of each prompt)."""
    questions = ["What is the capital of France?", "Write a haiku about rain.",
                 "How do I sort a list in Python?", "Name three primes.",
                 "Why is the sky blue?", "Translate hello to German.", "What is 2+2?",
                 "Tell me a joke."]
    tokenizer = load_tokenizer(resolve_model("SmolLM2-135M-Instruct"), None)
    prompts = [tokenizer(tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False)["input_ids"] for q in questions]
    assert all(35 <= len(ids) <= 39 and ids[:24] == prompts[0][:24] for ids in prompts)
    assert len({ids[24] for ids in prompts}) > 1  # the question starts at token 24
    lb = DPLoadBalancer(2, 16)
    for i, ids in enumerate(prompts):
        lb.assign(f"chat{i}", lb.choose(ids, LIVE2), 1)
    assert lb.depth == [4, 4]


def test_only_the_first_affinity_blocks_count():
    lb = DPLoadBalancer(2, BS, affinity_blocks=2)
    assert len(lb.prefix_hashes(prompt(1, 2, 3, 4))) == 2
    assert lb.prefix_hashes(prompt(1, 2, 3)) == lb.prefix_hashes(prompt(1, 2, 4))
    assert lb.prefix_hashes(prompt(1, 2)) != lb.prefix_hashes(prompt(2, 1))


def test_affinity_follows_the_adapter_and_salt_the_prefix_cache_keys_by():
    """A prompt's blocks are cached under its LoRA adapter and ``cache_salt`` (the block
    hashes hold them), so the same tokens under another adapter, the base model or another
    salt hit nothing on the replica that ran them: they go to the least-loaded replica
    (they followed the tokens alone); the same adapter and salt still follow."""
    sql, chat = LoRARequest("sql", 1, "/a/sql"), LoRARequest("chat", 2, "/a/chat")
    lb = DPLoadBalancer(2, BS)
    assert lb.choose(prompt(1, 2), LIVE2, cache_key=cache_key(sql, None)) == 0
    lb.assign("a", 0, 1)  # depths [1, 0]: replica 0 is within the slack, were it preferred
    assert lb.choose(prompt(1, 2), LIVE2) == 1  # the base model: nothing cached for it on 0
    lb.assign("b", 1, 1)
    lb.assign("c", 1, 1)  # depths [1, 2]
    assert lb.choose(prompt(1, 2), LIVE2, cache_key=cache_key(chat, None)) == 0  # least
    lb.assign("d", 0, 2)  # depths [3, 2]
    assert lb.choose(prompt(1, 2), LIVE2, cache_key=cache_key(sql, "tenant")) == 1  # least
    assert lb.choose(prompt(1, 2), LIVE2, cache_key=cache_key(sql, None)) == 0  # follows
    assert lb.choose(prompt(1, 2), LIVE2, cache_key=cache_key(None, "tenant")) == 1
    assert cache_key(None, None) is None  # the base model unsalted: the chain as before
    assert lb.prefix_hashes(prompt(1)) == lb.prefix_hashes(prompt(1), cache_key(None, None))


def test_a_dead_replica_gets_nothing_and_is_forgotten():
    lb = DPLoadBalancer(2, BS)
    lb.choose(prompt(3, 3), LIVE2)  # -> 0
    lb.assign("a", 0, 2)
    lb.assign("b", 1, 5)
    assert lb.choose(prompt(3, 3), [False, True]) == 1  # preferred replica is down
    lb.forget_replica(1)
    assert lb.depth == [2, 0] and lb.requests_on(1) == []
    assert lb.preferred(lb.prefix_hashes(prompt(3, 3))) is None  # it pointed to 1
    with pytest.raises(RuntimeError, match="no data-parallel replica"):
        lb.choose([1, 2], [False, False])


def _request(ids, embeds=None, images=None):
    """The fields of a ``Request`` that ``choose_for`` reads."""
    return SimpleNamespace(prompt_token_ids=ids, lora_request=None, cache_salt=None,
                           prompt_embeds=None if embeds is None else
                           PromptEmbeds("float32", (len(ids), 2), b"", embeds),
                           mm_features=None if images is None else
                           [MultiModalFeature("image", ident, off, n, b"", (1, 1), (1, 1, 1))
                            for ident, off, n in images])


def test_affinity_follows_the_embeddings_and_images_behind_placeholder_ids():
    """Prompt embeddings' token ids are placeholders (the same for any embeddings of a
    length) and an image's placeholders are the same ids for any image; the prefix cache
    keys such blocks by the embeddings' and images' identifiers, so must the affinity. Other
    embeddings or another image go to the least-loaded replica (was: to the replica of the
    first such prompt, where they cannot hit); the same ones follow their replica. A block
    before the image is shared."""
    lb = DPLoadBalancer(2, BS)
    placeholders = [0] * (2 * BS)
    picks = []
    for i, ident in enumerate(["e1", "e2", "e2"]):
        picks.append(lb.choose_for(_request(placeholders, embeds=ident), LIVE2))
        lb.assign(f"e{i}", picks[-1], 1)
    assert picks == [0, 1, 1]  # depths [1, 0] -> 1; then [1, 1]: e2 follows replica 1
    lb = DPLoadBalancer(2, BS)
    picks = []
    for i, ident in enumerate(["cat", "dog", "dog"]):  # an image's 8 placeholders first
        picks.append(lb.choose_for(_request(prompt(9, 9), images=[(ident, 0, 2 * BS)]), LIVE2))
        lb.assign(f"i{i}", picks[-1], 1)
    assert picks == [0, 1, 1]
    ids = prompt(7, 9, 9)  # a text block, then the image: the text block's hash is shared
    cat, dog = (lb.prefix_hashes(ids, None, _request(ids, images=[(x, BS, 2 * BS)]).mm_features)
                for x in ("cat", "dog"))
    assert cat[0] == dog[0] == lb.prefix_hashes(ids)[0] and cat[1] != dog[1]


def test_a_pinned_rank_wins_over_the_rule_and_is_checked():
    """vLLM's ``data_parallel_rank``: the request goes to that replica even when it is the
    deeper one and another holds its prefix; its prefixes are recorded there. A rank outside
    the replicas is a ValueError, a pinned replica that is down a RuntimeError."""
    lb = DPLoadBalancer(2, BS)
    assert lb.choose(prompt(5, 6), LIVE2) == 0  # least loaded, records the prefix on 0
    lb.assign("a", 1, 7)
    assert lb.choose(prompt(5, 6), LIVE2, data_parallel_rank=1) == 1
    assert lb.preferred(lb.prefix_hashes(prompt(5, 6))) == 1
    for bad in (2, -1, True, "1"):
        with pytest.raises(ValueError, match="data_parallel_rank .* out of range"):
            lb.choose(prompt(5), LIVE2, data_parallel_rank=bad)
    with pytest.raises(RuntimeError, match="replica 0 .* not running"):
        lb.choose(prompt(5), [False, True], data_parallel_rank=0)


def test_the_prefix_map_is_bounded():
    lb = DPLoadBalancer(2, BS, affinity_blocks=1, max_entries=3)
    for b in range(5):
        lb.choose(prompt(b), LIVE2)
    assert len(lb._prefix_owner) == 3
    assert lb.preferred(lb.prefix_hashes(prompt(0))) is None  # the oldest went first
    assert lb.preferred(lb.prefix_hashes(prompt(4))) == 0


@pytest.mark.parametrize("kwargs", [{"num_replicas": 0, "block_size": 4},
                                    {"num_replicas": 2, "block_size": 0},
                                    {"num_replicas": 2, "block_size": 4, "slack": -1},
                                    {"num_replicas": 2, "block_size": 4,
                                     "min_shared_fraction": 1.5}])
def test_bad_arguments_are_a_value_error(kwargs):
    with pytest.raises(ValueError):
        DPLoadBalancer(**kwargs)
