"""An RL step on an HF model folder with its own tokenizer (data.tokenizer=hf): a byte-level BPE
whose vocabulary (300 tokens) is smaller than the model's (320 rows, a padded vocabulary), as a
real checkpoint's is. The prompts reach the engine in the BPE's ids, and the trainer trains."""
import json
import math
import os

import pytest

from tests.distributed.test_rl_loop import BASE
from tests.spawn import run_ranks
from tests.unit.data.test_hf_tokenizer import write_tokenizer

pytestmark = pytest.mark.slow


def _run(rank, world, hf_dir, run_dir):
    from megatron_rl.config import load_config
    from megatron_rl.data.hf_tokenizer import HfTokenizer
    from megatron_rl.parallel import init_parallel
    from megatron_rl.platform import apply_platform_workarounds
    from megatron_rl.trainer import phases
    from megatron_rl.trainer.loop import close, setup, train

    apply_platform_workarounds()
    cfg = load_config(None, BASE + [f"train.run_dir={run_dir}", f"model.hf_dir={hf_dir}", "data.tokenizer=hf",
                                    "train.steps=1", "rollout.max_tokens=6"])
    ctx = setup(cfg, init_parallel(cfg.parallel, seed=cfg.train.seed))
    seen = []
    real = phases.make_batch

    def make_batch(ctx_, rollout):
        seen.extend(s.prompt_ids.tolist() for s in rollout.samples)
        return real(ctx_, rollout)

    phases.make_batch = make_batch
    try:
        assert isinstance(ctx.tokenizer, HfTokenizer) and ctx.policy.arch.vocab_size == 320
        train(ctx)
        prompts = [ctx.tokenizer.decode(p) for p in seen]
        lengths = [(len(p), len(text)) for p, text in zip(seen, prompts, strict=True)]
    finally:
        phases.make_batch = real
        close(ctx)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    return prompts, lengths, steps


def test_rl_step_with_the_models_own_tokenizer(tmp_path):
    from megatron_rl.model.parity import random_hf_model
    from megatron_rl.model.presets import preset_arch

    hf_dir = tmp_path / "hf"
    random_hf_model(preset_arch("qwen3", "tiny", vocab_size=320), seed=0, std=0.2).save_pretrained(str(hf_dir))
    write_tokenizer(hf_dir)
    [(prompts, lengths, steps)] = run_ranks(_run, world_size=1, timeout=300, hf_dir=str(hf_dir),
                                                       run_dir=str(tmp_path / "run"))
    assert len(steps) == 1 and math.isfinite(steps[0]["loss/policy"]) and steps[0]["optim/grad_norm"] > 0
    assert prompts and all(p.endswith("=") and "+" in p for p in prompts), prompts[:4]   # the addition task's
    assert any(n_ids < n_chars for n_ids, n_chars in lengths), lengths[:4]   # BPE merges: not one id per char
