"""The engine's compute-thread count: from the affinity mask and the cgroup quota at start, then
adjusted to the cores other work leaves (core/cpu_threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pagedserve.core.cpu_threads import ThreadPlan, cgroup_cpu_quota, thread_plan, threads_for
from pagedserve.core.thread_governor import (COMPUTE_THREAD_NAME, Sample, ThreadGovernor, idle_cpu_seconds,
                                             name_compute_threads, process_run_delay)


# -- the start count -----------------------------------------------------------------------------
def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_v2_quota_is_read_from_the_process_cgroup_and_its_tightest_ancestor(tmp_path):
    root = tmp_path / "cg"
    write(root / "kubepods" / "cpu.max", "300000 100000\n")
    write(root / "kubepods" / "pod1" / "cpu.max", "150000 100000\n")
    write(root / "kubepods" / "pod1" / "ctr" / "cpu.max", "max 100000\n")
    write(tmp_path / "self", "0::/kubepods/pod1/ctr\n")
    assert cgroup_cpu_quota(str(tmp_path / "self"), root) == 1.5
    write(root / "kubepods" / "pod1" / "cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(str(tmp_path / "self"), root) == 3.0
    write(root / "kubepods" / "cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(str(tmp_path / "self"), root) is None


def test_v1_quota_is_read_from_the_cpu_controller(tmp_path):
    root = tmp_path / "cg"
    write(root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us", "50000\n")
    write(root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_period_us", "100000\n")
    write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    write(root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    write(tmp_path / "self", "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n")
    assert cgroup_cpu_quota(str(tmp_path / "self"), root) == 0.5


def test_no_cgroup_files_mean_no_quota(tmp_path):
    assert cgroup_cpu_quota(str(tmp_path / "missing"), tmp_path) is None
    write(tmp_path / "self", "0::/\n")
    assert cgroup_cpu_quota(str(tmp_path / "self"), tmp_path / "cg") is None


@pytest.mark.parametrize("cpus, quota, threads", [
    (2, None, 2), (8, None, 8), (2, 1.5, 2), (2, 1.2, 1), (8, 3.5, 4), (8, 0.25, 1), (2, 16.0, 2)])
def test_a_quota_of_n_and_a_half_cpus_gets_n_plus_one_threads_up_to_the_cpus(cpus, quota, threads):
    assert threads_for(cpus, quota) == threads


def test_an_operator_count_wins_and_is_kept(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_NUM_THREADS", "3")
    assert thread_plan() == ThreadPlan(3, False, "PAGEDSERVE_NUM_THREADS=3")
    monkeypatch.delenv("PAGEDSERVE_NUM_THREADS")
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert thread_plan().start == 5 and not thread_plan().adaptive
    monkeypatch.delenv("OMP_NUM_THREADS")
    plan = thread_plan()
    assert plan.start == threads_for(len(os.sched_getaffinity(0)), cgroup_cpu_quota()) and plan.adaptive
    monkeypatch.setenv("PAGEDSERVE_THREAD_GOVERNOR", "0")
    assert not thread_plan().adaptive


@pytest.mark.parametrize("value", ["two", "0", "-1", "1.5"])
def test_a_bad_thread_count_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("PAGEDSERVE_NUM_THREADS", value)
    with pytest.raises(ValueError, match="PAGEDSERVE_NUM_THREADS"):
        thread_plan()


# -- the governor, on recorded CPU figures -------------------------------------------------------
class FakeHost:
    """A 2-CPU machine as the governor sees it: the run delay of our threads and the idle time of
    the CPUs, advanced by `run(seconds, waiting=..., idle=...)` in CPUs' worth."""

    def __init__(self) -> None:
        self.now = self.waited = self.idle = self.throttled = 0.0
        self.set_calls: list[int] = []

    def run(self, seconds: float, waiting: float = 0.0, idle: float = 0.0, throttled: float = 0.0) -> None:
        self.now += seconds
        self.waited += waiting * seconds
        self.idle += idle * seconds
        self.throttled += throttled * seconds

    def governor(self, start: int = 2, adaptive: bool = True) -> ThreadGovernor:
        return ThreadGovernor(ThreadPlan(start, adaptive, "test"), self.set_calls.append, cpus=[0, 1],
                              interval=0.5, sample=lambda cpus: Sample(self.now, self.waited, self.idle, self.throttled))

    def step(self, gov: ThreadGovernor, seconds: float = 0.5, **figures: float) -> int:
        self.run(seconds, **figures)
        gov.poll(self.now)
        return gov.threads


def test_a_busy_neighbour_takes_a_thread_away_and_its_end_gives_it_back():
    host = FakeHost()
    gov = host.governor()
    assert host.step(gov, waiting=0.05) == 2  # quiet, but for the front end's threads
    assert host.step(gov, waiting=0.3) == 2  # the server's own threads, now and then
    assert host.step(gov, waiting=0.6) == 2  # ... even a burst: once is not a neighbour
    assert host.step(gov, waiting=0.1) == 2
    assert host.step(gov, waiting=0.55) == 2  # a neighbour shares a core: the first look
    assert host.step(gov, waiting=0.55) == 1 and host.set_calls == [1]  # and the second
    assert host.step(gov) == 1  # it keeps its core, we keep ours: nobody waits, nothing idle
    assert host.step(gov, idle=1.0) == 2  # gone: a core idles
    assert host.set_calls == [1, 2] and gov.changes == 2


def test_the_governor_looks_once_per_interval():
    host = FakeHost()
    gov = host.governor()
    assert host.step(gov, seconds=0.2, waiting=0.8) == 2  # too soon to judge
    assert host.step(gov, seconds=0.4, waiting=0.6) == 2  # one look
    assert host.step(gov, seconds=0.6, waiting=0.6) == 1  # two


def test_waiting_only_a_neighbour_causes_takes_a_thread_at_the_first_look():
    host = FakeHost()
    gov = host.governor()
    assert host.step(gov, waiting=0.85) == 1


def test_below_its_start_the_team_tries_a_thread_now_and_then_and_backs_off_while_it_fails():
    host = FakeHost()
    gov = host.governor()
    host.step(gov, waiting=0.8)
    host.step(gov, waiting=0.8)
    assert gov.threads == 1
    tries = []
    for _ in range(2400):  # 20 minutes of a neighbour that soaks up every idle cycle
        before = gov.threads
        now = host.step(gov, waiting=0.8 if before == 2 else 0.0)
        if now > before:
            tries.append(host.now)
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert len(tries) >= 4 and gaps == sorted(gaps) and gaps[-1] > 2 * gaps[0]
    assert gov.threads in (1, 2) and host.set_calls.count(2) == len(tries)
    # the neighbour leaves while the CPUs stay busy (a low-priority job): the next try sticks
    while gov.threads == 1:
        host.step(gov)
    for _ in range(10):
        assert host.step(gov) == 2


def test_a_quota_that_throttles_the_team_is_not_taken_for_a_neighbour():
    # 1.5 CPUs of quota on 2 cores: the team is throttled a quarter of the time, and both threads
    # wait through it (0.5 CPUs' worth of run delay); the governor takes throttling out.
    host = FakeHost()
    gov = host.governor()
    for _ in range(4):
        assert host.step(gov, waiting=0.5, idle=0.5, throttled=0.25) == 2
    assert host.set_calls == []
    for _ in range(2):  # a neighbour on top of the quota still shows
        host.step(gov, waiting=1.2, throttled=0.25)
    assert gov.threads == 1


def test_an_operator_count_or_a_single_thread_is_never_changed():
    for gov in (FakeHost().governor(adaptive=False), FakeHost().governor(start=1)):
        assert not gov.enabled
    host = FakeHost()
    gov = host.governor(adaptive=False)
    assert host.step(gov, waiting=1.0) == 2 and host.set_calls == []


def test_without_schedstat_or_proc_stat_the_start_count_stays():
    gov = ThreadGovernor(ThreadPlan(2, True, "test"), pytest.fail, cpus=[0, 1], sample=lambda cpus: None)
    assert not gov.enabled
    gov.poll()


def test_the_readers_take_their_figures_from_proc(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 0 10 100 5 0 0 0 0 0\n"
                    "cpu0 1 2 3 40 5 6 7 8 0 0\n"
                    "cpu1 10 0 0 50 0 0 0 0 0 0\n"
                    "cpu2 100 0 0 0 0 0 0 0 0 0\nintr 1 2 3\n")
    hz = os.sysconf("SC_CLK_TCK")
    assert idle_cpu_seconds([0, 1], str(stat)) == pytest.approx((40 + 5 + 50) / hz)  # idle + iowait
    assert idle_cpu_seconds([0], str(tmp_path / "missing")) is None
    tasks = tmp_path / "task"
    for tid, delay in (("10", 1_500_000_000), ("11", 250_000_000)):
        (tasks / tid).mkdir(parents=True)
        (tasks / tid / "schedstat").write_text(f"999 {delay} 7\n")
    (tasks / "12").mkdir()  # a thread that ended between listdir and open
    assert process_run_delay(str(tasks)) == pytest.approx(1.75)
    assert process_run_delay(str(tmp_path / "none")) is None


# -- on this machine, for real -------------------------------------------------------------------
def spin_pinned_for(cpu: int, seconds: float, stop: threading.Event) -> None:
    """Busy this thread on `cpu` for `seconds` or until `stop`, in torch (which drops the GIL): a
    compute thread."""
    import torch

    os.sched_setaffinity(0, {cpu})  # 0: this thread
    a = torch.randn(256, 256)
    end = time.monotonic() + seconds
    while time.monotonic() < end and not stop.is_set():
        a @ a


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 usable CPUs to leave one to a neighbour")
def test_a_real_busy_process_on_one_of_our_cpus_lowers_the_count():
    # Our "team": a thread pinned to the last CPU that computes in torch (no GIL held) beside two
    # neighbour processes pinned there too. It gets a third of the CPU: 0.67 CPUs' worth of waiting.
    cpus = sorted(os.sched_getaffinity(0))
    calls: list[int] = []
    gov = ThreadGovernor(ThreadPlan(len(cpus), True, "test"), calls.append, cpus=cpus, interval=0.5)
    pin = lambda: os.sched_setaffinity(0, {cpus[-1]})
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pin) for _ in range(2)]
    stop = threading.Event()
    ours = threading.Thread(target=spin_pinned_for, args=(cpus[-1], 8.0, stop), daemon=True)
    try:
        time.sleep(0.3)
        ours.start()
        time.sleep(0.2)
        gov._last = gov._sample()
        for _ in range(10):  # a few seconds of looks: schedstat counts a wait when the thread next runs
            time.sleep(0.6)
            gov.poll()
            if gov.threads < len(cpus):
                break
    finally:
        stop.set()
        for p in spinners:
            p.kill()
            p.wait()
        ours.join()
    assert gov.threads < len(cpus) and calls == [gov.threads]


def can_make_v1_cgroup() -> Path | None:
    cpu = Path("/sys/fs/cgroup/cpu")
    if not (cpu / "cpu.cfs_quota_us").exists() or not os.access(cpu, os.W_OK):
        return None
    return cpu


def can_make_v2_cgroup() -> Path | None:
    root = Path("/sys/fs/cgroup")
    controllers = root / "cgroup.subtree_control"
    if not controllers.exists() or "cpu" not in controllers.read_text().split() or not os.access(root, os.W_OK):
        return None
    return root


@pytest.mark.skipif(can_make_v1_cgroup() is None and can_make_v2_cgroup() is None,
                    reason="needs a writable cgroup (v2 with the cpu controller, or v1 cpu) to set a quota")
def test_a_process_in_a_real_cgroup_with_a_quota_starts_with_threads_for_it():
    v2 = can_make_v2_cgroup()
    group = (v2 or can_make_v1_cgroup()) / f"pagedserve-test-{os.getpid()}"
    group.mkdir()
    try:
        if v2:
            (group / "cpu.max").write_text("150000 100000")
        else:
            (group / "cpu.cfs_period_us").write_text("100000")
            (group / "cpu.cfs_quota_us").write_text("150000")
        code = ("import os; from pagedserve.core.cpu_threads import cgroup_cpu_quota, thread_plan; "
                "print(cgroup_cpu_quota(), thread_plan().start)")
        env = {k: v for k, v in os.environ.items() if k not in ("PAGEDSERVE_NUM_THREADS", "OMP_NUM_THREADS")}
        child = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
            preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())))
        quota, start = child.stdout.split()
        assert float(quota) == 1.5
        assert int(start) == min(2, len(os.sched_getaffinity(0)))
    finally:
        group.rmdir()


def test_an_engine_computes_with_the_threads_it_was_given(tiny_model_dir, monkeypatch):
    import torch

    from pagedserve.core.config import EngineConfig
    from pagedserve.core.engine import LLMEngine

    before = torch.get_num_threads()
    monkeypatch.setenv("PAGEDSERVE_NUM_THREADS", "2")
    try:
        engine = LLMEngine(EngineConfig.from_dict({"model": str(tiny_model_dir("llama")), "dtype": "float32"}))
        assert torch.get_num_threads() == 2 and engine.threads.threads == 2 and not engine.threads.enabled
    finally:
        torch.set_num_threads(before)


def test_a_neighbour_that_appears_during_a_step_is_answered_within_the_step(tiny_model_dir, monkeypatch):
    """A step slowed by a neighbour can last seconds: the governor looks after each layer too, so
    the team shrinks inside the step rather than after it."""
    import inspect

    import torch

    import pagedserve.core.engine as engine_module
    from pagedserve.core.config import EngineConfig
    from pagedserve.core.sampling_params import SamplingParams

    reads, changes = [], []
    neighbour_from_read = 3  # 0: the governor's start, 1: its look before the step, 2+: after layers

    def sample(cpus):
        reads.append(time.monotonic())
        busy = len(reads) > neighbour_from_read
        return Sample(reads[-1], 0.9 * (reads[-1] - reads[0]) if busy else 0.0, 0.0)

    def recording_set_threads(n):
        changes.append((n, [f.function for f in inspect.stack()]))

    def governor(plan, set_threads, compute_threads_named=False, helper=None):
        return ThreadGovernor(plan, recording_set_threads, cpus=[0, 1], interval=0.0, sample=sample)

    monkeypatch.setattr(engine_module, "thread_plan", lambda: ThreadPlan(2, True, "test"))
    monkeypatch.setattr(engine_module, "ThreadGovernor", governor)
    before = torch.get_num_threads()
    try:
        engine = engine_module.LLMEngine(EngineConfig.from_dict({"model": str(tiny_model_dir("llama")),
                                                                 "dtype": "float32"}))
        assert engine.threads.enabled
        engine.generate(["hello"], SamplingParams(max_tokens=1, temperature=0.0))
    finally:
        torch.set_num_threads(before)
    assert changes, "the neighbour was never noticed"
    threads, stack = changes[0]
    assert threads == 1 and "final_hidden" in stack, stack  # inside the model's layers, after one


def test_only_the_named_compute_threads_waiting_counts(tmp_path):
    tasks = tmp_path / "task"
    for tid, name, delay in (("1", "python", 5_000_000_000), ("2", COMPUTE_THREAD_NAME, 1_000_000_000),
                             ("3", COMPUTE_THREAD_NAME, 500_000_000), ("4", "uvicorn", 9_000_000_000)):
        (tasks / tid).mkdir(parents=True)
        (tasks / tid / "comm").write_text(name + "\n")
        (tasks / tid / "schedstat").write_text(f"1 {delay} 1\n")
    assert process_run_delay(str(tasks), COMPUTE_THREAD_NAME) == pytest.approx(1.5)
    assert process_run_delay(str(tasks)) == pytest.approx(15.5)


def test_an_engine_thread_names_itself_and_its_openmp_workers_inherit_the_name():
    import torch

    names: dict[str, object] = {}

    def engine_thread():
        names["named"] = name_compute_threads()
        torch.set_num_threads(2)
        a = torch.randn(512, 512)
        for _ in range(20):
            a @ a  # starts this thread's OpenMP team
        me = threading.get_native_id()
        names["workers"] = [Path(f"/proc/self/task/{t}/comm").read_text().strip()
                            for t in os.listdir("/proc/self/task") if int(t) != me
                            and Path(f"/proc/self/task/{t}/comm").read_text().strip() == COMPUTE_THREAD_NAME]
        names["self"] = Path(f"/proc/self/task/{me}/comm").read_text().strip()

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join()
    assert names["named"] and names["self"] == COMPUTE_THREAD_NAME
    assert not name_compute_threads()  # the main thread keeps the process's name
    if len(os.sched_getaffinity(0)) >= 2:
        assert len(names["workers"]) >= 1  # the team's second thread


class FakeHelper:
    """core/helper_thread.HelperThread as the governor uses it; `free` is what its look reports."""

    def __init__(self) -> None:
        self.active = self.free = False
        self.calls: list[str] = []

    def start(self) -> None:
        self.active = True
        self.calls.append("start")

    def stop(self) -> None:
        if self.active:
            self.calls.append("stop")
        self.active = False

    def look(self) -> bool:
        return self.free


def test_at_one_thread_the_kernels_helper_runs_and_stops_before_a_team_of_two_starts():
    host, helper = FakeHost(), FakeHelper()
    gov = ThreadGovernor(ThreadPlan(2, True, "test"), lambda n: host.set_calls.append((n, helper.active)), cpus=[0, 1],
                         interval=0.5, sample=lambda cpus: Sample(host.now, host.waited, host.idle, host.throttled),
                         helper=helper)
    assert host.step(gov, waiting=0.8) == 1  # a neighbour: one thread, and the helper beside it
    assert helper.calls == ["start"] and helper.active
    assert host.step(gov, waiting=0.5) == 1  # the helper waits beside the neighbour: stays
    helper.free = True  # neither the engine thread nor the helper waited: the neighbour left
    assert host.step(gov, waiting=0.0) == 2
    # The helper stopped (and the engine thread was unpinned) before the team of two was asked for.
    assert helper.calls == ["start", "stop"] and host.set_calls == [(1, False), (2, False)]
    helper.free = False
    assert host.step(gov, waiting=0.8) == 1 and helper.calls[-1] == "start"
    host.step(gov, seconds=31.0, waiting=0.5)  # no periodic try while the helper reads the neighbour
    assert gov.threads == 1 and helper.active and helper.calls[-1] == "start"
    helper.free = True
    assert host.step(gov) == 2 and helper.calls[-1] == "stop" and not helper.active


def test_an_operator_count_never_starts_the_helper():
    host, helper = FakeHost(), FakeHelper()
    gov = ThreadGovernor(ThreadPlan(2, False, "test"), host.set_calls.append, cpus=[0, 1], interval=0.5,
                         sample=lambda cpus: Sample(host.now, host.waited, host.idle, host.throttled), helper=helper)
    host.step(gov, waiting=0.9)
    host.step(gov, waiting=0.9)
    assert gov.threads == 2 and helper.calls == []
