"""Local SeqOps contract (the CP version is tested against it in tests/distributed)."""
import pytest
import torch

from megatron_rl.losses import LOCAL, get_surrogate
from megatron_rl.losses.seqops import LocalSeqOps, SeqOps, owner_count


def test_local_seqops_reductions():
    x = torch.tensor([[1.0, 2.0, 3.0], [-1.0, 5.0, 0.0]], requires_grad=True)
    s = LOCAL.sum(x)
    assert s.tolist() == [6.0, 4.0]
    (g,) = torch.autograd.grad(s.sum(), x)
    assert (g == 1).all()
    assert LOCAL.min(x).tolist() == [1.0, -1.0] and not LOCAL.min(x).requires_grad
    assert LOCAL.max(x).tolist() == [3.0, 5.0] and not LOCAL.max(x).requires_grad
    stacked = LOCAL.sum(torch.stack([x.detach(), 2 * x.detach()]))
    assert stacked.tolist() == [[6.0, 4.0], [12.0, 8.0]]
    assert LOCAL.min(torch.tensor([[3, 1], [7, 9]])).tolist() == [1, 7]  # integer positions


def test_owner_count():
    flags = torch.tensor([True, False, True])
    assert float(owner_count(flags, LOCAL)) == 2
    assert float(owner_count(flags, LocalSeqOps(is_owner=False))) == 0


def test_seqops_interface_is_abstract():
    with pytest.raises(NotImplementedError):
        SeqOps().sum(torch.zeros(1, 1))


def test_registry_error_lists_names():
    with pytest.raises(KeyError) as e:
        get_surrogate("ppo")
    assert "ppo_clip" in str(e.value) and "gspo" in str(e.value)
