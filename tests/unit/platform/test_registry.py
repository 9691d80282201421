"""The registry: every workaround declares a condition, and exactly those whose condition holds apply."""
import pytest

from megatron_rl import platform
from megatron_rl.platform import (
    Capabilities,
    Condition,
    megatron_core_version,
    needed_workarounds,
    workarounds,
)
from megatron_rl.platform.workaround import parse_version

CPU = Capabilities(cuda=False, te=False, apex=False)
GPU_BARE = Capabilities(cuda=True, te=False, apex=False)  # the H100 of the issue: no TE, no Apex
GPU_APEX = Capabilities(cuda=True, te=False, apex=True)
GPU_TE = Capabilities(cuda=True, te=True, apex=False)
TE_NO_CUDA = Capabilities(cuda=False, te=True, apex=False)


@pytest.mark.parametrize("caps,expected", [
    (CPU, {Condition.NO_CUDA, Condition.NO_TE, Condition.NO_TE_NO_APEX, Condition.ALWAYS}),
    (GPU_BARE, {Condition.NO_TE, Condition.NO_TE_NO_APEX, Condition.ALWAYS}),
    (GPU_APEX, {Condition.NO_TE, Condition.ALWAYS}),
    (GPU_TE, {Condition.ALWAYS}),
    # TE installed but nothing to run it on: the local spec is in use, yet megatron's optimizer
    # imports TE's FusedAdam (its fallback keys on the import alone)
    (TE_NO_CUDA, {Condition.NO_CUDA, Condition.NO_TE, Condition.ALWAYS}),
], ids=["cpu", "gpu_bare", "gpu_apex", "gpu_te", "te_no_cuda"])
def test_conditions(caps, expected):
    assert {c for c in Condition if c.holds(caps)} == expected


def test_registry_is_filled_and_numbered():
    ws = workarounds()
    assert ws == platform.workarounds()
    numbers = [w.number for w in ws]
    assert numbers == sorted(set(numbers)) and len(numbers) == 15
    assert 4 not in numbers and 12 not in numbers  # a model setting, and covered by #15
    assert all(isinstance(w.needed_when, Condition) for w in ws)


def test_conditions_of_the_workarounds():
    by = {w.number: w.needed_when for w in workarounds()}
    assert {n for n, c in by.items() if c is Condition.NO_CUDA} == {1, 2, 5, 6, 8, 9, 10, 11, 15}
    assert {n for n, c in by.items() if c is Condition.NO_TE} == {3, 7, 16, 17}
    assert by[13] is Condition.NO_TE_NO_APEX and by[14] is Condition.ALWAYS


# Which workarounds each megatron-core release needs, per platform, as the probes measured them
# (tests/distributed/test_workarounds.py on each CI lane: 0.16.1 on lane 1, 0.19.2 on lane 2).
# #3's defect was fixed in 0.17.0 (moe_utils binds te_general_gemm to None without TE); every other
# defect is in both releases (#17's in a different form, see its docstring).
@pytest.mark.parametrize("mcore,fixed", [("0.16.1", set()), ("0.19.2", {3})])
def test_needed_selection_per_release(mcore, fixed):
    every = {w.number for w in workarounds()}
    assert {w.number for w in needed_workarounds(CPU, mcore)} == every - fixed
    assert {w.number for w in needed_workarounds(GPU_BARE, mcore)} == {3, 7, 13, 14, 16, 17} - fixed
    assert {w.number for w in needed_workarounds(GPU_APEX, mcore)} == {3, 7, 14, 16, 17} - fixed
    assert {w.number for w in needed_workarounds(GPU_TE, mcore)} == {14}


def test_fixed_in_is_a_release_bound():
    w = next(w for w in workarounds() if w.number == 3)
    assert w.fixed_in == "0.17.0"
    assert w.needed(CPU, "0.16.1") and w.has_defect("0.16.1")
    assert not w.needed(CPU, "0.17.0") and not w.needed(CPU, "0.19.2") and not w.needed(CPU, "0.19.2+e432f21")
    assert [x.number for x in workarounds() if x.fixed_in is not None] == [3]  # the others: every release
    assert all(x.has_defect("99.0.0") for x in workarounds() if x.fixed_in is None)


def test_parse_version():
    assert parse_version("0.19.2") == (0, 19, 2) and parse_version("0.17.0rc0") == (0, 17, 0)
    assert parse_version("0.19.2+e432f21") == (0, 19, 2) and parse_version("1.0") == (1, 0, 0)
    with pytest.raises(ValueError, match="not a release"):
        parse_version("main")
    assert len(parse_version(megatron_core_version())) == 3


def test_this_process():
    caps = platform.capabilities()
    assert caps.describe().startswith("CUDA=")
    assert {w.number for w in needed_workarounds()} == {w.number for w in workarounds() if w.needed(caps)}
    assert needed_workarounds() == needed_workarounds(caps, megatron_core_version())
