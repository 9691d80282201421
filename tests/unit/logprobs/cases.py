"""One random log-prob problem for the chunked paths' tests: 29 tokens (ragged against chunks of
8), V = 97, an ignored label (token 3), kept sets of 1-6 ids holding the label, one empty kept set
(token 1)."""
from __future__ import annotations

import torch

N, H, V, K = 29, 16, 97, 6


def random_case(seed: int):
    """`(h [N, H], w [V, H], labels [N], kept_ids [N, K], generator)`; the generator goes on
    drawing whatever else a test needs (upstream gradients, loss coefficients)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.5
    y = torch.randint(0, V, (N,), generator=g)
    y[3] = -100
    kept = torch.full((N, K), -1)
    for t in range(N):
        size = int(torch.randint(1, K + 1, (1,), generator=g))
        kept[t, :size] = torch.randperm(V, generator=g)[:size]
        kept[t, 0] = y[t] if y[t] >= 0 else kept[t, 0]
    kept[1] = -1
    return h, w, y, kept, g
