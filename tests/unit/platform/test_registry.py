"""The registry: every workaround declares a condition, and exactly those whose condition holds apply."""
import pytest

from megatron_rl import platform
from megatron_rl.platform import Capabilities, Condition, needed_workarounds, workarounds

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
    assert numbers == sorted(set(numbers)) and len(numbers) == 13
    assert 4 not in numbers and 12 not in numbers  # a model setting, and covered by #15
    assert all(isinstance(w.needed_when, Condition) for w in ws)


def test_conditions_of_the_workarounds():
    by = {w.number: w.needed_when for w in workarounds()}
    assert {n for n, c in by.items() if c is Condition.NO_CUDA} == {1, 2, 5, 6, 8, 9, 10, 11, 15}
    assert {n for n, c in by.items() if c is Condition.NO_TE} == {3, 7}
    assert by[13] is Condition.NO_TE_NO_APEX and by[14] is Condition.ALWAYS


def test_needed_selection():
    # megatron-core 0.16 leaves te_general_gemm unbound without TE (#3); 0.19 binds it to None
    three = {3} if next(w for w in workarounds() if w.number == 3).defect_present() else set()
    assert {w.number for w in needed_workarounds(CPU)} == {w.number for w in workarounds()} - ({3} - three)
    assert {w.number for w in needed_workarounds(GPU_BARE)} == three | {7, 13, 14}
    assert {w.number for w in needed_workarounds(GPU_APEX)} == three | {7, 14}
    assert {w.number for w in needed_workarounds(GPU_TE)} == {14}


def test_fixed_defect_is_not_patched():
    w = next(w for w in workarounds() if w.number == 3)
    fixed = platform.Workaround(w.number, w.name, w.needed_when, w.fixes, w.apply, defect_present=lambda: False)
    assert w.needed(CPU) and not fixed.needed(CPU)


def test_this_process():
    caps = platform.capabilities()
    assert caps.describe().startswith("CUDA=")
    assert {w.number for w in needed_workarounds()} == {w.number for w in workarounds() if w.needed(caps)}
