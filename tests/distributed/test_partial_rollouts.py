"""Partial rollouts through the real loop (train.schedule=async, max_staleness=1,
train.in_flight_update=pause): every background generation parks after decode step K (an event:
DecodeGate.park_after, armed by the test's engine), the push of step t's weights lands there, and
the generation goes on with them. Checked: per-token staleness (tokens before the split are
max_staleness versions old, after it one less, so the max stays max_staleness), μ = π_old on the
tokens after the split (fp32 engine and trainer: the re-prefilled continuation is the new
policy's), and a resumed run that reproduces the uninterrupted one bit for bit."""
import threading

import pytest
import torch

from tests.distributed.test_schedules import _run as run_schedule
from tests.spawn import run_ranks

K = 1  # tokens 0..K of a background batch come from version t, the rest from t + 1
OVERRIDES = ["train.schedule=async", "train.max_staleness=1", "loss.recipe=decoupled_ppo",
             "train.in_flight_update=pause", "rollout.backend=parking", "train.steps=4", "train.save_every=1"]


def _register_parking_engine():
    """The embedded engine, whose background generations park after decode step K; its pause()
    first waits for that park (or for the generation to end before it), so the split point never
    depends on which thread is faster."""
    from megatron_rl.rollout import ENGINES, EngineSpec
    from megatron_rl.rollout.embedded import EMBEDDED, EmbeddedEngine

    class ParkingEngine(EmbeddedEngine):
        retry = False  # the generation after an abort runs through (it samples the batch again)

        def generate(self, prompts, n, sampling):
            if threading.current_thread().name == "rollout-generation":
                if not self.retry:
                    self.gate.park_after(K)
                self.retry = False
            return super().generate(prompts, n, sampling)

        def abort(self):
            self.pause()
            super().abort()
            self.retry = True

        def pause(self):
            worker = next((t for t in threading.enumerate() if t.name == "rollout-generation"), None)
            while worker is not None and worker.is_alive() and not self.gate.wait_parked(0.05):
                pass
            super().pause()

    def make(request):
        r = request.rollout
        return ParkingEngine(request.arch, dtype=r.dtype, max_batch_size=r.max_batch_size, device="cpu")

    if "parking" not in ENGINES:
        ENGINES.add("parking", EngineSpec(make=make, in_flight_updates=EMBEDDED.in_flight_updates))


def _run(rank, world, overrides, run_dir, stop_after_first=False):
    """tests/distributed/test_schedules.py's run, with the parking engine registered in this process."""
    _register_parking_engine()
    return run_schedule(rank, world, overrides, run_dir, stop_after_first)


def test_partial_rollouts_train_count_staleness_per_token_and_resume_bit_exactly(tmp_path):
    [(w_full, s_full)] = run_ranks(_run, world_size=1, timeout=300, overrides=OVERRIDES, run_dir=str(tmp_path / "f"))
    assert [s["step"] for s in s_full] == [1, 2, 3, 4]
    assert s_full[0]["schedule/staleness_max"] == 0  # the first batch: generated before any update
    for s in s_full[1:]:
        assert s["schedule/staleness_max"] == 1  # tokens 0..K: generated from version t, trained at t + 1
        assert 0 < s["schedule/staleness_mean"] < 1  # the rest from t + 1: on-policy
        # μ of the tokens after the split is the new weights' (fp32): equal to π_old up to rounding;
        # before it, lr=1e-2 has moved π_old well away from μ
        assert s["mismatch/staleness_0/tokens"] > 0 and s["mismatch/staleness_1/tokens"] > 0
        assert s["mismatch/staleness_0/abs_logprob_diff"] < 1e-5, s["step"]
        assert s["mismatch/staleness_1/abs_logprob_diff"] > 1e-3, s["step"]
    assert s_full[-1]["schedule/weight_syncs"] == 4

    [(_, s_part)] = run_ranks(_run, world_size=1, timeout=300, overrides=OVERRIDES, run_dir=str(tmp_path / "p"),
                              stop_after_first=True)
    assert [s["step"] for s in s_part] == [1]
    [(w_res, s_res)] = run_ranks(_run, world_size=1, timeout=300, overrides=OVERRIDES + ["train.resume=true"],
                                 run_dir=str(tmp_path / "p"))
    assert [s["step"] for s in s_res] == [1, 2, 3, 4]
    for a, b in zip(s_full, s_res, strict=True):
        for k in ("loss/policy", "optim/grad_norm", "rollout/reward_mean", "mismatch/kl_k3", "schedule/staleness_mean",
                  "schedule/staleness_max", "schedule/generate_calls", "schedule/weight_syncs"):
            assert a.get(k) == b.get(k), (a["step"], k, a.get(k), b.get(k))
    for k in w_full:
        assert torch.equal(w_full[k], w_res[k]), k


@pytest.mark.parametrize("mode", ["abort"])
def test_abort_regenerates_the_batch_from_the_new_weights(tmp_path, mode):
    overrides = [o.replace("in_flight_update=pause", f"in_flight_update={mode}") for o in OVERRIDES]
    [(_, steps)] = run_ranks(_run, world_size=1, timeout=300, overrides=overrides + ["train.steps=3"],
                             run_dir=str(tmp_path))
    for s in steps[1:]:  # every background batch was dropped at step K and sampled again from t + 1
        assert s["schedule/staleness_max"] == 0 and s["mismatch/abs_logprob_diff"] < 1e-5, s["step"]
    assert steps[-1]["schedule/generate_calls"] == 1 + 2 * 2  # the first batch, then two tries of each other


def test_two_data_parallel_ranks_match_one(tmp_path):
    """The per-token versions reach each rank with its rows (trainer/scatter.py): the per-token
    staleness split of the mismatch values over 2 DP ranks is the one-rank value."""
    overrides = [o.replace("train.steps=4", "train.steps=3") for o in OVERRIDES]
    [(_, s1)] = run_ranks(_run, world_size=1, timeout=300, overrides=overrides, run_dir=str(tmp_path / "one"))
    (_, s2), _ = run_ranks(_run, world_size=2, timeout=600, overrides=overrides, run_dir=str(tmp_path / "two"))
    for a, b in zip(s1, s2, strict=True):
        assert a["schedule/staleness_mean"] == b["schedule/staleness_mean"]
        for k in ("mismatch/staleness_0/tokens", "mismatch/staleness_1/tokens"):
            assert a.get(k) == b.get(k), (a["step"], k)
        for k in ("loss/policy", "mismatch/staleness_1/kl_k3", "mismatch/staleness_0/kl_k3"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-7), (a["step"], k)


def test_the_staleness_bound_holds_for_two_versions_ahead(tmp_path):
    """max_staleness=2: batch t + 2 starts from version t and takes version t + 1 at the split, so
    its tokens are 2 or 1 versions old at step t + 2: the max stays max_staleness."""
    overrides = [o.replace("train.max_staleness=1", "train.max_staleness=2") for o in OVERRIDES]
    [(_, steps)] = run_ranks(_run, world_size=1, timeout=300, overrides=overrides, run_dir=str(tmp_path))
    # steps 1 and 2 train the two batches generated up front from version 0
    assert [s["schedule/staleness_max"] for s in steps] == [0, 1, 2, 2]
    assert [s["schedule/staleness_mean"] for s in steps[:2]] == [0, 1]
    assert all(1 < s["schedule/staleness_mean"] < 2 for s in steps[2:])
