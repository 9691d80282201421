"""Router replay inside the RL step, on multi-turn trajectories (agreement by turn too): R3 with a
bf16 engine (one rank, and EP=2 x DP=2 where each rank receives the engine's routing of its own
rows only), R2's first mini-batch identity."""
import pytest

from tests.distributed.test_rl_loop import _run, hf_dir  # noqa: F401 - fixture
from tests.spawn import run_ranks

BF16 = ["train.steps=1", "rollout.dtype=bf16", "rollout.prompts_per_step=8", "rollout.max_tokens=6"]


def _step(tmp_path, name, hf, extra):
    [(_, _, steps)] = run_ranks(_run, world_size=1, timeout=300, run_dir=str(tmp_path / name),
                                overrides=BF16 + [f"model.hf_dir={hf}"] + extra)
    return steps[0]


# multi-turn trajectories: guess answers a random model's non-numbers with "?" and goes on, so the
# batch has turns (and the agreement is also logged by turn)
TURNS = ["rollout.function=multi_turn", "env.name=guess", "env.max_turns=2", "data.tasks=[guessing]"]


@pytest.fixture(scope="module")
def r3_turns(tmp_path_factory, hf_dir):  # noqa: F811
    return _step(tmp_path_factory.mktemp("r3"), "r3", hf_dir, TURNS + ["--router-replay", "r3"])


def test_r3_replays_engine_routing_and_lowers_mismatch(tmp_path, hf_dir, r3_turns):  # noqa: F811
    free, r3 = _step(tmp_path, "none", hf_dir, TURNS), r3_turns
    # the probe: how often θ_old's live router picks the engine's experts (the flips R3 prevents;
    # that the replayed routing maps equal the engine's is asserted in test_router_replay.py)
    assert 0.9 < r3["moe/route_agree_rollout_train"] < 1.0
    assert r3["env/turns"] > 1.5  # most trajectories took both turns
    for t in ("0", "1"):
        assert 0.9 < r3[f"moe/route_agree_rollout_train/turn/{t}"] <= 1.0
    assert r3["moe/route_agree_rollout_train/turn/3_or_later"] == 0.0  # no such turn: an empty bucket
    assert r3["moe/replayed_token_fraction"] > 0.5
    # same samples (same engine, same seeds); replaying the engine's experts removes the routing
    # part of the training-inference mismatch
    assert r3["rollout/reward_mean"] == free["rollout/reward_mean"]
    assert r3["mismatch/kl_k3"] < free["mismatch/kl_k3"], (r3["mismatch/kl_k3"], free["mismatch/kl_k3"])


def test_r3_under_expert_and_data_parallelism_matches_one_rank(tmp_path, hf_dir, r3_turns):  # noqa: F811
    """EP=2 on two ranks is DP=2 of the dense layout: rank 0 sends each rank its rows with their
    engine routing (trainer/scatter.py), and the step is the single rank's."""
    outs = run_ranks(_run, world_size=2, timeout=400, run_dir=str(tmp_path),
                     overrides=BF16 + TURNS + [f"model.hf_dir={hf_dir}", "--router-replay", "r3",
                                               "--expert-model-parallel-size", "2"])
    two = outs[0][2][0]
    for k in ("loss/policy", "optim/grad_norm", "mismatch/kl_k3", "moe/route_agree_rollout_train",
              "moe/route_agree_rollout_train/turn/1"):
        assert two[k] == pytest.approx(r3_turns[k], rel=1e-4, abs=1e-7), k
    assert two["moe/replayed_token_fraction"] == r3_turns["moe/replayed_token_fraction"]
    assert two["rollout/bytes_received/max"] == r3_turns["rollout/bytes_received/max"] / 2


@pytest.mark.mcore_api  # routing recorded under no_grad (unsorted top-k on 0.19) replayed in training
def test_r2_keeps_the_first_minibatch_and_reports_routing(tmp_path, hf_dir):  # noqa: F811
    one = ["train.num_minibatches=1", "rollout.dtype=fp32"] + TURNS
    free = _step(tmp_path, "none", hf_dir, one)
    r2 = _step(tmp_path, "r2", hf_dir, one + ["--router-replay", "r2"])
    # θ = θ_old in the first mini-batch: replaying θ_old's own routing changes nothing
    assert r2["loss/policy"] == pytest.approx(free["loss/policy"], rel=1e-6, abs=1e-9)
    assert r2["optim/grad_norm"] == pytest.approx(free["optim/grad_norm"], rel=1e-5)
    assert r2["moe/route_agree_old_new"] == 1.0
    assert 0.9 < r2["moe/route_agree_rollout_train"] <= 1.0  # fp32 engine vs fp32 trainer
    assert all(0.9 < r2[f"moe/route_agree_rollout_train/turn/{t}"] <= 1.0 for t in ("0", "1"))


def test_r2_with_two_minibatches_replays_after_an_update(tmp_path, hf_dir):  # noqa: F811
    r2 = _step(tmp_path, "r2n2", hf_dir, ["--router-replay", "r2", "optim.lr=5e-2"])
    # after the first optimizer step the live router would choose differently on some tokens;
    # replay keeps θ_old's choice (the probe measures the disagreement it prevents)
    assert r2["moe/route_agree_old_new"] < 1.0

