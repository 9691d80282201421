"""The weight export behind the transports (model/hf_io.py: export_hf_weights `to`) over pipeline
stages: to rank 0 alone (what `memory` and `disk` send) against the every-rank export."""
import torch

from tests.spawn import run_ranks


def _exports(rank, world, sizes):
    from megatron_rl.model import BuildOptions, build_gpt_model
    from megatron_rl.model.hf_io import export_hf_weights
    from megatron_rl.model.presets import preset_arch
    from tests.mcore_setup import setup_parallel

    groups = setup_parallel(**sizes)
    arch = preset_arch("qwen3_moe")
    model = build_gpt_model(arch, groups, BuildOptions(seed=1))
    every = dict(export_hf_weights(model, arch, groups))
    to0 = dict(export_hf_weights(model, arch, groups, to=0))
    same = all(torch.equal(to0[k], every[k]) for k in to0)
    return {"every": sorted(every), "to0": sorted(to0), "same": same}


def test_rank_0_gets_every_tensor_and_the_other_stage_only_its_own():
    r0, r1 = run_ranks(_exports, world_size=2, timeout=180, sizes={"pipeline_model_parallel_size": 2})
    assert r0["same"] and r1["same"]  # the same bytes whichever way they travel
    assert r0["to0"] == r0["every"]  # rank 0 gets every tensor (point to point from stage 1)...
    assert r1["to0"] and set(r1["to0"]) < set(r1["every"])  # ...and stage 1 keeps only its own stage's
    assert not any(".layers.0." in n for n in r1["to0"]) and any(".layers.1." in n for n in r1["to0"])
