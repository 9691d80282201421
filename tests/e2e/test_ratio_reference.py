"""loss.ratio_reference: the surrogate's ratio r is taken against π_old (the trainer's recomputation
at the start of the step) or against μ (the behaviour policy). On a stale batch (staged schedule,
one stage of two steps, fp32 engine so that μ differs from π_old only by the staleness) r ≡ 1 on a
step's only mini-batch with "old", while with "rollout" r carries the one version of staleness.

Step 1 must update the policy, so its groups need mixed rewards: the dense test reward (the
fraction of digits in a response, tests/golden.py) gives them on the untrained model, where exact
match would need an SFT warm start first. Both runs go through pretrain_rl.main in one process of
the GPU lane's driver (tests/gpu/driver.py, which registers that reward)."""
import pytest

from tests.gpu.runs import DENSE_REWARD, launch_many

BASE = ["sft.steps=0", "rollout.prompts_per_step=8", "rollout.group_size=4", "rollout.dtype=fp32",
        "train.micro_batch_size=32", "train.num_minibatches=1", "train.eval_size=0", "train.steps=2",
        "train.schedule=staged", "train.stages=1", "optim.lr=1.0e-3", "log.tensorboard=false",
        "log.progress=false", "log.figure_every=0", *DENSE_REWARD]


def test_ratio_against_the_behaviour_policy_sees_the_staleness(tmp_path):
    out = launch_many(tmp_path, {ref: BASE + [f"loss.ratio_reference={ref}"] for ref in ("old", "rollout")})
    failed = {ref: r for ref, r in out.items() if isinstance(r, str)}
    assert not failed, failed
    old, rollout = ([row["mismatch/r/ess"] for row in out[ref][1]] for ref in ("old", "rollout"))
    assert len(old) == len(rollout) == 2
    assert all(row["optim/grad_norm"] > 0 for row in out["old"][1])   # step 1 updated the policy
    assert old[0] == pytest.approx(1.0, abs=1e-6) and old[1] == pytest.approx(1.0, abs=1e-6)
    assert rollout[0] == pytest.approx(1.0, abs=1e-6)  # step 1: fresh data, fp32 engine: μ = π_old
    assert rollout[1] < 1.0 - 1e-4  # step 2: one version stale
