"""The RL loop end to end on a tiny random MoE: 2 ranks (TP=2, EP=2) vs 1 rank, and resume.

A dense reward (fraction of digits in the response) gives every group mixed rewards, so the
updates are non-trivial from step one without any warm start. Every run starts from the same
random HF checkpoint, so all parallel layouts hold identical initial weights (megatron's own
random init of experts depends on the EP layout).
"""
import json
import os

import pytest
import torch

from megatron_rl.rewards import register_reward
from tests.spawn import run_ranks


@register_reward("test_digit_fraction")
def digit_fraction(prompt: str, response: str, label: str) -> float:
    return sum(c.isdigit() for c in response) / max(len(response), 1)


BASE = ["model.size=tiny", "rollout.dtype=fp32", "rollout.prompts_per_step=4", "rollout.group_size=4",
        "rollout.max_tokens=4", "data.reward=test_digit_fraction", "train.micro_batch_size=2",
        "train.num_minibatches=2", "train.eval_every=0", "optim.lr=1e-2", "log.tensorboard=false",
        "log.progress=false", "sft.steps=0"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from megatron_rl.model.parity import random_hf_model
    from megatron_rl.model.presets import preset_arch

    path = str(tmp_path_factory.mktemp("hf"))
    random_hf_model(preset_arch("qwen3_moe", "tiny"), seed=0, std=0.2).save_pretrained(path)
    return path


def _run(rank, world, overrides, run_dir):
    from megatron_rl.configure import load_config
    from megatron_rl.parallel import init_parallel
    from megatron_rl.platform import apply_platform_workarounds
    from megatron_rl.trainer.loop import close, train
    from megatron_rl.trainer.setup import setup

    apply_platform_workarounds()
    cfg = load_config(None, BASE + [f"train.run_dir={run_dir}"] + overrides)
    groups = init_parallel(cfg.parallel, seed=cfg.train.seed)
    ctx = setup(cfg, groups)
    try:
        summary = train(ctx)
        weights = dict(ctx.policy.export())
    finally:
        close(ctx)
    steps = []
    if rank == 0:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            steps = [json.loads(line) for line in f]
    return summary, weights, steps


@pytest.fixture(scope="module")
def single(tmp_path_factory, hf_dir):
    run_dir = str(tmp_path_factory.mktemp("ws1"))
    [out] = run_ranks(_run, world_size=1, timeout=300, overrides=["train.steps=2", f"model.hf_dir={hf_dir}"],
                      run_dir=run_dir)
    return out


def test_single_rank_updates_the_policy(single):
    _, _, steps = single
    assert len(steps) == 2
    assert steps[0]["loss/policy"] != 0.0 and steps[0]["optim/grad_norm"] > 0
    assert 0 <= steps[0]["mismatch/kl_k3"] < 1e-6  # fp32 engine vs fp32 trainer: same weights
    for k in ("timing/generate", "timing/old_logprobs", "timing/train", "timing/weight_sync",
              "rollout/reward_mean", "rollout/response_length", "mismatch/entropy", "mismatch/w/p01",
              "mismatch/w/p99", "mismatch/r/p01", "mismatch/r/p99", "mismatch/rho/p01", "mismatch/rho/p99"):
        assert k in steps[0], k
    assert steps[0]["mismatch/r/p01"] <= steps[0]["mismatch/r/p99"]


@pytest.mark.parametrize("layout", [
    pytest.param(["--tensor-model-parallel-size", "2"], marks=pytest.mark.mcore_api),  # grad norm, allreduce attrs
    ["--expert-model-parallel-size", "2"],
], ids=["tp2", "ep2"])
def test_two_ranks_match_single_rank(single, hf_dir, layout, tmp_path):
    _, ref_weights, ref_steps = single
    outs = run_ranks(_run, world_size=2, timeout=400, overrides=["train.steps=2", f"model.hf_dir={hf_dir}"] + layout,
                     run_dir=str(tmp_path))
    _, weights, steps = outs[0]
    # step 1 uses the same samples (same engine weights and seeds): same loss, grad norm, update
    # the ratio quantiles are over all ranks' tokens (EP=2 here is DP=2), not the most extreme rank's
    for k in ("loss/policy", "optim/grad_norm", "rollout/reward_mean", "mismatch/r/p01", "mismatch/r/p99",
              "mismatch/rho/p01", "mismatch/rho/p99"):
        assert steps[0][k] == pytest.approx(ref_steps[0][k], rel=1e-4, abs=1e-6), k
    assert torch.equal(outs[0][1]["model.norm.weight"], outs[1][1]["model.norm.weight"])  # ranks agree
    # rank 0 sent each rank its part of the batch (trainer/scatter.py), the same size on both ranks:
    # under DP=2 (EP=2) half of it, under TP=2 the whole of it (rows padded to an even length for
    # sequence parallelism: a little more than one rank's); one rank keeps the whole batch
    whole, got = ref_steps[0]["rollout/bytes_received/max"], steps[0]["rollout/bytes_received/max"]
    assert whole == ref_steps[0]["rollout/bytes_received/sum"] > 0
    assert steps[0]["rollout/bytes_received/sum"] == 2 * got
    assert got == whole / 2 if "--expert-model-parallel-size" in layout else whole <= got < 1.2 * whole
    assert weights.keys() == ref_weights.keys()
    # after two steps the policies agree up to float reordering (step 2 samples may differ if a
    # tiny difference flips a sampled token, hence the loose tolerance)
    for k in ref_weights:
        torch.testing.assert_close(weights[k], ref_weights[k], rtol=2e-3, atol=2e-4, msg=k)


@pytest.mark.mcore_api  # the whole stack: grad norm, ChainedOptimizer checkpoint, the reaped writer queue
def test_resume_reproduces_uninterrupted_run(tmp_path):
    full_dir, part_dir = str(tmp_path / "full"), str(tmp_path / "part")
    [(_, w_full, s_full)] = run_ranks(_run, world_size=1, timeout=300, overrides=["train.steps=3"], run_dir=full_dir)
    # stop after 2 steps (a checkpoint is written at the end), then resume to 3
    run_ranks(_run, world_size=1, timeout=300, overrides=["train.steps=2"], run_dir=part_dir)
    [(_, w_res, s_res)] = run_ranks(_run, world_size=1, timeout=300,
                                    overrides=["train.steps=3", "train.resume=true"], run_dir=part_dir)
    assert len(s_res) == 3  # metrics.jsonl is appended by the resumed run
    for k in ("loss/policy", "optim/grad_norm", "rollout/reward_mean", "mismatch/kl_k3"):
        assert s_res[2][k] == s_full[2][k], k
    for k in w_full:
        assert torch.equal(w_full[k], w_res[k]), k


def test_keep_sampling_mask_shares_the_action_space(tmp_path, hf_dir):
    """top-p sampling: the engine reports log-probs renormalised over its kept set; the trainer
    renormalises π over the same set, so an fp32 engine and the fp32 trainer agree exactly (were
    the trainer to use the full vocabulary, every token with mass outside the set would differ)."""
    common = ["train.steps=1", f"model.hf_dir={hf_dir}", "rollout.top_p=0.7", "rollout.temperature=1.0"]
    [(_, _, steps)] = run_ranks(_run, world_size=1, timeout=300, run_dir=str(tmp_path / "on"),
                                overrides=common + ["loss.keep_sampling_mask=true"])
    assert steps[0]["mismatch/kl_k3"] < 1e-8
    assert steps[0]["mismatch/w/max"] == pytest.approx(1.0, abs=1e-4)


def test_keep_sampling_mask_requires_truncation():
    from megatron_rl.config import ConfigError
    from megatron_rl.configure import load_config

    with pytest.raises(ConfigError, match="keep_sampling_mask needs truncated sampling"):
        load_config(None, ["loss.keep_sampling_mask=true"])


def _failing_engine(rank, world, run_dir, hf, where, stopping):
    import signal

    from megatron_rl.configure import load_config
    from megatron_rl.parallel import init_parallel
    from megatron_rl.platform import apply_platform_workarounds
    from megatron_rl.trainer.checkpoint import latest_checkpoint
    from megatron_rl.trainer.loop import close, train
    from megatron_rl.trainer.rl_step import RolloutFailed
    from megatron_rl.trainer.setup import setup
    from megatron_rl.trainer.stop import Stopped

    apply_platform_workarounds()
    cfg = load_config(None, BASE + [f"train.run_dir={run_dir}", "train.steps=3", f"model.hf_dir={hf}",
                                    "--tensor-model-parallel-size", str(world)])
    ctx = setup(cfg, init_parallel(cfg.parallel, seed=cfg.train.seed))
    if ctx.engine is not None:  # rank 0 holds the engine: it dies during the second step
        # generate: 1-2 greedy + sampled eval before RL, 3 step 1, 4 step 2 (before its update);
        # update_weights: 1 before RL, 2 after step 1, 3 after step 2's update
        method, fail_at = {"generate": ("generate", 4), "sync": ("update_weights", 3)}[where]
        real, calls = getattr(ctx.engine, method), []

        def failing(*args, **kwargs):
            calls.append(1)
            if len(calls) == fail_at:
                if stopping:
                    ctx.stop.signum = signal.SIGTERM
                raise ConnectionError("server went away")
            return real(*args, **kwargs)

        setattr(ctx.engine, method, failing)
    try:
        expected = (Stopped, "stopped by SIGTERM after step 1 .*resume") if stopping else (RolloutFailed, "resume")
        with pytest.raises(expected[0], match=expected[1]):
            train(ctx)
    finally:
        close(ctx)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line)["step"] for line in f if json.loads(line).get("phase") == "rl"]
    return os.path.basename(latest_checkpoint(os.path.join(run_dir, "checkpoints"))), rows


@pytest.mark.parametrize("where,completed,stopping", [("generate", 1, False), ("sync", 2, False),
                                                      ("generate", 1, True)])
def test_engine_failure_stops_every_rank_with_a_resumable_checkpoint(tmp_path, hf_dir, where, completed, stopping):
    """A failure before step 2's update keeps step 1; one in the weight sync after step 2's update
    keeps step 2, in the checkpoint and in the metrics log (its row is written before the save).
    stopping: the engine fails after rank 0 got SIGTERM (SLURM signals the vLLM server too): every
    rank ends as a stopped run, not as a failed one."""
    # two ranks: the rank without the engine must not hang waiting for samples
    out = run_ranks(_failing_engine, world_size=2, timeout=300, run_dir=str(tmp_path), hf=hf_dir, where=where,
                    stopping=stopping)
    expected = (f"iter_{completed:07d}", list(range(1, completed + 1)))
    assert out == [expected, expected]


def _run_twice(rank, world, run_dir):
    """pretrain_rl.py's sequence (groups, run: SFT, RL steps, evaluations, then teardown) twice in
    one process; the threads and open files after each."""
    import gc

    import psutil
    import torch.distributed as dist

    from megatron_rl.configure import load_config
    from megatron_rl.parallel import destroy_parallel, init_parallel
    from megatron_rl.platform import apply_platform_workarounds
    from megatron_rl.trainer.loop import run

    apply_platform_workarounds()
    counts = []
    for k in range(2):
        if not dist.is_initialized():  # the pool's store, still listening in the parent: a new prefix
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
            dist.init_process_group("gloo", store=dist.PrefixStore(f"run{k}", store), rank=rank, world_size=world)
        cfg = load_config(None, BASE + [f"train.run_dir={run_dir}/{k}", "sft.steps=2", "train.steps=2",
                                        "train.eval_every=1", "train.eval_size=4"])
        try:
            run(cfg, init_parallel(cfg.parallel, seed=cfg.train.seed))
        finally:
            destroy_parallel()
        gc.collect()  # the run's objects form cycles: what is unreachable goes at the next collection
        me = psutil.Process()
        counts.append((me.num_threads(), me.num_fds()))
    return counts


def test_a_second_run_in_one_process_keeps_nothing_of_the_first(tmp_path):
    """A run's model and process groups go with it (trainer.stack.release_model, destroy_parallel):
    gloo holds threads and sockets per group, so a leak shows in both counts."""
    for first, second in run_ranks(_run_twice, world_size=2, run_dir=str(tmp_path)):
        assert second[0] <= first[0] + 2 and second[1] <= first[1] + 4, (first, second)
