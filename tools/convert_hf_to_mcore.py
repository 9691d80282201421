"""Convert a Hugging Face checkpoint to a megatron-core distributed checkpoint, and back.

    # HF -> mcore (the checkpoint loads at any TP/EP/PP layout later: dist_checkpointing reshards)
    python tools/convert_hf_to_mcore.py --hf-dir Qwen3-30B-A3B --mcore-dir ckpt/qwen3moe
    torchrun --nproc_per_node=2 tools/convert_hf_to_mcore.py --hf-dir ... --mcore-dir ... --expert-model-parallel-size 2
    # mcore -> HF, into a new (or empty) folder; the tokenizer files come from --arch-from
    python tools/convert_hf_to_mcore.py --reverse --mcore-dir runs/rl/checkpoints/iter_0000100 --hf-dir rl_hf --arch-from Qwen3-30B-A3B

The mcore checkpoint is our trainer's format (megatron_rl.trainer.checkpoint): usable as
`train.init_checkpoint` of pretrain_rl.py, and the trainer's own checkpoints (RL, SFT) export
with --reverse (their optimizer state is ignored). Supported families: see docs/models.md
(Qwen3, Qwen3-MoE, Llama 3, Qwen2/2.5, Mixtral, DeepSeek-V3).
HF -> mcore streams: the model is built on the meta device (shapes only) and each tensor is read,
converted through the weight mapping (megatron_rl/model/mappings) and written when megatron's
writer reaches it (megatron_rl/trainer/lazy_save.py), so peak memory is about the largest
tensor, not the model (benchmarks/convert_memory.py). mcore -> HF loads the model, then streams
the export.

The input --hf-dir is checked whole before anything is built (megatron_rl/model/hf_files.py): a
config.json value of the wrong type or range, a damaged safetensors header, an index naming a file
outside the folder, or weights that are not the model config.json describes is refused (exit code
2) in one line naming the file and the value.

--reverse writes --hf-dir and never reads it. An --hf-dir that exists and is not empty is
refused (exit code 2) unless --overwrite is given, which replaces the whole folder once the
export is complete. The architecture (config.json) is the one the checkpoint records (this
tool's and the trainer's checkpoints do); for a checkpoint that does not, --arch-from HF_DIR
names the HF model folder whose config.json it is. The tokenizer and generation files found in
--arch-from (tokenizer.json, tokenizer_config.json, special_tokens_map.json, vocab.json,
merges.txt, tokenizer.model, generation_config.json, chat_template.jinja) are copied into the
export, so that it loads with `transformers` as a whole model.

It runs on the host (gloo, CPU tensors) also on a GPU machine: it never runs the model, and the GPUs
are hidden from it (CUDA_VISIBLE_DEVICES="").
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

# What an HF model folder holds besides config.json and the weights that `transformers` needs to
# use an export: --reverse copies those that --arch-from has.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "generation_config.json", "chat_template.jinja")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", required=True,
                   help="HF checkpoint directory: the input, or with --reverse the output (new or empty "
                        "unless --overwrite)")
    p.add_argument("--mcore-dir", required=True,
                   help="mcore checkpoint root (output; iter_0000000 is created) or, with --reverse, the iter dir")
    p.add_argument("--reverse", action="store_true", help="mcore -> HF")
    p.add_argument("--arch-from", metavar="HF_DIR",
                   help="with --reverse: the HF model folder whose config.json is the architecture (when the "
                        "checkpoint does not record it) and whose tokenizer files are copied into the export")
    p.add_argument("--overwrite", action="store_true",
                   help="with --reverse: replace an existing, non-empty --hf-dir (everything in it is deleted)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--expert-model-parallel-size", type=int, default=1)
    p.add_argument("--expert-tensor-parallel-size", type=int, default=None)
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar on rank 0 (default: only when stderr is a terminal)")
    args = p.parse_args(argv)
    if not args.reverse and (args.arch_from or args.overwrite):
        p.error("--arch-from and --overwrite apply to --reverse only")
    return args


def occupied(path: str) -> bool:
    """Whether `path` holds something an export would destroy: a file, a link, or a folder with
    anything in it (a missing or empty folder is free to write)."""
    if not os.path.lexists(path):
        return False
    return os.path.islink(path) or not os.path.isdir(path) or bool(os.listdir(path))


def inside(path: str, folder: str) -> bool:
    """Whether `path` is `folder` or lies under it (links resolved)."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([path, folder]) == folder


def tokenizer_files(hf_dir: str | None) -> dict[str, str]:
    """{source path: name in the export} for the TOKENIZER_FILES that `hf_dir` holds."""
    if hf_dir is None:
        return {}
    return {os.path.join(hf_dir, n): n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(hf_dir, n))}


class Refused(Exception):
    """A reason not to start, printed as one line (exit code 2)."""


def check_output(args) -> None:
    """Refuse to write --hf-dir when the export would destroy something. Checked on every rank
    before any work: the export replaces the folder, so one that holds anything (the HF model it
    came from, `.`, a home directory) is replaced only when asked to with --overwrite."""
    if not occupied(args.hf_dir):
        return
    if not args.overwrite:
        raise Refused(f"--hf-dir {args.hf_dir} exists and is not empty; export to a new folder, or pass "
                      f"--overwrite to replace it (everything in it is deleted)")
    if inside(args.mcore_dir, args.hf_dir):
        raise Refused(f"--hf-dir {args.hf_dir} holds --mcore-dir {args.mcore_dir}; --overwrite would delete "
                      f"the checkpoint")


def reverse_arch(extra: dict, arch_from: str | None):
    """The checkpoint's architecture (a ModelArch): the one it records (this tool's and the
    trainer's checkpoints do), else --arch-from's config.json. Never the output folder's: reading
    it is what invited exporting into the source model."""
    from megatron_rl.model import ModelArch
    from megatron_rl.model.hf_files import HfInputError, load_arch

    if arch_from is not None and not os.path.isdir(arch_from):
        raise Refused(f"--arch-from {arch_from} is not a folder")
    if "arch" in extra:
        try:
            return ModelArch(**extra["arch"])
        except (TypeError, ValueError) as e:
            raise Refused(f"the architecture the checkpoint records is not a valid one ({e})") from None
    if arch_from is None:
        raise Refused("the checkpoint does not record its architecture; pass --arch-from HF_DIR, the HF model "
                      "folder holding its config.json")
    if not os.path.isfile(os.path.join(arch_from, "config.json")):
        raise Refused(f"--arch-from {arch_from} has no config.json")
    try:
        return load_arch(arch_from)
    except HfInputError as e:
        raise Refused(f"--arch-from {arch_from}: {str(e).removeprefix(arch_from + ': ')}") from None


def forward_input(hf_dir: str):
    """(ModelArch, SafetensorsReader) of --hf-dir, checked whole before any work (model/hf_files.py):
    config.json's values, the safetensors headers, and that the weights are the model config.json
    describes. Refused naming the file and the value."""
    from megatron_rl.model.hf_files import HfInputError, SafetensorsReader, check_weights, load_arch

    if not os.path.isdir(hf_dir):
        raise Refused(f"--hf-dir {hf_dir} is not a folder")
    try:
        arch = load_arch(hf_dir)
        reader = SafetensorsReader(hf_dir)
        check_weights(reader, arch)
    except HfInputError as e:
        raise Refused(f"--hf-dir {hf_dir}: {str(e).removeprefix(hf_dir + ': ')}") from None
    return arch, reader


def refuse(message: str) -> int:
    """Print `message` (on rank 0 of a launch only: one line, not one per rank); exit code 2."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"convert_hf_to_mcore.py: error: {message}", file=sys.stderr)
    return 2


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
    """The tool (see the module docstring). It must run where CUDA is not visible: the script entry
    point hides the GPUs before anything can initialise CUDA; a caller importing main() must too."""
    warnings.filterwarnings("ignore", category=UserWarning)
    args = parse_args(argv)
    arch = reader = None
    try:  # refuse before the process group, the model and the load
        if args.reverse:
            from megatron_rl.trainer.checkpoint import read_extra

            check_output(args)
            arch = reverse_arch(read_extra(args.mcore_dir), args.arch_from)  # JSON: nothing is unpickled
        else:
            arch, reader = forward_input(args.hf_dir)
    except Refused as e:
        return refuse(str(e))
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        return refuse("this process sees a GPU, and the tool runs on the host (it never runs the model, and "
                      "megatron would build it on the GPU); run it as a script, which hides the GPUs, or set "
                      "CUDA_VISIBLE_DEVICES= before Python starts")

    from megatron_rl.data.hf_tokenizer import folder_fingerprint
    from megatron_rl.model import BuildOptions, build_gpt_model
    from megatron_rl.model.hf_io import export_hf_weights, hf_materializer, save_hf_checkpoint
    from megatron_rl.parallel import ParallelConfig, destroy_parallel, init_distributed, init_parallel
    from megatron_rl.platform import apply_platform_workarounds
    from megatron_rl.trainer.checkpoint import load_checkpoint, save_checkpoint
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
            opts = BuildOptions(dtype=args.dtype)
            with torch.device("meta"):  # shapes and sharding only: tensors are made as they are written
                model = build_gpt_model(arch, groups, opts)
            materialize = hf_materializer(model, arch, groups, reader, opts.torch_dtype)
            total = sum(p.numel() for p in model.parameters()) * opts.torch_dtype.itemsize
            bar = progress_bar(show, total=total, unit="B", unit_scale=True, desc="convert (rank 0's shards)")

            def materialize_counted(meta):
                out = materialize(meta)
                if bar is not None:
                    bar.update(out.nbytes)
                return out

            # the tokenizer the weights read: a run that starts from them with another one is refused
            tokenizer, why = folder_fingerprint(args.hf_dir)
            if why is not None and rank == 0:
                print(f"note: the checkpoint records no tokenizer ({args.hf_dir}: {why}); a warm start from it "
                      f"will not be checked against data.tokenizer", file=sys.stderr)
            extra = {"step": 0, "arch": arch.to_dict(), "tokenizer": tokenizer}
            out = save_checkpoint(args.mcore_dir, 0, model, extra=extra,
                                  sharded_strategy=make_materializing_save(materialize_counted))
            if bar is not None:
                bar.close()
            if rank == 0:
                print(f"wrote {out} ({arch.arch}, {sum(p.numel() for p in model.parameters())} params on rank 0)")
        else:
            model = build_gpt_model(arch, groups, BuildOptions(dtype=args.dtype))
            load_checkpoint(args.mcore_dir, model)  # the model only: a trainer checkpoint's optimizer stays
            bar = progress_bar(show, unit="tensor", desc="export")
            save_hf_checkpoint(args.hf_dir, arch, counted(export_hf_weights(model, arch, groups), bar),
                               write=rank == 0, extra_files=tokenizer_files(args.arch_from),
                               overwrite=args.overwrite)
            if bar is not None:
                bar.close()
            if rank == 0:
                print(f"wrote {args.hf_dir}: {json.dumps(arch.to_dict())}")
        dist.barrier()
    finally:
        destroy_parallel()
    return 0


if __name__ == "__main__":
    # A host tool: it streams tensors between files through host memory and never runs the model.
    # Beside a GPU, megatron would allocate every layer of the meta-device build on the GPU (CUDA
    # turns use_cpu_initialization off) and moving the rest would fail on meta tensors. With the
    # GPUs hidden before anything initialises CUDA, the process takes the host configuration (gloo,
    # host tensors) that tests/distributed/test_convert_tool.py runs.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    sys.exit(main())
