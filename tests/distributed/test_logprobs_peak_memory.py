"""Peak memory of the chunked log-prob path, measured in a fresh process (its peak RSS): forward
and backward grow it by chunk-sized buffers, not by the [N, V] logits (the values are checked in
tests/unit/logprobs/test_fused_logprobs.py)."""
import subprocess
import sys

import pytest

_PEAK_SCRIPT = r"""
import resource, torch
from megatron_rl.logprobs import token_logprobs_and_entropy
torch.manual_seed(0)
n, v, hid = 4096, 32768, 16              # full fp32 logits would be 512 MiB, each temporary too
h = torch.randn(n, hid, requires_grad=True)
w = (torch.randn(v, hid) * 0.3).requires_grad_()
y = torch.randint(0, v, (n,))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = token_logprobs_and_entropy(h, w, y, chunk_size=128, grad_tile=GRAD_TILE)
(out.logprobs.sum() + out.entropy.sum()).backward()
assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
"""


@pytest.mark.parametrize("grad_tile", [None, (1024, 4096)], ids=["chunks", "tiles"])
def test_peak_memory_is_chunk_sized_not_logits_sized(grad_tile):
    """In a fresh process: forward+backward at N×V = 2^27 (512 MiB of fp32 logits) raises peak
    RSS by about two [chunk, V] buffers (2 × 16 MiB) plus small tensors, far below the logits;
    likewise with backward tiles of 1024 tokens by 4096 rows (2 × 16 MiB, an fp32 [1024, H] sum)."""
    script = f"GRAD_TILE = {grad_tile!r}\n" + _PEAK_SCRIPT
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False,
                         timeout=120, env={"OMP_NUM_THREADS": "1", "PATH": ""})
    assert res.returncode == 0, res.stderr
    peak = int(res.stdout.strip().splitlines()[-1])
    assert peak < 96 * 2**20, f"peak RSS grew by {peak / 2**20:.0f} MiB"
