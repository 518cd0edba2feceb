"""The synthetic workload: seeded, with prefixes shared the way chat traffic shares them."""

from kvpipe.connector.run.workload import chain_hashes, generate

SHAPE = dict(
    requests=60,
    system_prompts=3,
    system_prompt_tokens=(32, 64),
    user_tokens=(4, 16),
    output_tokens=(4, 16),
    max_turns=4,
    vocab_size=1000,
)


def test_the_same_seed_gives_the_same_requests():
    assert generate(seed=7, **SHAPE) == generate(seed=7, **SHAPE)
    assert generate(seed=7, **SHAPE) != generate(seed=8, **SHAPE)


def test_request_ids_are_unique():
    requests = generate(seed=0, **SHAPE)
    assert len({r.request_id for r in requests}) == len(requests) == 60


def test_a_later_turn_continues_the_whole_previous_context():
    requests = {r.request_id: r for r in generate(seed=0, **SHAPE)}
    continued = [(rid, rid.replace("turn1", "turn0")) for rid in requests if rid.endswith("turn1")]
    assert continued
    for later, earlier in continued:
        assert requests[later].prompt[: len(requests[earlier].tokens)] == requests[earlier].tokens


def test_conversations_share_system_prompts():
    firsts = [r.prompt[:32] for r in generate(seed=0, **SHAPE) if r.request_id.endswith("turn0")]
    assert len(set(firsts)) <= 3 < len(firsts)


def test_chained_hashes_agree_on_a_shared_prefix_and_differ_after_it():
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], hash_block_size=4)
    b = chain_hashes([1, 2, 3, 4, 5, 6, 7, 9], hash_block_size=4)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]


def test_only_complete_hash_blocks_are_hashed():
    assert len(chain_hashes(list(range(11)), hash_block_size=4)) == 2
