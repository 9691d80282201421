"""Convert a Hugging Face checkpoint to a megatron-core distributed checkpoint, and back.

    # HF -> mcore (the checkpoint loads at any TP/EP/PP layout later: dist_checkpointing reshards)
    python tools/convert_hf_to_mcore.py --hf-dir Qwen3-30B-A3B --mcore-dir ckpt/qwen3moe
    torchrun --nproc_per_node=2 tools/convert_hf_to_mcore.py --hf-dir ... --mcore-dir ... --expert-model-parallel-size 2
    # mcore -> HF (config.json comes from --arch-from, an HF dir or the checkpoint's saved arch)
    python tools/convert_hf_to_mcore.py --reverse --mcore-dir ckpt/qwen3moe/iter_0000000 --hf-dir out_hf

The mcore checkpoint is our trainer's format (megatron_rl.trainer.checkpoint): usable as
`train.init_checkpoint` of pretrain_rl.py. Supported families: see docs/models.md (Qwen3,
Qwen3-MoE, Llama 3, Qwen2/2.5, Mixtral).
HF -> mcore streams: the model is built on the meta device (shapes only) and each tensor is read,
converted through the weight mapping (megatron_rl/model/mappings) and written when megatron's
writer reaches it (megatron_rl/trainer/lazy_save.py), so peak memory is about the largest
tensor, not the model (benchmarks/convert_memory.py). mcore -> HF loads the model, then streams
the export.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", required=True, help="HF checkpoint directory (input, or output with --reverse)")
    p.add_argument("--mcore-dir", required=True,
                   help="mcore checkpoint root (output; iter_0000000 is created) or, with --reverse, the iter dir")
    p.add_argument("--reverse", action="store_true", help="mcore -> HF")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--expert-model-parallel-size", type=int, default=1)
    p.add_argument("--expert-tensor-parallel-size", type=int, default=None)
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar on rank 0 (default: only when stderr is a terminal)")
    return p.parse_args(argv)


def progress_bar(enabled: bool, **kw):
    """A tqdm bar, or None: a log file gets no carriage-return redraws."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(dynamic_ncols=True, **kw)


def counted(items, bar, size=lambda item: 1):
    """`items`, advancing `bar` by size(item) for each."""
    for item in items:
        if bar is not None:
            bar.update(size(item))
        yield item


def main(argv=None) -> int:
    warnings.filterwarnings("ignore", category=UserWarning)
    args = parse_args(argv)
    import torch.distributed as dist

    from megatron_rl.model import BuildOptions, ModelArch, build_gpt_model
    import torch

    from megatron_rl.model.hf_io import (
        SafetensorsReader,
        export_hf_weights,
        hf_materializer,
        load_arch,
        save_hf_checkpoint,
    )
    from megatron_rl.parallel import ParallelConfig, destroy_parallel, init_distributed, init_parallel
    from megatron_rl.platform import apply_platform_workarounds
    from megatron_rl.trainer.checkpoint import load_checkpoint, read_extra, save_checkpoint
    from megatron_rl.trainer.lazy_save import make_materializing_save

    apply_platform_workarounds()
    rank, _ = init_distributed()
    show = (args.progress if args.progress is not None else sys.stderr.isatty()) and rank == 0
    groups = init_parallel(ParallelConfig(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size))
    try:
        if not args.reverse:
            arch = load_arch(args.hf_dir)
            opts = BuildOptions(dtype=args.dtype)
            with torch.device("meta"):  # shapes and sharding only: tensors are made as they are written
                model = build_gpt_model(arch, groups, opts)
            materialize = hf_materializer(model, arch, groups, SafetensorsReader(args.hf_dir), opts.torch_dtype)
            total = sum(p.numel() for p in model.parameters()) * opts.torch_dtype.itemsize
            bar = progress_bar(show, total=total, unit="B", unit_scale=True, desc="convert (rank 0's shards)")

            def materialize_counted(meta):
                out = materialize(meta)
                if bar is not None:
                    bar.update(out.nbytes)
                return out

            out = save_checkpoint(args.mcore_dir, 0, model, extra={"step": 0, "arch": arch.to_dict()},
                                  sharded_strategy=make_materializing_save(materialize_counted))
            if bar is not None:
                bar.close()
            if rank == 0:
                print(f"wrote {out} ({arch.arch}, {sum(p.numel() for p in model.parameters())} params on rank 0)")
        else:
            extra = read_extra(args.mcore_dir)  # JSON: nothing in a checkpoint is unpickled
            if "arch" in extra:
                arch = ModelArch(**extra["arch"])
            elif os.path.exists(os.path.join(args.hf_dir, "config.json")):
                arch = load_arch(args.hf_dir)
            else:
                print("the checkpoint does not record its architecture; pass an --hf-dir holding its "
                      "config.json", file=sys.stderr)
                return 2
            model = build_gpt_model(arch, groups, BuildOptions(dtype=args.dtype))
            load_checkpoint(args.mcore_dir, model)
            bar = progress_bar(show, unit="tensor", desc="export")
            save_hf_checkpoint(args.hf_dir, arch, counted(export_hf_weights(model, arch, groups), bar),
                               write=rank == 0)
            if bar is not None:
                bar.close()
            if rank == 0:
                print(f"wrote {args.hf_dir}: {json.dumps(arch.to_dict())}")
        dist.barrier()
    finally:
        destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
