"""A new engine and a new rollout function are one file each plus one registry line.

This file is both: a toy engine that replays fixed token streams (no model) and a toy two-turn
rollout function, an agent loop in miniature (the engine's first turn, two environment tokens,
the engine's second turn, one token sequence per trajectory with the environment's tokens masked
out). Each is registered by its one `add` line and picked by the config (rollout.backend,
rollout.function), and the real RL loop trains on them in one gloo rank.
"""
from tests.spawn import run_ranks

ENV_TOKENS = [5, 6]  # what the toy environment answers every first turn with ('+', ',' of the char tokenizer)
MAX_TOKENS = 3


class ToyEngine:
    """RolloutEngine (and the memory transport's TakesTensors) that samples no model: the tokens of
    a request with stream (i, j) are drawn from stream_seed(seed, i, j) over ids 8..63, each reported at log-prob -2."""

    def __init__(self, request):
        self.arch, self.policy_version, self.versions = request.arch, -1, []

    @property
    def max_len(self) -> int:
        return self.arch.max_position_embeddings

    def generate(self, prompts, n, sampling):
        from megatron_rl.rollout.types import grouped, requests_of

        return grouped(self.generate_requests(requests_of(prompts, n, sampling)), len(prompts), n)

    def generate_requests(self, requests):
        import torch

        from megatron_rl.rollout import Sample
        from megatron_rl.rollout.types import stream_seed

        out = []
        for r in requests:
            g = torch.Generator().manual_seed(stream_seed(r.sampling.seed, *r.stream))
            ids = torch.randint(8, 64, (r.sampling.max_tokens,), generator=g)
            out.append(Sample(prompt_ids=torch.tensor(r.prompt_ids), response_ids=ids,
                              rollout_logprobs=torch.full((len(ids),), -2.0), finish_reason="length",
                              policy_version=self.policy_version, prompt_index=r.stream[0], sample_index=r.stream[1]))
        return out

    def update_weights(self, named_tensors, version):
        for _ in named_tensors:
            pass
        self.policy_version = version
        self.versions.append(version)

    def stats(self):
        return {"toy/weight_syncs": float(len(self.versions))}

    def close(self):
        pass


class TwoTurns:
    """RolloutFn: turn 1 from the engine, the environment's tokens, turn 2 from the engine given all
    of it; the response is turn 1 + environment + turn 2 with the environment masked out. Reward:
    the fraction of turn 2's ids that are even (scored as the environment sees it)."""

    def __init__(self, inputs):
        self.tokenizer = inputs.tokenizer

    def __call__(self, engine, examples, n, sampling):
        import torch

        from megatron_rl.rollout import Generated

        prompts = [self.tokenizer.encode_prompt(e.prompt) for e in examples]
        first = [s for group in engine.generate(prompts, n, sampling) for s in group]
        env = torch.tensor(ENV_TOKENS)
        contexts = [s.prompt_ids.tolist() + s.response_ids.tolist() + ENV_TOKENS for s in first]
        second = [group[0] for group in engine.generate(contexts, 1, sampling)]
        samples, rewards = [], []
        for s, t in zip(first, second, strict=True):
            mask = torch.cat([torch.ones(len(s.response_ids), dtype=torch.bool), torch.zeros(len(env), dtype=torch.bool),
                              torch.ones(len(t.response_ids), dtype=torch.bool)])
            samples.append(type(s)(prompt_ids=s.prompt_ids, response_ids=torch.cat([s.response_ids, env, t.response_ids]),
                                   rollout_logprobs=torch.cat([s.rollout_logprobs, torch.zeros(len(env)),
                                                               t.rollout_logprobs]),
                                   finish_reason=t.finish_reason, policy_version=s.policy_version,
                                   prompt_index=s.prompt_index, sample_index=s.sample_index, loss_mask=mask))
            rewards.append(float((t.response_ids % 2 == 0).float().mean()))
        return Generated(samples, lambda: rewards)


def _run(rank, world, run_dir):
    import json
    import os

    from megatron_rl.configure import load_config
    from megatron_rl.parallel import init_parallel
    from megatron_rl.platform import apply_platform_workarounds
    from megatron_rl.rollout import ENGINES, ROLLOUT_FNS, EngineSpec, RolloutFnSpec
    from megatron_rl.trainer.loop import close, train
    from megatron_rl.trainer.setup import setup

    ENGINES.add("toy_replay", EngineSpec(make=ToyEngine))            # the engine's registry line
    ROLLOUT_FNS.add("toy_two_turns", RolloutFnSpec(make=TwoTurns))   # the rollout function's
    try:
        apply_platform_workarounds()
        cfg = load_config(None, ["model.arch=qwen3", "model.size=tiny", "rollout.backend=toy_replay",
                                 "rollout.function=toy_two_turns", "rollout.prompts_per_step=2",
                                 "rollout.group_size=2", f"rollout.max_tokens={MAX_TOKENS}", "data.tasks=[sorting]",
                                 "train.steps=2", "train.num_minibatches=1", "train.micro_batch_size=2",
                                 "train.eval_size=0", "train.resume=false", f"train.run_dir={run_dir}",
                                 "log.tensorboard=false", "log.progress=false", "sft.steps=0"])
        ctx = setup(cfg, init_parallel(cfg.parallel, seed=cfg.train.seed))
        try:
            summary = train(ctx)
            versions = ctx.engine.versions
        finally:
            close(ctx)
    finally:
        ENGINES.remove("toy_replay")
        ROLLOUT_FNS.remove("toy_two_turns")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return summary, versions, rows


def test_a_toy_engine_and_a_two_turn_rollout_function_train_through_the_loop(tmp_path):
    [(summary, versions, rows)] = run_ranks(_run, world_size=1, timeout=180, run_dir=str(tmp_path))
    assert summary["steps"] == 2
    assert versions == [0, 1, 2]  # the memory transport: the initial weights, then after each step
    sampled = 2 * MAX_TOKENS      # per trajectory: both turns; the environment's tokens are masked out
    for row in rows:
        assert row["rollout/response_length"] == sampled
        assert row["mismatch/tokens"] == 4 * sampled  # 2 prompts x 2 samples, trained tokens only
        assert row["toy/weight_syncs"] >= 1 and 0.0 <= row["rollout/reward_mean"] <= 1.0
