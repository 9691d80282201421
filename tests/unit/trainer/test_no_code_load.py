"""no_code_load: a checkpoint's `.metadata` is unpickled with only the format's own records, and
torch.load inside the block is weights-only whatever its caller asks. Payloads here would create
a marker file if they ran."""
import dataclasses
import io
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_rl.trainer.no_code_load import (
    MetadataUnpickler,
    UnsafeCheckpoint,
    allowed_global,
    check_metadata,
    weights_only_torch_loads,
)


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def saved(tmp_path):
    """A real torch.distributed.checkpoint dir (tensors of two dtypes, a byte item)."""
    path = tmp_path / "ckpt"
    dcp.save({"w": torch.ones(3, 2), "h": torch.zeros(4, dtype=torch.bfloat16), "obj": {"a": 1}},
             checkpoint_id=str(path))
    return path


def test_real_metadata_passes_and_equals_the_plain_unpickle(saved):
    ours = check_metadata(str(saved))
    with open(saved / ".metadata", "rb") as f:
        plain = pickle.load(f)  # our own file: the reference
    assert ours.state_dict_metadata == plain.state_dict_metadata
    assert ours.storage_data == plain.storage_data


def test_a_payload_in_metadata_is_refused_before_it_runs(saved, tmp_path):
    marker = tmp_path / "ran"
    with open(saved / ".metadata", "rb") as f:
        md = pickle.load(f)
    md.planner_data = Payload(marker)
    (saved / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafeCheckpoint, match=r"\.metadata is refused: it names posix\.system"):
        check_metadata(str(saved))
    assert not marker.exists()


def test_missing_metadata_is_none(tmp_path):
    assert check_metadata(str(tmp_path)) is None


@pytest.mark.parametrize("module,name,ok", [
    ("torch.distributed.checkpoint.metadata", "Metadata", True),
    ("torch.distributed.checkpoint.planner", "WriteItemType", True),      # an enum
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo", True),
    ("torch", "bfloat16", True),
    ("torch", "Size", True),
    ("torch", "load", False),                                           # a function of an allowed module
    ("torch", "Tensor", False),
    ("torch.distributed.checkpoint.filesystem", "FileSystemReader", False),  # a class, not a record
    ("torch.distributed.checkpoint.filesystem", "os", False),
    ("builtins", "eval", False),
    ("os", "system", False),
    ("subprocess", "Popen", False),
])
def test_allowed_globals(module, name, ok):
    assert (allowed_global(module, name) is not None) == ok


def test_unpickler_refuses_a_global_smuggled_inside_a_record():
    """A record whose field holds a callable reference still names it in the stream."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    data = pickle.dumps(MetadataIndex(fqn="x", offset=torch.Size([2, 0]), index=1))
    assert MetadataUnpickler(io.BytesIO(data)).load() == MetadataIndex(fqn="x", offset=torch.Size([2, 0]), index=1)
    bad = pickle.dumps({"k": dataclasses.replace(MetadataIndex(fqn="x"), fqn=eval)})
    with pytest.raises(UnsafeCheckpoint, match="builtins.eval"):
        MetadataUnpickler(io.BytesIO(bad)).load()


def test_torch_loads_are_weights_only_inside_the_block_and_restored_after(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    buf = io.BytesIO()
    torch.save({"x": Payload(marker)}, buf)
    monkeypatch.delenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", raising=False)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # a user's setting: suspended, then back
    with weights_only_torch_loads():
        with pytest.raises(pickle.UnpicklingError):
            torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
        plain = io.BytesIO()
        torch.save({"t": torch.arange(3), "n": None}, plain)
        assert torch.equal(torch.load(io.BytesIO(plain.getvalue()), weights_only=False)["t"], torch.arange(3))
    assert not marker.exists()
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ
    assert os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] == "1"
