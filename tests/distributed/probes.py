"""One probe per platform workaround: the smallest real megatron-core call that needs it.

    python -m tests.distributed.probes N [--without]
    python -m tests.distributed.probes all N1 N2 ...
    python -m tests.distributed.probes without N1 N2 ... [all M1 M2 ...]

applies every workaround this process needs (all but N with --without), runs probe N, prints the
outcome and exits 0 when the call worked, 3 when it raised (the message is printed). A fresh
process per "--without" run, because patches are process-wide; `all` runs the listed probes one
after another with every workaround applied (exit 3 if any raised, each outcome printed);
`without` runs `N --without` for each listed probe in a child forked from this process before it
applies anything (the modules the probes use imported, as pretrain_rl.py imports the trainer before
it applies the workarounds; no patch, no process group), so the probes pay for one interpreter's
imports, not one each; `all` after them then runs in that process, patched only now (an ALL_MARKER line
starts its output). Runs on CPU (gloo) and, for the workarounds about Transformer Engine or Apex
being absent, on a GPU (NCCL) too.
"""
from __future__ import annotations

import os
import sys
import tempfile
import traceback
import warnings

import torch
import torch.distributed as dist

ALL_MARKER = "WITH EVERY WORKAROUND"  # `without ... all ...`: the line between the forks' output and all's


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _dist():
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1")
    from tests.spawn import free_port

    os.environ["MASTER_PORT"] = str(free_port())
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)


def _groups(**sizes):
    from megatron.core import parallel_state

    from megatron_rl.parallel import ParallelConfig, ParallelGroups

    cfg = ParallelConfig(**sizes)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=cfg.tp,
                                             pipeline_model_parallel_size=cfg.pp,
                                             expert_model_parallel_size=cfg.ep)
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ParallelGroups(cfg, ProcessGroupCollection.use_mpu_process_groups(), 1, 0)


def _model(arch="qwen3_moe", **opts):
    from megatron.core import tensor_parallel

    from megatron_rl.model import BuildOptions, build_gpt_model
    from megatron_rl.model.presets import preset_arch

    groups = _groups()
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    return build_gpt_model(preset_arch(arch), groups, BuildOptions(**opts)), groups


def _forward(model):
    from megatron_rl.model import causal_mask

    dev = _device()
    tokens = torch.randint(0, 64, (2, 8), device=dev)
    return model(tokens, torch.arange(8, device=dev).expand(2, -1), causal_mask(8, device=dev), labels=tokens)


def probe_1():
    from megatron.core import tensor_parallel

    _groups()
    tensor_parallel.model_parallel_cuda_manual_seed(0)


def probe_2():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    RotaryEmbedding(kv_channels=16, rotary_percent=1.0)(8)


def probe_3():
    _forward(_model()[0]).sum().backward()


def probe_5():
    torch.cuda.synchronize()
    from megatron.core import dist_checkpointing

    model, _ = _model(arch="qwen3")
    with tempfile.TemporaryDirectory() as d:
        dist_checkpointing.save(model.sharded_state_dict(), d)


def probe_6():
    _model(moe_token_dispatcher="alltoall")


def probe_7():
    from megatron.core.transformer import torch_norm
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                            tensor_model_parallel_size=2, sequence_parallel=True)
    norm = torch_norm.WrappedTorchNorm(cfg, 8)
    assert norm.weight.sequence_parallel is True  # so finalize_model_grads all-reduces it over TP


def probe_8():
    import megatron.core.transformer.moe.token_dispatcher as td

    sizes = td.maybe_move_tensor_to_cpu(torch.tensor([3]), as_numpy=True)
    out = torch.empty(3)
    dist.all_to_all_single(out, torch.ones(3), output_split_sizes=sizes, input_split_sizes=sizes)


def _train_step(model, settings):
    from megatron_rl.trainer.stack import build_optimizer, forward_backward, wrap_model

    model = wrap_model(model, settings)
    optimizer = build_optimizer(model, settings)
    dev = _device()
    tokens = torch.randint(0, 64, (2, 9), device=dev)

    def step(_, m):
        from megatron_rl.model import causal_mask

        out = m(tokens[:, :-1], torch.arange(8, device=dev).expand(2, -1), causal_mask(8, device=dev),
                labels=tokens[:, 1:])
        return out, lambda o: (o.float().mean(), torch.tensor(1, device=dev), {})

    forward_backward(model, step, None, 1, 8, 2, optimizer=optimizer)
    optimizer.step()
    return model, optimizer


def probe_9():
    from megatron_rl.trainer.stack import OptimSettings

    _train_step(_model()[0], OptimSettings())


def probe_10():
    from megatron_rl.trainer.stack import OptimSettings, build_optimizer, wrap_model

    build_optimizer(wrap_model(_model()[0], OptimSettings()), OptimSettings())


def probe_11():
    from megatron_rl.trainer.stack import OptimSettings

    _train_step(_model(dtype="bf16")[0], OptimSettings(dtype="bf16"))


def _dist_opt_reload():
    from megatron_rl.config.schema import OptimSection
    from megatron_rl.model import BuildOptions, build_gpt_model
    from megatron_rl.model.presets import preset_arch
    from megatron_rl.trainer.checkpoint import load_checkpoint, save_checkpoint
    from megatron_rl.trainer.stack import OptimSettings, build_optimizer, wrap_model

    settings = OptimSettings(OptimSection(use_distributed_optimizer=True))
    model, optimizer = _train_step(_model()[0], settings)
    with tempfile.TemporaryDirectory() as d:
        save_checkpoint(d, 1, model, optimizer)
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        fresh = wrap_model(build_gpt_model(preset_arch("qwen3_moe"), _groups(), BuildOptions()), settings)
        load_checkpoint(os.path.join(d, "iter_0000001"), fresh, build_optimizer(fresh, settings))


def probe_13():
    _dist_opt_reload()


def probe_14():
    _dist_opt_reload()


def probe_15():
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    scaler = DynamicGradScaler(initial_scale=2.0 ** 8, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
                               growth_interval=10, hysteresis=2)
    scaler.load_state_dict(scaler.state_dict())


def probe_16():
    _forward(_model(arch="deepseek_v3")[0]).sum().backward()


def probe_17():
    _forward(_model(arch="deepseek_v3")[0]).sum().backward()


def _run_probe(number: int) -> bool:
    """Run probe `number`; print its outcome (the whole exception chain if it raised)."""
    try:
        globals()[f"probe_{number}"]()
    except Exception as e:  # noqa: BLE001 - the failure this workaround exists for
        chain, seen = [], e  # callers may wrap megatron's error: print the whole chain
        while seen is not None and len(chain) < 5:
            chain.append(f"{type(seen).__name__}: {seen}")
            seen = seen.__cause__ or seen.__context__
        print(f"PROBE {number} RAISED " + " <- ".join(chain))
        traceback.print_exc()
        return False
    print(f"PROBE {number} OK")
    return True


def _import_what_the_probes_use() -> None:
    import megatron.core.dist_checkpointing
    import megatron.core.models.common.embeddings.rotary_pos_embedding
    import megatron.core.optimizer.grad_scaler
    import megatron.core.process_groups_config
    import megatron.core.transformer.moe.token_dispatcher
    import megatron.core.transformer.torch_norm  # noqa: F401

    import megatron_rl.model
    import megatron_rl.parallel
    import megatron_rl.platform
    import megatron_rl.trainer.checkpoint
    import megatron_rl.trainer.loop
    import megatron_rl.trainer.stack  # noqa: F401


def _fork_each(numbers: list[int]) -> int:
    """`N --without` for each of `numbers`, one forked child each, one at a time: prints
    `FORK N`, the child's output, `EXIT N <its exit code>`. Exits 0 (the codes are the result).

    The modules the probes use are imported here, once, before the fork and before any patch (the
    registry's contract is "before megatron-core builds anything", and pretrain_rl.py too imports
    the trainer before it applies them): each child then pays for its probe, not for the imports.
    With a CUDA build of torch and no device, importing megatron-core 0.19 tries CUDA's
    initialisation, so a child's first CUDA call fails with "Cannot re-initialize CUDA in forked
    subprocess" where a fresh process gets the driver's error: both say the probe reached CUDA
    (tests/distributed/test_workarounds.py accepts either)."""
    warnings.filterwarnings("ignore")
    _import_what_the_probes_use()
    for number in numbers:
        print(f"FORK {number}", flush=True)
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns into the parent's code (nor runs its exit handlers)
            code = 1
            try:
                code = main([str(number), "--without"])
            except BaseException:  # noqa: BLE001 - reported as the child's exit code
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(f"EXIT {number} {os.waitstatus_to_exitcode(status)}", flush=True)
    return 0


def main(argv: list[str]) -> int:
    """`N [--without]`: probe N with every workaround (but N); `all N1 N2 ...`: with every workaround,
    each probe in turn in this one process (the "sufficient" half needs no process per probe: the
    patches are the same for all), megatron's parallel state reset between them."""
    if argv[0] == "without":  # `without N1 N2 ... [all M1 M2 ...]`: the forks, then `all` in this process
        cut = argv.index("all") if "all" in argv else len(argv)
        _fork_each([int(n) for n in argv[1:cut]])
        if cut == len(argv):
            return 0
        print(ALL_MARKER, flush=True)
        return main(argv[cut:])
    warnings.filterwarnings("ignore")
    from megatron_rl.platform import apply_platform_workarounds

    if argv[0] == "all":
        from megatron.core import parallel_state

        apply_platform_workarounds()
        _dist()
        ok = True
        for number in map(int, argv[1:]):
            ok &= _run_probe(number)
            sys.stdout.flush()
            parallel_state.destroy_model_parallel()
        return 0 if ok else 3
    number = int(argv[0])
    without = "--without" in argv
    apply_platform_workarounds(skip={number} if without else ())
    _dist()
    return 0 if _run_probe(number) else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
