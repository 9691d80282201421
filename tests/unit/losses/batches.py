"""Random PolicyBatch inputs for property tests (numpy RNG from a hypothesis-drawn seed)."""
from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import strategies as st

from megatron_rl.losses import PolicyBatch


def make_arrays(seed: int, B: int = 3, T: int = 5, sigma_r: float = 0.3, sigma_w: float = 0.3,
                garbage: bool = False, empty_row: bool = True) -> dict:
    """Right-padded rows (lengths 0..T), per-row advantages, log-probs ≤ 0 with given log-ratio scales."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0 if empty_row else 1, T + 1, size=B)
    m = np.arange(T)[None, :] < lengths[:, None]
    old = -rng.exponential(1.5, size=(B, T)) - 1e-3
    ro = np.minimum(old + rng.normal(0, sigma_w, size=(B, T)), -1e-4)
    lp = old + rng.normal(0, sigma_r, size=(B, T))
    adv_choices = np.array([-1.0, -0.5, 0.0, 0.7, 1.3])
    a_row = np.where(rng.random(B) < 0.5, rng.choice(adv_choices, size=B), rng.normal(size=B))
    A = np.repeat(a_row[:, None], T, axis=1)
    if garbage:
        for arr, val in ((old, math.nan), (ro, -math.inf), (lp, math.nan), (A, math.nan)):
            arr[~m] = val
    return {"lp": lp, "old": old, "ro": ro, "A": A, "m": m}


def to_batch(arr: dict, **kw) -> tuple[PolicyBatch, torch.Tensor]:
    lp = torch.tensor(arr["lp"], dtype=torch.float32, requires_grad=True)
    batch = PolicyBatch(lp, torch.tensor(arr["old"], dtype=torch.float32),
                        torch.tensor(arr["ro"], dtype=torch.float32), torch.tensor(arr["A"], dtype=torch.float32),
                        torch.tensor(arr["m"]), **kw)
    return batch, lp


def as_lists(arr: dict) -> tuple:
    """Float32-rounded lists (the reference sees exactly the values torch sees)."""
    f = {k: np.asarray(arr[k], dtype=np.float32).astype(np.float64).tolist() for k in ("lp", "old", "ro", "A")}
    return f["lp"], f["old"], f["ro"], f["A"], np.asarray(arr["m"]).tolist()


seeds = st.integers(0, 2**31 - 1)
shapes = st.tuples(st.integers(1, 4), st.integers(1, 6))
scales = st.sampled_from([0.01, 0.3, 1.5])


def assert_close(actual, expected, rtol=1e-4, atol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.as_tensor(expected, dtype=torch.float64), rtol=rtol, atol=atol)
