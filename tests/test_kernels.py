"""CPU capabilities, the measured choices (compute dtype, kernels) and their per-machine cache."""

import json
import os
import subprocess
import sys
import threading
import time
import types

import pytest
import torch
from conftest import needs_cpp

from hf_lowprec.modules.kernels import autotune
from hf_lowprec.modules.kernels.cpp import STALE_BUILD_LOCK_S, clear_stale_build_lock
from hf_lowprec.modules.kernels.cpu import CLASS_ENV, CpuInfo, contention_warning, cores_busy_elsewhere, cpu_info

AVX2_ONLY = CpuInfo("an AVX2 CPU", "x86_64", ("avx2", "fma"), "AVX2")
AVX512_BF16 = CpuInfo("an AVX-512 CPU", "x86_64", ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16"), "AVX512")


def test_cpu_classes_and_capabilities():
    assert (AVX2_ONLY.cpu_class, AVX2_ONLY.native_bf16, AVX2_ONLY.int8_dot) == ("AVX2", False, False)
    assert (AVX512_BF16.cpu_class, AVX512_BF16.native_bf16, AVX512_BF16.int8_dot) == ("AVX512-BF16", True, True)
    arm = CpuInfo("an Arm CPU", "aarch64", ("asimd", "asimddp", "bf16"), "DEFAULT")
    assert (arm.cpu_class, arm.native_bf16, arm.int8_dot) == ("Arm", True, True)
    assert "AVX2: avx2 fma" in AVX2_ONLY.summary()
    here = cpu_info()  # whatever this machine is, the record is complete and consistent
    assert here.to_dict()["class"] == here.cpu_class and set(here.flags) <= set(here.to_dict()["flags"])


@pytest.mark.skipif(not os.path.exists("/proc/stat") or len(os.sched_getaffinity(0)) < 2,
                    reason="reads Linux's /proc/stat; a core left idle needs two")
def test_a_process_busy_on_a_core_is_seen_and_named_in_the_thread_advice():
    """Another process spinning on a core counts as a busy core; this process's own work does not; a torch thread
    count above the idle cores gets one line naming the count that fits, one thread never does."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # started and spinning
        busy = cores_busy_elsewhere(0.5)
        cores = len(os.sched_getaffinity(0))
        advice = contention_warning(threads=cores)
        alone = contention_warning(threads=1)
    finally:
        spinner.kill()
        spinner.wait()
    assert 0.6 <= busy <= os.cpu_count(), busy
    assert advice is not None and f"of this machine's {cores} cores busy" in advice and "OMP_NUM_THREADS=" in advice
    assert int(advice.rsplit("OMP_NUM_THREADS=", 1)[1]) < cores and alone is None


def test_the_class_variable_restricts_the_capabilities(monkeypatch):
    monkeypatch.setenv(CLASS_ENV, "avx2")
    cpu_info.cache_clear()
    try:
        restricted = cpu_info()
        assert set(restricted.flags) <= {"avx2", "fma"} and not restricted.native_bf16 and not restricted.int8_dot
        assert restricted.restricted_to == "avx2" and CLASS_ENV in restricted.summary()
        monkeypatch.setenv(CLASS_ENV, "avx3")
        cpu_info.cache_clear()
        with pytest.raises(ValueError, match=f"{CLASS_ENV}='avx3': choose one of avx2"):
            cpu_info()
    finally:
        monkeypatch.delenv(CLASS_ENV)
        cpu_info.cache_clear()


@needs_cpp  # the check is about what a build holds
def test_the_kernels_are_built_for_the_class_in_use(monkeypatch):
    """AVX-512 code in the built kernels exactly where the class has AVX-512: under ``HF_LOWPREC_CPU_CLASS=avx2`` on a
    larger CPU the kernels' AVX2 branches are the ones built and run, as on an AVX2 CPU."""
    from hf_lowprec.modules.kernels.cpp import cpu_kernels, target_flags

    assert cpu_kernels().built_with_avx512() == cpu_info().has("avx512f")
    monkeypatch.setenv(CLASS_ENV, "avx2")
    cpu_info.cache_clear()
    try:
        assert target_flags() == ["-march=x86-64-v3", "-mtune=native"]
    finally:
        monkeypatch.undo()
        cpu_info.cache_clear()


def test_no_native_bf16_means_fp32_compute_without_timing(monkeypatch):
    monkeypatch.setattr(autotune, "cpu_info", lambda: AVX2_ONLY)
    autotune._cpu_compute_dtype.cache_clear()
    monkeypatch.setattr(autotune, "time_calls", lambda calls, **kw: pytest.fail("nothing to time on AVX2"))
    try:
        assert autotune.compute_dtype("cpu") == (torch.float32, "compute fp32: this CPU has no native bf16 (AVX2)")
    finally:
        autotune._cpu_compute_dtype.cache_clear()


def test_native_bf16_is_chosen_only_when_it_measures_faster(monkeypatch, tmp_path):
    monkeypatch.setenv(autotune.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(autotune, "_memory", {})
    monkeypatch.setattr(autotune, "cpu_info", lambda: AVX512_BF16)
    for bf16_s, expected in ((1.0, torch.float32), (0.5, torch.bfloat16)):
        autotune._cpu_compute_dtype.cache_clear()
        autotune._memory.clear()
        (tmp_path / "autotune.json").unlink(missing_ok=True)
        timings, probed = {"bf16": bf16_s, "fp32": 1.0}, []

        def fake_timing(calls, t=timings, clock=None, **kw):  # records how the probe was timed
            probed.append((torch.get_num_threads(), clock))
            return {n: t[n] for n in calls}

        monkeypatch.setattr(autotune, "time_calls", fake_timing)
        threads = torch.get_num_threads()
        dtype, reason = autotune.compute_dtype("cpu")
        assert dtype == expected and f"{1.0 / bf16_s:.2f}x fp32" in reason
        # on one thread's CPU time (another process's load cannot decide it), the thread count restored after
        assert probed == [(1, time.thread_time)] and torch.get_num_threads() == threads
    autotune._cpu_compute_dtype.cache_clear()


def test_a_choice_is_measured_once_and_cached_per_machine(monkeypatch, tmp_path):
    monkeypatch.setenv(autotune.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(autotune, "_memory", {})
    calls = []
    candidates = {"slow": lambda: calls.append("slow"), "fast": lambda: calls.append("fast")}
    timings = {"slow": 2.0, "fast": 1.0}
    monkeypatch.setattr(autotune, "time_calls", lambda cs, **kw: {n: (c(), timings[n])[1] for n, c in cs.items()})
    choice = autotune.fastest("probe", candidates, lambda w, s: f"{w} won")
    assert (choice.value, choice.reason, choice.seconds) == ("fast", "fast won", {"slow": 2.0, "fast": 1.0})
    assert len(calls) == 2
    saved = json.loads((tmp_path / "autotune.json").read_text())
    assert saved[autotune.machine_key()]["probe"]["value"] == "fast"
    monkeypatch.setattr(autotune, "_memory", {})  # a new process: read back from the file, nothing timed
    assert autotune.fastest("probe", candidates, lambda w, s: "unused").value == "fast" and len(calls) == 2
    del candidates["fast"]  # the cached winner cannot run any more: measured again
    assert autotune.fastest("probe", candidates, lambda w, s: f"{w} won").value == "slow" and len(calls) == 3
    assert cpu_info().model in autotune.machine_key() and torch.__version__ in autotune.machine_key()
    # a cache file that is JSON of another shape (a list; an entry without a reason) is measured again and replaced:
    # it failed every run on an AttributeError
    for content in ("[]", json.dumps({autotune.machine_key(): {"probe": {"value": "slow"}}}), '{"x": 1}'):
        (tmp_path / "autotune.json").write_text(content)
        monkeypatch.setattr(autotune, "_memory", {})
        assert autotune.fastest("probe", candidates, lambda w, s: f"{w} won").reason == "slow won"
        saved = json.loads((tmp_path / "autotune.json").read_text())
        assert saved[autotune.machine_key()]["probe"]["reason"] == "slow won"


def test_timing_takes_each_candidates_fastest_call_in_interleaved_rounds(monkeypatch):
    """A burst of load over a candidate's first calls (here: its first three take 10 ms, on a fake clock) does not
    decide: the rounds interleave the candidates and each keeps its fastest call."""
    clock = [0.0]
    monkeypatch.setattr(autotune, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    order, bursty = [], iter([0.010] * 3 + [0.001] * 10)

    def call(name, seconds):
        order.append(name)
        clock[0] += seconds() if callable(seconds) else seconds

    calls = {"bursty": lambda: call("bursty", lambda: next(bursty)), "steady": lambda: call("steady", 0.005)}
    seconds = autotune.time_calls(calls, repeats=4)
    assert seconds == pytest.approx({"bursty": 0.001, "steady": 0.005})
    assert order == ["bursty", "steady"] * 5  # one warm-up each, then four interleaved rounds


def test_resolve_dtype_names_and_errors():
    assert autotune.resolve_dtype("fp32") == (torch.float32, "compute fp32: as requested")
    assert autotune.resolve_dtype(torch.bfloat16)[0] == torch.bfloat16
    assert autotune.resolve_dtype("auto")[0] in (torch.float32, torch.bfloat16)
    with pytest.raises(ValueError, match="dtype 'fp16': choose one of auto, bf16, fp32"):
        autotune.resolve_dtype("fp16")
    with pytest.raises(ValueError, match="choose one of auto, torch.bfloat16, torch.float32"):
        autotune.resolve_dtype(torch.float16)


def test_a_stale_build_lock_is_removed_and_a_fresh_one_waited_for_until_it_goes(monkeypatch, tmp_path, caplog):
    """torch's cpp_extension waits forever for a lock file left by a process killed while building (a test run
    killed during the kernel build hung the next one); ours is cleared once it is older than any build takes, and a
    fresh one is waited for until its build ends or it turns stale."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "some_kernels" / "lock"
    lock.parent.mkdir()
    lock.touch()
    threading.Timer(1.0, lock.unlink).start()  # a build running now: it finishes, its lock goes
    clear_stale_build_lock("some_kernels")
    assert not lock.exists() and "waiting for another process" in caplog.text and "interrupted" not in caplog.text
    lock.touch()  # a process killed while building, 1 s short of stale: waited for, then removed (torch: forever)
    almost = time.time() - STALE_BUILD_LOCK_S + 1
    os.utime(lock, (almost, almost))
    clear_stale_build_lock("some_kernels")
    assert not lock.exists() and "interrupted" in caplog.text
    caplog.clear()
    lock.touch()
    old = time.time() - STALE_BUILD_LOCK_S - 1
    os.utime(lock, (old, old))
    clear_stale_build_lock("some_kernels")
    assert not lock.exists() and "interrupted" in caplog.text and "waiting" not in caplog.text  # at once
    clear_stale_build_lock("some_kernels")  # no lock: nothing to do
