"""An HF export is one folder whose files all get the permissions a plain open gives (the umask's):
safetensors wrote its weights 0600 beside a 0644 config.json, so the group could read the config but
not the model."""
import os

import pytest
import torch

from megatron_rl.model.hf_io import save_hf_checkpoint
from megatron_rl.model.presets import preset_arch


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
@pytest.mark.parametrize("shard_bytes", [2 << 30, 8], ids=["one-file", "sharded"])
def test_every_exported_file_has_the_umask_permissions(tmp_path, umask, shard_bytes):
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text("{}")
    tokenizer.chmod(0o600)   # a copied file takes the export's mode, not its source's
    old = os.umask(umask)
    try:
        save_hf_checkpoint(str(tmp_path / "out"), preset_arch("qwen3", "tiny"),
                           iter([("a", torch.ones(2)), ("b", torch.ones(3))]), max_shard_bytes=shard_bytes,
                           extra_files={str(tokenizer): "tokenizer.json"})
    finally:
        os.umask(old)
    modes = {name: (tmp_path / "out" / name).stat().st_mode & 0o777 for name in os.listdir(tmp_path / "out")}
    assert any(name.endswith(".safetensors") for name in modes) and "config.json" in modes
    assert set(modes.values()) == {0o666 & ~umask}, modes
