"""Random `transformers` checkpoints for the embedded-engine tests."""
import pytest
import torch

from megatron_rl.model.hf_io import SafetensorsReader
from megatron_rl.model.parity import random_hf_model
from megatron_rl.model.presets import preset_arch


def make_checkpoint(tmp_path_factory, seed=0, **arch_kw):
    """(arch, the original transformers model, its saved checkpoint as a name -> tensor dict)."""
    arch = preset_arch(**arch_kw)
    ref = random_hf_model(arch, seed=seed)
    path = tmp_path_factory.mktemp("hf")
    ref.save_pretrained(path)
    reader = SafetensorsReader(str(path))
    names = reader.keys()
    return arch, ref, {k: reader(k) for k in names}


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory, arch="qwen3_moe")


@pytest.fixture(scope="session")
def dense_checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory, arch="qwen3", tie_word_embeddings=True)


def prompts_of(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
