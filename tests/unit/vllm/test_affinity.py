"""Prefix affinity (rollout/serving/affinity.py, ServerPool's placement): the longest recorded prefix
against a brute-force search, the table's bounds, and where a pool of stub servers sends requests
with and without affinity."""
import random

from megatron_rl.rollout.serving.affinity import BLOCK, PrefixTable, prefix_keys
from megatron_rl.rollout.serving.pool import AFFINITY_SLACK, DOWN, READY, Replica, ServerPool


class _Handle:
    url = "http://stub"


def _brute(records: list[tuple[list[int], int]], tokens: list[int]):
    """The owner and length of the longest prefix of `tokens` that some record holds and that ends
    at a block boundary (what vLLM's prefix cache reuses), or all of `tokens` when a record is
    exactly them (a prompt's other samples); the latest record wins."""
    for length in range(len(tokens), 0, -1):
        for seq, server in reversed(records):
            aligned = length % BLOCK == 0 and len(seq) >= length
            whole = length == len(tokens) == len(seq)
            if (aligned or whole) and seq[:length] == tokens[:length]:
                return server, length
    return None


def test_lookup_is_the_longest_recorded_prefix():
    rng = random.Random(0)
    stems = [[rng.randrange(50) for _ in range(rng.randrange(1, 40))] for _ in range(6)]
    records, table = [], PrefixTable()
    for _ in range(60):
        seq = rng.choice(stems) + [rng.randrange(3) for _ in range(rng.randrange(0, 30))]
        server = rng.randrange(3)
        table.record(seq, server)
        records.append((seq, server))
        probe = rng.choice(stems) + [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        assert table.lookup(probe) == _brute(records, probe), probe


def test_keys_follow_the_prefix_not_what_comes_after():
    a, b = list(range(40)), list(range(32)) + [99] * 8
    assert prefix_keys(a)[:2] == prefix_keys(b)[:2] and prefix_keys(a)[2] != prefix_keys(b)[2]
    assert [n for n, _ in prefix_keys(a)] == [16, 32, 40]


def test_a_trajectorys_next_turn_finds_its_server():
    table = PrefixTable()
    prompt, response, observation = list(range(8)), [20, 21, 22, 23, 24, 25, 26, 27, 28, 29], [40] * 6
    table.record(prompt, 1)
    assert table.lookup(prompt) == (1, 8)  # a sibling sample of the prompt
    table.record(prompt + response, 1)
    assert table.lookup(prompt + response + observation) == (1, 16)
    table.forget(1)
    assert table.lookup(prompt + response + observation) is None and len(table) == 0


def test_the_table_is_bounded():
    table = PrefixTable(capacity=5)
    for k in range(20):
        table.record([k] * 3, k % 2)
    assert len(table) == 5 and table.lookup([0] * 3) is None and table.lookup([19] * 3) == (1, 3)


def _pool(affinity=True):
    return ServerPool([Replica(k, _Handle(), state=READY) for k in range(2)], affinity=affinity)


def test_siblings_and_later_turns_go_to_the_prefix_server():
    pool, prompt = _pool(), list(range(8))
    with pool.serving(10, 1.0, prompt) as first:
        with pool.serving(10, 1.0, prompt) as sibling:  # least loaded would be the other one
            assert sibling is first
        with pool.serving(10, 1.0, [7, 7, 7]) as other:  # an unknown prompt goes by load
            assert other is not first
    pool.add_tokens(first, 10, prompt + list(range(30, 40)))
    with pool.serving(10, 1.0, prompt + list(range(30, 40)) + [5]) as turn2:
        assert turn2 is first
    assert pool.stats()["vllm/affinity/requests"] == 2 and pool.stats()["vllm/affinity/matched_tokens"] == 8 + 16


def test_without_affinity_requests_go_by_load_alone():
    pool, prompt = _pool(affinity=False), list(range(8))
    with pool.serving(10, 1.0, prompt) as first, pool.serving(10, 1.0, prompt) as second:
        assert first is not second
    assert "vllm/affinity/requests" not in pool.stats()


def test_a_busy_or_restarted_prefix_server_is_passed_over():
    pool, prompt = _pool(), list(range(8))
    with pool.serving(1, 1.0, prompt) as owner:
        held = [pool.serving(1, 1.0, [100 + k]) for k in range(2 * AFFINITY_SLACK + 2)]
        for h in held:
            h.__enter__()
        busy = owner.in_flight - min(r.in_flight for r in pool.replicas if r is not owner)
        with pool.serving(1, 1.0, prompt) as where:
            assert (where is owner) == (busy <= AFFINITY_SLACK)
            assert pool.stats()["vllm/affinity/passed_over"] == (busy > AFFINITY_SLACK)
        for h in held:
            h.__exit__(None, None, None)
    pool.set_state(owner, DOWN)
    pool.set_state(owner, READY)  # back with an empty cache: its prefixes are forgotten
    with pool.serving(1, 1.0, [3, 3]) as load_first, pool.serving(1, 1.0, prompt) as fresh:
        assert pool.prefixes.lookup(prompt)[0] == fresh.index and fresh is not load_first


def test_a_tie_in_load_goes_round_the_servers():
    """Idle servers (no known prefix, nothing in flight) take requests in turn, not server 0 each
    time; a tie among some of them goes to the first after the server of the last request."""
    pool = ServerPool([Replica(k, _Handle(), state=READY) for k in range(3)], affinity=False)
    taken = []
    for _ in range(7):
        with pool.serving(10, 1.0, [1, 2, 3]) as r:  # released at once: every pick is a three-way tie
            taken.append(r.index)
    assert taken == [0, 1, 2, 0, 1, 2, 0]
    with pool.serving(5, 1.0) as busy:  # server 1 (after 0, the last); 0 and 2 then tie
        assert busy.index == 1
        with pool.serving(5, 1.0) as a, pool.serving(5, 1.0) as b:
            assert (a.index, b.index) == (2, 0)
    affine = _pool()
    with affine.serving(10, 1.0, [1, 2, 3]) as first:
        pass
    with affine.serving(10, 1.0, [1, 2, 3]) as sibling:
        assert sibling is first  # the turn says server 1; the known prefix wins
