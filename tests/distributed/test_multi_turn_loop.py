"""The multi_turn rollout function in the real RL loop (one gloo rank, the toy replay engine of
test_toy_seams): trajectories with environment turns train, an environment that raises and one
that hangs end their trajectories with a recorded failure and the run goes on, and the per-turn
mismatch and env/* metrics reach metrics.jsonl. The hang is an Event the run never sets (released
once the run is over); its deadline is short and nothing else waits on a clock."""
import pytest

from tests.spawn import run_ranks

MAX_TOKENS = 3


def _run(rank, world, run_dir, backend="toy_replay", failing=True, steps=2, schedule=(), resume=False):
    import json
    import os
    import threading

    from megatron_rl.configure import load_config
    from megatron_rl.data.envs import ENVS, Environment, Step, register_env
    from megatron_rl.parallel import init_parallel
    from megatron_rl.platform import apply_platform_workarounds
    from megatron_rl.rollout import ENGINES, EngineSpec
    from megatron_rl.trainer.loop import close, train
    from megatron_rl.trainer.setup import setup
    from tests.distributed.test_toy_seams import ToyEngine

    release = threading.Event()

    class Chatty(Environment):
        """Answers ",," after the first turn, ends after the second with reward 1 when its last id is
        even. The first trajectory reset in the run raises in step, the second hangs there (resets
        run in threads: which trajectories those are may vary, how many does not)."""

        max_turns = 2
        resets, lock = 0, threading.Lock()

        def reset(self, example):
            with Chatty.lock:
                self.nth, self.turns = Chatty.resets, 0
                Chatty.resets += 1
            return example.prompt

        def step(self, generated_text, generated_ids):
            if failing and self.nth == 0:
                raise RuntimeError("the tool crashed")
            if failing and self.nth == 1:
                release.wait()
            self.turns += 1
            if self.turns == 1:
                return Step(",,", None, False)
            return Step("", float(generated_ids[-1] % 2 == 0), True)

    register_env("chatty")(Chatty)
    ENGINES.add("toy_replay", EngineSpec(make=ToyEngine))
    try:
        apply_platform_workarounds()
        cfg = load_config(None, ["model.arch=qwen3", "model.size=tiny", f"rollout.backend={backend}",
                                 "rollout.dtype=fp32", "rollout.function=multi_turn", "env.name=chatty", "env.timeout_s=0.5",
                                 "env.check_render=true", "rollout.prompts_per_step=2", "rollout.group_size=2",
                                 f"rollout.max_tokens={MAX_TOKENS}", "data.tasks=[sorting]", f"train.steps={steps}",
                                 "train.num_minibatches=1", "train.micro_batch_size=2", "train.eval_size=0",
                                 f"train.resume={str(resume).lower()}", f"train.run_dir={run_dir}",
                                 "log.tensorboard=false",
                                 "log.progress=false", "sft.steps=0", *schedule])
        ctx = setup(cfg, init_parallel(cfg.parallel, seed=cfg.train.seed))
        try:
            summary = train(ctx)
            weights = dict(ctx.policy.export())
        finally:
            close(ctx)
    finally:
        release.set()
        ENGINES.remove("toy_replay")
        ENVS.pop("chatty")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return summary, [r for r in rows if r.get("phase") == "rl"], weights


def test_multi_turn_trajectories_train_and_a_failing_environment_does_not_stop_the_run(tmp_path):
    [(summary, rows, _)] = run_ranks(_run, world_size=1, timeout=240, run_dir=str(tmp_path))
    assert summary["steps"] == 2 and len(rows) == 2
    first, second = rows
    assert first["env/failures"] == 2 and first["env/timeouts"] == 1  # the raise and the hang, step 1
    assert second["env/failures"] == 0 and second["env/turns"] == 2
    # 2 of step 1's trajectories ended after their first turn, the others sampled two turns
    assert first["mismatch/tokens"] == (2 * 1 + 2 * 2) * MAX_TOKENS and second["mismatch/tokens"] == 4 * 2 * MAX_TOKENS
    assert second["mismatch/turn/0/tokens"] == second["mismatch/turn/1/tokens"] == 4 * MAX_TOKENS
    assert second["env/observation_tokens"] == 2 and second["env/render_drift"] >= 0
    assert 0.0 <= second["rollout/reward_mean"] <= 1.0


def test_the_trainer_scores_the_tokens_the_engine_sampled_in_every_turn(tmp_path):
    """The embedded engine in fp32 against the fp32 trainer: μ and π_old agree to rounding on every
    turn's tokens, which holds only if the trainer's row holds the very ids each turn was sampled
    from and scores them at the positions the engine did (turn 2's μ shifted by one position
    gives a KL k3 of 1.5e-2)."""
    [(summary, rows, _)] = run_ranks(_run, world_size=1, timeout=240, run_dir=str(tmp_path), backend="embedded",
                                  failing=False, steps=1)
    [row] = rows
    assert summary["steps"] == 1 and row["env/failures"] == 0
    for turn in ("0", "1"):
        assert row[f"mismatch/turn/{turn}/tokens"] > 0
        assert row[f"mismatch/turn/{turn}/kl_k3"] < 1e-8 and row[f"mismatch/turn/{turn}/abs_logprob_diff"] < 1e-4


@pytest.mark.parametrize("schedule", [["train.schedule=staged", "train.stages=1"],
                                      ["train.schedule=async", "train.max_staleness=1"]], ids=["staged", "async"])
def test_multi_turn_runs_under_the_off_policy_schedules(tmp_path, schedule):
    """staged: both steps' trajectories from one rollout call (its env/* statistics on the first
    step's row); async: generated in a background thread while the trainer updates."""
    [(summary, rows, _)] = run_ranks(_run, world_size=1, timeout=240, run_dir=str(tmp_path), failing=False,
                                  schedule=schedule)
    assert summary["steps"] == 2 and len(rows) == 2
    assert rows[0]["env/turns"] == 2 and rows[0]["env/failures"] == 0
    for row in rows:
        assert row["mismatch/turn/0/tokens"] == row["mismatch/turn/1/tokens"] == 4 * MAX_TOKENS


@pytest.mark.mcore_api  # the whole stack, as test_rl_loop's resume test
def test_a_resumed_multi_turn_run_reproduces_the_uninterrupted_one(tmp_path):
    """Embedded engine, two-turn trajectories: 3 steps in one go vs 2 steps, then a resume to 3."""
    import torch

    # lockstep (the default, named here because it is the point): each engine call holds every running
    # trajectory, whatever the environments' timing (async calls take what is pending, so their
    # numbers move by the engine's batch-shape noise)
    kw = {"backend": "embedded", "failing": False, "schedule": ["env.turns=lockstep"]}
    [(_, full, w_full)] = run_ranks(_run, world_size=1, timeout=300, run_dir=str(tmp_path / "full"), steps=3, **kw)
    run_ranks(_run, world_size=1, timeout=300, run_dir=str(tmp_path / "part"), steps=2, **kw)
    [(_, part, w_res)] = run_ranks(_run, world_size=1, timeout=300, run_dir=str(tmp_path / "part"), steps=3,
                                   resume=True, **kw)
    assert len(part) == 3 and part[2]["env/turns"] == full[2]["env/turns"] == 2
    for k in ("loss/policy", "optim/grad_norm", "rollout/reward_mean", "mismatch/kl_k3", "mismatch/turn/1/kl_k3"):
        assert part[2][k] == full[2][k], k
    assert any(r["optim/grad_norm"] > 0 for r in full)  # the steps did update the policy
    for k in w_full:
        assert torch.equal(w_full[k], w_res[k]), k
