"""Check that a Hugging Face model and its megatron-core conversion compute the same logits.

Builds a random-initialised `transformers` model (or loads `--hf-dir`), loads it into a
megatron-core GPTModel through the weight mapping, runs both on the same random tokens and
prints max |logit diff| and the max per-token log-prob difference. Exit status 0 only within
`--tol` (fp32 default 1e-4).

  python tools/check_parity.py --arch qwen3_moe                              # one CPU process
  torchrun --nproc_per_node=2 tools/check_parity.py --arch qwen3_moe --tensor-model-parallel-size 2
  torchrun --nproc_per_node=2 tools/check_parity.py --arch qwen3_moe --expert-model-parallel-size 2
  python tools/check_parity.py --hf-dir /path/to/Qwen3-0.6B                 # a real checkpoint (GPU)
"""
from __future__ import annotations

import argparse
import sys
import tempfile

import torch

from megatron_rl.model.arch import ARCHS


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=ARCHS, default="qwen3_moe")
    p.add_argument("--size", default="tiny", help="named preset size for the random model (tiny, small)")
    p.add_argument("--hf-dir", default=None, help="load this HF checkpoint instead of a random model")
    p.add_argument("--tied", action="store_true", help="tie input and output embeddings (random model)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--expert-model-parallel-size", type=int, default=1)
    p.add_argument("--expert-tensor-parallel-size", type=int, default=None)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, default=1e-4)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_rl.model import BuildOptions, build_gpt_model
    from megatron_rl.model.hf_io import SafetensorsReader, load_arch, load_hf_weights
    from megatron_rl.model.parity import compare_logits, mcore_logits, random_hf_model
    from megatron_rl.model.presets import preset_arch
    from megatron_rl.parallel import ParallelConfig, destroy_parallel, init_distributed, init_parallel
    from megatron_rl.platform import apply_platform_workarounds

    apply_platform_workarounds()
    rank, world = init_distributed()
    groups = init_parallel(ParallelConfig(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                          expert_model_parallel_size=args.expert_model_parallel_size,
                                          expert_tensor_parallel_size=args.expert_tensor_parallel_size))
    with tempfile.TemporaryDirectory() as own_tmp:
        shared = [own_tmp]  # every rank reads the model rank 0 writes
        torch.distributed.broadcast_object_list(shared, src=0)
        tmp = shared[0]
        if args.hf_dir:
            hf_dir, arch = args.hf_dir, load_arch(args.hf_dir)
        else:
            arch = preset_arch(args.arch, args.size, tie_word_embeddings=args.tied)
            hf_dir = tmp
            if rank == 0:
                random_hf_model(arch, seed=args.seed).save_pretrained(hf_dir)
            torch.distributed.barrier()
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
        model = build_gpt_model(arch, groups, BuildOptions(dtype="fp32")).eval()
        load_hf_weights(model, arch, groups, SafetensorsReader(hf_dir))
        g = torch.Generator().manual_seed(args.seed + 1)
        tokens = torch.randint(0, arch.vocab_size, (args.batch, args.seq_len), generator=g)
        with torch.no_grad():
            ref = hf(tokens).logits.float()
        got = mcore_logits(model, tokens, groups)
        report = compare_logits(ref, got, tokens)
        torch.distributed.barrier()  # rank 0 removes the shared directory on exit
    ok = report.ok(args.tol)
    if rank == 0:
        print(f"arch={arch.arch} world={world} TP={args.tensor_model_parallel_size} "
              f"EP={args.expert_model_parallel_size} tokens={args.batch}x{args.seq_len}")
        print(f"max |logit diff|   = {report.max_logit_diff:.3e}")
        print(f"max |logprob diff| = {report.max_logprob_diff:.3e}")
        print(f"{'PASS' if ok else 'FAIL'} (tol {args.tol:g})")
    destroy_parallel()
    return 0 if ok else 1


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    sys.exit(main())
