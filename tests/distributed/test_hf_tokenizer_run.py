"""An RL step with a model's own tokenizer: a byte-level BPE of 300 tokens.

- data.tokenizer=hf on an HF model folder of 320 rows (a padded vocabulary, as a real
  checkpoint's is);
- data.tokenizer=<folder> with the tiny preset and a post-processor that starts every prompt with
  a BOS (as Llama 3's does): the preset gets the tokenizer's vocabulary padded to 384 rows.
The prompts reach the engine in the BPE's ids (with the BOS), and the trainer trains."""
import json
import math
import os

import pytest

from tests.distributed.test_rl_loop import BASE
from tests.spawn import run_ranks
from tests.unit.data.test_hf_tokenizer import write_tokenizer


def _run(rank, world, overrides, run_dir, vocab):
    from megatron_rl.configure import load_config
    from megatron_rl.data.hf_tokenizer import HfTokenizer
    from megatron_rl.parallel import init_parallel
    from megatron_rl.platform import apply_platform_workarounds
    from megatron_rl.trainer import phases
    from megatron_rl.trainer.loop import close, train
    from megatron_rl.trainer.setup import setup

    apply_platform_workarounds()
    cfg = load_config(None, BASE + [f"train.run_dir={run_dir}", "train.steps=1", "rollout.max_tokens=6", *overrides])
    ctx = setup(cfg, init_parallel(cfg.parallel, seed=cfg.train.seed))
    seen = []
    real = phases.make_batch

    def make_batch(ctx_, rollout):
        seen.extend(s.prompt_ids.tolist() for s in rollout.samples)
        return real(ctx_, rollout)

    phases.make_batch = make_batch
    try:
        assert isinstance(ctx.tokenizer, HfTokenizer) and ctx.policy.arch.vocab_size == vocab
        train(ctx)
        prompts = [ctx.tokenizer.decode(p) for p in seen]
        lengths = [(len(p), len(text)) for p, text in zip(seen, prompts, strict=True)]
    finally:
        phases.make_batch = real
        close(ctx)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    return prompts, lengths, [p[0] for p in seen], ctx.tokenizer.bos_id, steps


@pytest.mark.parametrize("kind", ["hf_dir", "preset+bos"])
def test_rl_step_with_the_models_own_tokenizer(tmp_path, kind):
    from megatron_rl.model.parity import random_hf_model
    from megatron_rl.model.presets import preset_arch

    folder = tmp_path / "hf"
    if kind == "hf_dir":
        random_hf_model(preset_arch("qwen3", "tiny", vocab_size=320), seed=0, std=0.2).save_pretrained(str(folder))
        write_tokenizer(folder)
        overrides, vocab = [f"model.hf_dir={folder}", "data.tokenizer=hf"], 320
    else:
        write_tokenizer(folder, bos=True)
        overrides, vocab = ["model.arch=qwen3", "model.size=tiny", f"data.tokenizer={folder}"], 384
    [(prompts, lengths, firsts, bos, steps)] = run_ranks(_run, world_size=1, timeout=300, overrides=overrides,
                                                          run_dir=str(tmp_path / "run"), vocab=vocab)
    assert len(steps) == 1 and math.isfinite(steps[0]["loss/policy"]) and steps[0]["optim/grad_norm"] > 0
    assert prompts and all(p.endswith("=") and "+" in p for p in prompts), prompts[:4]   # the addition task's
    assert any(n_ids < n_chars for n_ids, n_chars in lengths), lengths[:4]   # BPE merges: not one id per char
    assert (bos is not None) == (kind == "preset+bos") and (bos is None or set(firsts) == {bos})
