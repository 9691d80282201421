"""dist_checkpointing round trips (with timeouts: a broken async writer hangs instead of failing)."""
import os

import pytest
import torch

from tests.spawn import run_ranks


def _save(rank, world, root, sizes, seed, arch="qwen3_moe"):
    from megatron_rl.model import BuildOptions, build_gpt_model
    from megatron_rl.model.hf_io import export_hf_weights
    from megatron_rl.model.presets import preset_arch
    from megatron_rl.trainer.checkpoint import save_checkpoint
    from tests.mcore_setup import setup_parallel

    groups = setup_parallel(**sizes)
    arch = preset_arch(arch)
    model = build_gpt_model(arch, groups, BuildOptions(seed=seed))
    with torch.no_grad():  # a router bias (a buffer, zero at init) that must survive the round trip
        for name, buf in model.named_buffers():
            if name.endswith("router.expert_bias"):
                buf.copy_(torch.linspace(-0.5, 0.5, buf.numel()))
    save_checkpoint(root, 3, model, extra={"step": 3, "rank": rank})
    return dict(export_hf_weights(model, arch, groups))


def _load(rank, world, root, sizes, seed, arch="qwen3_moe"):
    from megatron_rl.model import BuildOptions, build_gpt_model
    from megatron_rl.model.hf_io import export_hf_weights
    from megatron_rl.model.presets import preset_arch
    from megatron_rl.trainer.checkpoint import latest_checkpoint, load_checkpoint
    from tests.mcore_setup import setup_parallel

    groups = setup_parallel(**sizes)
    arch = preset_arch(arch)
    model = build_gpt_model(arch, groups, BuildOptions(seed=seed))
    extra = load_checkpoint(latest_checkpoint(root), model)
    return dict(export_hf_weights(model, arch, groups)), extra


TP2 = (2, {"tensor_model_parallel_size": 2})
EP2 = (2, {"expert_model_parallel_size": 2})


@pytest.mark.parametrize("save_layout,load_layout,arch", [
    ((1, {}), (1, {}), "qwen3_moe"),
    (TP2, TP2, "qwen3_moe"),
    (EP2, (1, {}), "qwen3_moe"),  # resharding EP=2 -> one rank
    (TP2, (1, {}), "qwen2"),  # the TP-sharded qkv biases resharded
    (TP2, EP2, "mixtral"),  # TP=2 -> EP=2: attention gathered, experts split
    # MLA's duplicated and sharded projections, the router's bias buffer; the 0.19 file format
    pytest.param(TP2, EP2, "deepseek_v3", marks=pytest.mark.mcore_api),
], ids=["ws1", "tp2", "ep2_to_ws1", "qwen2_tp2_to_ws1", "mixtral_tp2_to_ep2", "deepseek_v3_tp2_to_ep2"])
def test_roundtrip(tmp_path, save_layout, load_layout, arch):
    root = str(tmp_path / "ckpt")
    saved = run_ranks(_save, world_size=save_layout[0], timeout=180, root=root, sizes=save_layout[1], seed=1,
                      arch=arch)[0]
    with open(os.path.join(root, "latest")) as f:
        assert f.read() == "iter_0000003"
    assert not any(p.endswith(".tmp") for p in os.listdir(root))
    from megatron_rl.trainer.manifest import verify_manifest

    assert verify_manifest(os.path.join(root, "iter_0000003")) == []  # every rank's files are in the manifest
    loaded, extra = run_ranks(_load, world_size=load_layout[0], timeout=180, root=root, sizes=load_layout[1],
                              seed=2, arch=arch)[0]
    assert extra == {"step": 3, "rank": 0}
    assert saved.keys() == loaded.keys()
    for k in saved:
        assert torch.equal(saved[k], loaded[k]), k
    assert all(saved[k].abs().sum() > 0 for k in saved if k.endswith("e_score_correction_bias"))


def _save_watching_fsync(rank, world, root):
    """Save on one rank, recording every fsync'd path and the moment iter_N.tmp is renamed."""
    from megatron_rl.model import BuildOptions, build_gpt_model
    from megatron_rl.model.presets import preset_arch
    from megatron_rl.trainer import checkpoint
    from tests.mcore_setup import setup_parallel

    model = build_gpt_model(preset_arch("qwen3_moe"), setup_parallel(), BuildOptions(seed=1))
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    os.fsync = lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))), real_fsync(fd))[1]
    os.replace = lambda a, b: (events.append(("replace", str(a))), real_replace(a, b))[1]
    try:
        final = checkpoint.save_checkpoint(root, 3, model, extra={"step": 3})
    finally:
        os.fsync, os.replace = real_fsync, real_replace
    return final, events


@pytest.mark.mcore_api  # 0.19 writes other files (no common.pt): each must be synced
def test_every_file_and_folder_is_on_disk_before_the_checkpoint_is_published(tmp_path):
    """megatron's writer syncs its shards but not common.pt, metadata.json or the folders; after a
    power loss such a file can come back empty in the checkpoint `latest` names (and retention has
    already deleted the older ones)."""
    root = str(tmp_path / "ckpt")
    final, events = run_ranks(_save_watching_fsync, world_size=1, timeout=180, root=root)[0]
    published = events.index(("replace", final + ".tmp"))
    synced = {path.replace(final + ".tmp", final) for kind, path in events[:published] if kind == "fsync"}
    on_disk = {final} | {os.path.join(d, n) for d, dirs, files in os.walk(final) for n in dirs + files}
    assert on_disk - synced == set()
