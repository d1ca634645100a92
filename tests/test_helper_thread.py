"""core/helper_thread.py: where the engine thread and the kernels' helper run, and when the pair
reports that no core is shared any more. The schedstat figures and the pinning are faked here; the
helper's kernels are tested in tests/kernels/test_work_share.py, the governor's use of it in
tests/test_cpu_threads.py."""

from __future__ import annotations

import pytest

from pagedserve.core import helper_thread
from pagedserve.core.helper_thread import HelperThread


class FakeKernels:
    def __init__(self) -> None:
        self.calls: list[tuple[bool, int]] = []

    def work_share_set_helper(self, on: bool, cpu: int) -> int:
        self.calls.append((on, cpu))
        return 4242


@pytest.fixture
def host(monkeypatch):
    """Threads' (run, wait) seconds advanced by `advance(engine_wait=, helper_run=, helper_wait=)`
    per second of wall time; the engine thread's pins recorded."""
    class Host:
        now = 0.0
        engine = [0.0, 0.0]
        helper = [0.0, 0.0]
        pins: list[set[int]] = []

        def advance(self, engine_wait=0.0, helper_run=0.0, helper_wait=0.0, seconds=0.5):
            self.now += seconds
            self.engine[0] += (1 - engine_wait) * seconds
            self.engine[1] += engine_wait * seconds
            self.helper[0] += helper_run * seconds
            self.helper[1] += helper_wait * seconds

    h = Host()
    monkeypatch.setattr(helper_thread.time, "monotonic", lambda: h.now)
    monkeypatch.setattr(helper_thread, "thread_cpu_times",
                        lambda tid=None: tuple(h.engine) if tid is None else tuple(h.helper))
    monkeypatch.setattr(helper_thread, "current_cpu", lambda: 1)
    monkeypatch.setattr(helper_thread.os, "sched_setaffinity", lambda pid, cpus: h.pins.append(set(cpus)))
    return h


def test_the_pair_starts_on_the_engine_threads_core_and_swaps_when_the_engine_waits(host):
    kernels = FakeKernels()
    helper = HelperThread(kernels, [0, 1])
    helper.start()
    assert host.pins == [{1}] and kernels.calls == [(True, 0)] and helper.active
    assert helper.look() is False  # the first look only takes figures
    host.advance(engine_wait=0.1, helper_run=0.5, helper_wait=0.45)  # the neighbour is on the helper's core
    assert helper.look() is False and helper.swaps == 0
    host.advance(engine_wait=0.5, helper_run=0.9, helper_wait=0.0)  # ... now on the engine's
    assert helper.look() is False and helper.swaps == 1
    assert host.pins[-1] == {0} and kernels.calls[-1] == (True, 1)
    helper.stop()
    assert host.pins[-1] == {0, 1} and kernels.calls[-1] == (False, -1) and not helper.active


def test_a_core_is_free_when_neither_waits_while_the_helper_works(host):
    helper = HelperThread(FakeKernels(), [0, 1])
    helper.start()
    helper.look()
    host.advance(engine_wait=0.01, helper_run=0.05, helper_wait=0.0)  # the helper asleep: no evidence
    assert helper.look() is False
    host.advance(engine_wait=0.01, helper_run=0.6, helper_wait=0.01)
    assert helper.look() is True


def test_the_helper_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_KERNEL_HELPER", "0")
    assert HelperThread.for_this_process([0, 1]) is None
    monkeypatch.delenv("PAGEDSERVE_KERNEL_HELPER")
    assert HelperThread.for_this_process([0]) is None


@pytest.mark.parametrize("stall_us", [0, 300], ids=["helper-computes", "helper-stalls"])
def test_an_engine_sharing_its_kernels_with_the_helper_gives_transformers_tokens(tiny_model_dir, stall_us):
    """The whole engine at one thread with the helper on (as the governor leaves it beside a
    neighbour): the linear kernels, the fused LM head argmax and decode attention go through
    work_share::run, and the greedy tokens are still transformers' (fp32, the oracle), whether the
    helper computed chunks or stalled on them and had them taken back."""
    import torch

    from pagedserve.core.sampling_params import SamplingParams
    from pagedserve.kernels.cpu.build import CpuKernelsUnavailable, load_extension
    from tests.oracle import hf_greedy
    from tests.test_architectures import make_engine
    from tests.test_engine_vs_transformers import random_prompts

    try:
        ext = load_extension()
    except CpuKernelsUnavailable:
        pytest.skip("no C++ kernels here")
    path = tiny_model_dir("llama")
    engine = make_engine(path, "llama", attention_backend="cpu", max_num_batched_tokens=48)
    prompts = random_prompts(6, 3, 40, seed=13)
    before, threads = ext.work_share_stats(), torch.get_num_threads()
    torch.set_num_threads(1)
    ext.work_share_set_test_delay_us(stall_us)
    ext.work_share_set_helper(True, -1)
    try:
        results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        after = ext.work_share_stats()
    finally:
        ext.work_share_set_helper(False, -1)
        ext.work_share_set_test_delay_us(0)
        torch.set_num_threads(threads)
    for prompt, res in zip(prompts, results):
        assert list(res.token_ids) == hf_greedy(path, prompt, 12)
    took_part = after[2] > before[2] if stall_us else after[1] > before[1]
    assert took_part, "the helper took no part: the engine's kernels did not go through work_share::run"
