"""The weight export behind the transports (model/hf_io.py: export_hf_weights `to`) over pipeline
stages: to rank 0 alone (what `memory` and `disk` send), or each stage its own (what a streaming
transport sends from `stage_senders`, in `buckets`), against the every-rank export."""
import torch

from tests.spawn import run_ranks

BUCKET_BYTES = 64 * 1024


def _exports(rank, world, sizes):
    from megatron_rl.model import BuildOptions, build_gpt_model
    from megatron_rl.model.hf_io import export_hf_weights
    from megatron_rl.model.presets import preset_arch
    from megatron_rl.trainer.transport import buckets, stage_senders
    from tests.mcore_setup import setup_parallel

    groups = setup_parallel(**sizes)
    arch = preset_arch("qwen3_moe")
    model = build_gpt_model(arch, groups, BuildOptions(seed=1))
    every = dict(export_hf_weights(model, arch, groups))
    stage = dict(export_hf_weights(model, arch, groups, to="stage"))
    to0 = dict(export_hf_weights(model, arch, groups, to=0))
    sent = [[(n, t.numel() * t.element_size()) for n, t in b]
            for b in buckets(export_hf_weights(model, arch, groups, to="stage"), BUCKET_BYTES)]
    same = all(torch.equal(stage[k], every[k]) for k in stage) and all(torch.equal(to0[k], every[k]) for k in to0)
    return {"every": sorted(every), "stage": sorted(stage), "to0": sorted(to0), "same": same,
            "senders": stage_senders(groups), "buckets": sent}


def test_each_stage_streams_its_own_tensors_and_rank_0_gets_them_all():
    r0, r1 = run_ranks(_exports, world_size=2, timeout=180, sizes={"pipeline_model_parallel_size": 2})
    assert r0["same"] and r1["same"]  # the same bytes whichever way they travel
    assert r0["to0"] == r0["every"]  # rank 0 gets every tensor (point to point from stage 1)...
    assert r1["to0"] == r1["stage"]  # ...and stage 1 materialises none of stage 0's
    assert not set(r0["stage"]) & set(r1["stage"]) and sorted(r0["stage"] + r1["stage"]) == r0["every"]
    assert r0["senders"] == r1["senders"] == (0, 1)
    for rank in (r0, r1):
        names = [n for b in rank["buckets"] for n, _ in b]
        assert names == [n for n in names if n in rank["stage"]] and sorted(names) == rank["stage"]
        assert all(len(b) == 1 or sum(size for _, size in b) <= BUCKET_BYTES for b in rank["buckets"])
