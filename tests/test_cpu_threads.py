"""CPU thread count and pinning: the affinity mask and cgroup quota the OS grants (fake cgroup
trees written here), ``--cpu-threads`` / ``--cpu-threads-bind`` checks, threads actually pinned
(read back from /proc), and the OpenMP spin setting the runtime actually reads
(``OMP_DISPLAY_ENV=VERBOSE`` prints libgomp's own view of it)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvflow.config import EngineConfig, cpu_limits, parse_cpu_list
from kvflow.config.cpu_limits import (
    cgroup_cpu_limit,
    check_thread_limit,
    default_num_threads,
    granted_cpus,
)
from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.kernels.cpu_threads import resolve_threads
from kvflow.runtime.openmp_env import DEFAULT_SPINCOUNT, set_openmp_defaults


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,6,8-9") == [0, 1, 2, 3, 6, 8, 9]
    assert parse_cpu_list("5") == [5]
    assert parse_cpu_list("3, 1") == [3, 1]  # order kept: thread 0 -> CPU 3
    for bad in ["", "a", "1-", "-1", "3-1", "0,0", "1-2,2", "0;1"]:
        with pytest.raises(ValueError, match="cpu list"):
            parse_cpu_list(bad)
    with pytest.raises(ValueError, match=r"cpu list '0-2,1,0' names CPU\(s\) \[0, 1\] twice"):
        parse_cpu_list("0-2,1,0")
    with pytest.raises(ValueError, match="cpu list '\u00b2' is invalid"):  # '²'.isdigit()
        parse_cpu_list("\u00b2")
    # a typo'd range is an error, not 10^11 ints (a MemoryError with a traceback)
    with pytest.raises(ValueError, match=r"^cpu list '0-99999999999' names CPU 99999999999: "
                       r"CPU numbers go below 65536$"):
        parse_cpu_list("0-99999999999")
    assert parse_cpu_list("65535") == [65535]
    with pytest.raises(ValueError, match=r"names CPU\(s\) \[3\] twice"):
        parse_cpu_list("0-65535,3")


def test_cpu_lists_in_messages_are_short():
    from kvflow.config.cpu_limits import cpus_text

    assert cpus_text([2, 5]) == "[2, 5]"
    assert cpus_text(list(range(16))) == str(list(range(16)))
    assert cpus_text([*range(4), *range(8, 65536), 70000]) == \
        "[0-3, 8-65535, 70000] (65533 CPUs)"
    with pytest.raises(ValueError, match=r"^cpu_threads_bind='0-65535' names CPUs "
                       r"\[2-65535\] \(65534 CPUs\) outside this process's affinity mask "
                       r"\[0, 1\]$"):
        resolve_threads(None, "0-65535", [0, 1], None, current=2)


def _write(folder, **files):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(text)


def test_cgroup_v2_quota_is_the_tightest_of_the_process_and_its_ancestors(tmp_path):
    _write(tmp_path, cpu_max="max 100000\n")
    _write(tmp_path / "kube", cpu_max="300000 100000\n")  # 3 CPUs
    _write(tmp_path / "kube" / "pod", cpu_max="150000 100000\n")  # 1.5 CPUs
    _write(tmp_path / "kube" / "pod" / "app", cpu_max="max 100000\n")
    assert cgroup_cpu_limit(tmp_path, "0::/kube/pod/app\n") == 1.5
    assert cgroup_cpu_limit(tmp_path, "0::/kube\n") == 3.0
    assert cgroup_cpu_limit(tmp_path, "0::/\n") is None


def test_cgroup_v1_quota(tmp_path):
    cpu = tmp_path / "cpu,cpuacct"
    _write(cpu, cpu_cfs_quota_us="-1\n", cpu_cfs_period_us="100000\n")
    _write(cpu / "docker" / "abc", cpu_cfs_quota_us="200000\n", cpu_cfs_period_us="100000\n")
    proc = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n"
    assert cgroup_cpu_limit(tmp_path, proc) == 2.0
    assert cgroup_cpu_limit(tmp_path, "4:cpu,cpuacct:/\n") is None
    assert cgroup_cpu_limit(tmp_path / "missing", proc) is None


def test_default_thread_count_respects_mask_and_quota():
    assert default_num_threads(current=16, cpus=4, quota=None) == 4
    assert default_num_threads(current=16, cpus=64, quota=2.0) == 2
    assert default_num_threads(current=16, cpus=64, quota=1.5) == 1  # no thread on half a CPU
    assert default_num_threads(current=16, cpus=64, quota=0.5) == 1
    assert default_num_threads(current=1, cpus=64, quota=None) == 1  # OMP_NUM_THREADS=1 kept


def test_resolve_threads():
    allowed = [2, 3, 4, 5]
    # default: the threads fill the mask, so they are pinned (the caller per step)
    assert resolve_threads(None, None, allowed, None, current=8) == (4, [2, 3, 4, 5])
    assert resolve_threads(None, None, allowed, None, 8, pin_by_default=False) == (4, None)
    assert resolve_threads(None, "none", allowed, None, current=8) == (4, None)
    assert resolve_threads(None, None, allowed, 2.0, current=8) == (2, None)  # quota: not full
    assert resolve_threads(3, None, allowed, 1.0, current=8) == (3, None)  # explicit wins
    assert resolve_threads(None, "auto", allowed, 2.0, current=8) == (2, [2, 3])
    assert resolve_threads(None, "5,3", allowed, None, current=8) == (2, [5, 3])
    with pytest.raises(ValueError, match="outside"):
        resolve_threads(None, "0-1", allowed, None, current=8)
    with pytest.raises(ValueError, match=r"cpu_threads=6 cannot be pinned to the 4 CPUs "
                       r"\[2, 3, 4, 5\] .*give at most 4 threads, or cpu_threads_bind='none'"):
        resolve_threads(6, "auto", allowed, None, current=8)


def test_worker_processes_share_the_cpus():
    """Two ranks on one machine: half the CPUs (and quota) each, disjoint auto pinning, one
    '|' part of an explicit list per rank."""
    allowed = [0, 1, 2, 3, 4, 5]
    assert resolve_threads(None, None, allowed, None, 8, rank=0, ranks=2) == (3, [0, 1, 2])
    assert resolve_threads(None, None, allowed, None, 8, rank=1, ranks=2) == (3, [3, 4, 5])
    assert resolve_threads(None, None, allowed, 2.0, 8, rank=1, ranks=2) == (1, None)
    assert resolve_threads(None, "auto", allowed, None, 8, rank=1, ranks=2) == (3, [3, 4, 5])
    assert resolve_threads(None, "0-1|4", allowed, None, 8, rank=1, ranks=2) == (1, [4])
    assert resolve_threads(None, None, [0], None, 8, rank=1, ranks=2) == (1, None)
    with pytest.raises(ValueError, match="one per rank"):
        resolve_threads(None, "0-3", allowed, None, 8, rank=0, ranks=2)
    for rank in (0, 1):  # a CPU given to both ranks is refused by each
        with pytest.raises(ValueError, match=r"CPUs \[1\] to more than one worker"):
            resolve_threads(None, "0-1|1-2", allowed, None, 8, rank=rank, ranks=2)


def test_engine_flags_are_checked_before_loading(monkeypatch):
    _fake_cpus(monkeypatch, list(range(8)), None)
    with pytest.raises(ValueError, match="cpu_threads"):
        EngineConfig.from_kwargs(cpu_threads=0)
    with pytest.raises(ValueError, match="cpu list"):
        EngineConfig.from_kwargs(cpu_threads_bind="1-0")
    with pytest.raises(ValueError, match=r"cpu_threads_bind='foo': cpu list 'foo' is invalid: "
                       r"expected CPU numbers and ranges such as 0-3,6 \(it also takes 'auto' "
                       r"or 'none'\)$"):
        EngineConfig.from_kwargs(cpu_threads_bind="foo")
    with pytest.raises(ValueError, match=r"cpu_threads_bind='0,0': cpu list '0,0' names CPU\(s\) "
                       r"\[0\] twice: give each thread a CPU of its own \(it also takes"):
        EngineConfig.from_kwargs(cpu_threads_bind="0,0")
    with pytest.raises(ValueError, match="one CPU per thread"):
        EngineConfig.from_kwargs(cpu_threads=3, cpu_threads_bind="0-1")
    with pytest.raises(ValueError, match=r"cpu_threads_bind='0-1\|2' names 1 CPU for a worker; "
                       "give one CPU per thread"):  # not '1 CPUs'
        EngineConfig.from_kwargs(cpu_threads=2, cpu_threads_bind="0-1|2")
    config = EngineConfig.from_kwargs(cpu_threads=2, cpu_threads_bind="0-1|2-3")
    assert config.device_config.cpu_threads == 2
    assert EngineConfig.from_kwargs(cpu_threads_bind="none").device_config.cpu_threads_bind \
        == "none"


def test_tensor_parallel_bind_is_checked_before_any_worker_starts(tiny_llama, monkeypatch,
                                                                    capsys):
    """A bad ``--cpu-threads-bind`` for the second rank is one line from the CLI (exit 2),
    not a failed worker process."""
    import subprocess as sp

    from kvflow.entrypoints.cli import main

    def no_spawn(*args, **kw):
        raise AssertionError("a worker process was started")

    monkeypatch.setattr(sp, "Popen", no_spawn)
    outside = max(os.sched_getaffinity(0)) + 1
    for bind, needle in ((f"0|{outside}", f"CPUs [{outside}] outside"),
                         ("0|0", "CPUs [0] to more than one worker"),
                         ("0", "1 '|'-separated parts for 2 worker processes")):
        rc = main(["generate", "--model", tiny_llama.path, "--device", "cpu", "--prompt", "hi",
                   "--tensor-parallel-size", "2", "--cpu-threads-bind", bind])
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert rc == 2 and len(err) == 1 and needle in err[0], (bind, err)


def test_granted_cpus_and_the_thread_limit():
    """The CPUs a process may keep busy: the mask's size, capped by the quota rounded up;
    a count above it is refused with the value, the limit and where the limit comes from."""
    assert granted_cpus([0, 1, 2, 3], None) == 4
    assert granted_cpus(list(range(8)), 2.5) == 3
    assert granted_cpus(list(range(8)), 0.5) == 1
    assert granted_cpus([4, 5], 8.0) == 2
    check_thread_limit(4, [0, 1, 2, 3], None)
    check_thread_limit(3, list(range(8)), 2.5)
    with pytest.raises(ValueError, match=re.escape(
            "cpu_threads=5 exceeds the 4 CPUs this process may use (its affinity mask has 4 "
            "CPUs): threads beyond the CPUs only wait for each other at every parallel step; "
            "give at most 4, or leave it out")):
        check_thread_limit(5, [0, 1, 2, 3], None)
    with pytest.raises(ValueError, match=re.escape(
            "cpu_threads=4 exceeds the 3 CPUs this process may use (its affinity mask has 8 "
            "CPUs, its cgroup CPU quota is 2.5 CPUs)")):
        check_thread_limit(4, list(range(8)), 2.5)


def test_bind_cpus_outside_the_mask_are_refused_at_config_time(monkeypatch):
    """Mask [2, 3, 4, 5]: a --cpu-threads-bind naming CPUs 1 and 6 is refused by EngineConfig,
    every worker's part checked, with the CPUs outside and the mask; the engine-start check
    (one rank's part) gives the same message. Lists inside the mask, auto and none pass, and
    so does any list on a device that refuses the option as CPU-only later."""
    _fake_cpus(monkeypatch, [2, 3, 4, 5], None)
    message = ("cpu_threads_bind='2-3|6,1' names CPUs [1, 6] outside this process's affinity "
               "mask [2, 3, 4, 5]")
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        EngineConfig.from_kwargs(cpu_threads_bind="2-3|6,1", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        resolve_threads(None, "2-3|6,1", [2, 3, 4, 5], None, 4, rank=1, ranks=2)
    with pytest.raises(ValueError, match=re.escape(
            "cpu_threads_bind='0-2' names CPUs [0, 1] outside this process's affinity mask "
            "[2, 3, 4, 5]")):
        EngineConfig.from_kwargs(cpu_threads_bind="0-2", device="cpu")
    for bind in ("5,2", "auto", "none"):
        assert EngineConfig.from_kwargs(cpu_threads_bind=bind).device_config.cpu_threads_bind \
            == bind
    assert EngineConfig.from_kwargs(cpu_threads_bind="2-3|4-5", tensor_parallel_size=2) \
        .device_config.bind_cpus() == [2, 3, 4, 5]
    assert EngineConfig.from_kwargs(cpu_threads_bind="0-1", device="cuda") \
        .device_config.cpu_threads_bind == "0-1"


def _fake_cpus(monkeypatch, allowed: list[int], quota: float | None) -> None:
    """This process's affinity mask and cgroup quota as kvflow reads them, replaced."""
    from kvflow.kernels import cpu_threads

    for module in (cpu_limits, cpu_threads):
        monkeypatch.setattr(module, "usable_cpus", lambda: list(allowed))
        monkeypatch.setattr(module, "cgroup_cpu_limit", lambda: quota)


def test_more_threads_than_cpus_is_refused_and_the_ranks_sum_warned_about(monkeypatch, caplog):
    """Mask of 4 CPUs, quota 3: 3 threads per process pass, 4 are refused where the engine
    runs too; 2 threads for each of 2 worker processes (4 > 3) are warned about."""
    from kvflow.kernels.cpu_threads import check_cpu_threads

    _fake_cpus(monkeypatch, [0, 1, 2, 3], 3.0)
    with caplog.at_level("WARNING", logger="kvflow.kernels.cpu_threads"):
        check_cpu_threads(3, None, 1)
        assert not caplog.records
        with pytest.raises(ValueError, match=r"^cpu_threads=4 exceeds the 3 CPUs"):
            check_cpu_threads(4, None, 1)
        check_cpu_threads(2, None, 2)
    assert "cpu_threads=2 for each of 2 worker process(es) exceeds the 3 CPUs" in caplog.text


def test_engine_config_refuses_more_threads_than_cpus(monkeypatch):
    """Refused at config time (mask of 6 CPUs, quota 2.5: 3 threads at most), except on a
    device that refuses the option as CPU-only later; zero, negative and non-integer counts
    are refused too."""
    _fake_cpus(monkeypatch, [0, 1, 2, 3, 4, 5], 2.5)
    assert EngineConfig.from_kwargs(cpu_threads=3).device_config.cpu_threads == 3
    with pytest.raises(ValueError, match=r"^cpu_threads=4 exceeds the 3 CPUs this process may "
                       r"use \(its affinity mask has 6 CPUs, its cgroup CPU quota is 2\.5 "
                       r"CPUs\)"):
        EngineConfig.from_kwargs(cpu_threads=4)
    with pytest.raises(ValueError, match=r"^cpu_threads=999 exceeds the 3 CPUs"):
        EngineConfig.from_kwargs(cpu_threads=999, tensor_parallel_size=2)
    assert EngineConfig.from_kwargs(cpu_threads=4, device="cuda").device_config.cpu_threads == 4
    for bad, needle in ((0, "cpu_threads=0 must be >= 1"), (-1, "cpu_threads=-1 must be >= 1"),
                        (2.5, "cpu_threads=2.5 is invalid; it must be int or None"),
                        ("2", "cpu_threads='2' is invalid; it must be int or None"),
                        (True, "cpu_threads=True is invalid; it must be int or None")):
        with pytest.raises(ValueError, match=re.escape(needle)):
            EngineConfig.from_kwargs(cpu_threads=bad)


def test_too_many_threads_is_one_line_before_any_model_loads(tiny_llama, monkeypatch, capsys):
    """``kvflow generate`` / ``kvflow serve --cpu-threads N`` above the CPUs: one
    ``kvflow: error:`` line naming the flag (exit 2), no engine started; ``LLM(cpu_threads=N)``
    raises ValueError (it used to warn, then start N OpenMP threads). Likewise a CPU number
    no machine has in ``--cpu-threads-bind``, or one outside the affinity mask (it used to be
    found only once the engine started: for ``serve``, in the engine-core process)."""
    from kvflow.engine import async_llm
    from kvflow.entrypoints.cli import main
    from kvflow.offline import llm as llm_module

    def no_engine(*args, **kw):
        raise AssertionError("the engine was started")

    monkeypatch.setattr(llm_module, "LLMEngine", no_engine)
    monkeypatch.setattr(async_llm.AsyncLLM, "__init__", no_engine)
    _fake_cpus(monkeypatch, [0, 1], None)
    too_many = ("kvflow: error: --cpu-threads=3 exceeds the 2 CPUs this process may use (its "
                "affinity mask has 2 CPUs): threads beyond the CPUs only wait for each other "
                "at every parallel step; give at most 2, or leave it out (the default is "
                "torch's count capped by these CPUs)")
    outside = ("kvflow: error: --cpu-threads-bind='0,5' names CPUs [5] outside this process's "
               "affinity mask [0, 1]")
    for command in (["generate", "--model", tiny_llama.path, "--prompt", "hi"],
                    ["serve", tiny_llama.path]):
        for flags, expected in ((["--cpu-threads", "3"], too_many),
                                (["--cpu-threads-bind", "0,5"], outside)):
            rc = main([*command, "--device", "cpu", *flags])
            err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
            assert (rc, err) == (2, [expected]), (command, flags)
    with pytest.raises(ValueError, match=r"^cpu_threads=3 exceeds the 2 CPUs"):
        llm_module.LLM(model=tiny_llama.path, device="cpu", cpu_threads=3)
    rc = main(["generate", "--model", tiny_llama.path, "--prompt", "hi", "--device", "cpu",
               "--cpu-threads-bind", "0-99999999999"])  # was a MemoryError traceback
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    expected = ("kvflow: error: --cpu-threads-bind='0-99999999999': cpu list '0-99999999999' "
                "names CPU 99999999999: CPU numbers go below 65536 (it also takes 'auto' or "
                "'none')")
    assert (rc, err) == (2, [expected])


@pytest.mark.parametrize("env, kwargs, needle", [
    ({"KVFLOW_NATIVE_CPU": "false"}, {}, "KVFLOW_NATIVE_CPU='false' is invalid"),
    ({"KVFLOW_NATIVE_CPU": "0"}, {"cpu_gemm": "native"}, "cpu_gemm='native'"),
    ({"KVFLOW_NATIVE_CPU": "0", "KVFLOW_CPU_GEMM": "native"}, {}, "cpu_gemm='native'"),
    ({"KVFLOW_NATIVE_CPU": "0"}, {"cpu_attention": "native"}, "cpu_attention='native'"),
    ({"KVFLOW_NATIVE_CPU": "0"}, {"cpu_gemm_pool": True}, "cpu_gemm_pool=True"),
    ({"KVFLOW_NATIVE_CPU": "0", "KVFLOW_CPU_GEMM_POOL": "1"}, {}, "cpu_gemm_pool=True"),
    ({}, {"cpu_attention": "sdpa", "attention_backend": "torch"},
     "attention_backend='torch' does not use it"),
    ({}, {"quantization": "int8", "quantization_group_size": 128},
     "quantization_group_size=128 applies to quantization='int4' only"),
    # 32 is int4's default size, but given with another scheme it is as unread as 128
    ({}, {"quantization": "int8", "quantization_group_size": 32},
     "quantization_group_size=32 applies to quantization='int4' only"),
    ({}, {"quantization": "none", "quantization_group_size": 32},
     "quantization_group_size=32 applies to quantization='int4' only"),
])
def test_settings_that_cannot_take_effect_are_refused(monkeypatch, env, kwargs, needle):
    for name in ("KVFLOW_NATIVE_CPU", "KVFLOW_CPU_GEMM", "KVFLOW_CPU_ATTENTION",
                 "KVFLOW_CPU_GEMM_POOL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(needle)):
        EngineConfig.from_kwargs(**kwargs)
    monkeypatch.setenv("KVFLOW_NATIVE_CPU", "1")
    monkeypatch.delenv("KVFLOW_CPU_GEMM", raising=False)
    if "quantization" not in kwargs and "attention_backend" not in kwargs:
        EngineConfig.from_kwargs(**kwargs)  # with the native kernels on it is accepted


PIN_SCRIPT = """
import json, os
os.sched_setaffinity(0, {mask!r})
from kvflow.kernels.cpu_threads import configure_cpu_threads
threads, cpus, caller = configure_cpu_threads(None, {bind!r})
import torch
torch.ones(1 << 20).sum()  # a parallel region after pinning
masks = {{}}
for tid in os.listdir("/proc/self/task"):
    status = open(f"/proc/self/task/{{tid}}/status").read()
    masks[tid] = [l.split()[1] for l in status.splitlines() if l.startswith("Cpus_allowed_list")][0]
print(json.dumps({{"threads": threads, "cpus": cpus, "masks": masks, "main": str(os.getpid())}}))
"""


@pytest.mark.skipif(native_cpu_kernels() is None, reason="no C compiler")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_pinned_threads_run_on_their_cpus():
    """In a fresh process: thread 0 (the caller) on the first CPU, an OpenMP worker on the
    second; the process's other threads untouched."""
    first, second = sorted(os.sched_getaffinity(0))[:2]
    script = PIN_SCRIPT.format(bind=f"{second},{first}", mask=sorted(os.sched_getaffinity(0)))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["threads"] == 2 and result["cpus"] == [second, first]
    assert result["masks"][result["main"]] == str(second)
    assert str(first) in result["masks"].values()


def test_spin_default_set_unless_the_user_chose():
    env: dict[str, str] = {}
    assert set_openmp_defaults(env, modules={}) is True
    assert env == {"GOMP_SPINCOUNT": DEFAULT_SPINCOUNT}
    for user in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "5"}):
        env = dict(user)
        assert set_openmp_defaults(env, modules={"torch": None}) is False  # too late here
        assert env == user


@pytest.mark.parametrize("order,expected", [("import kvflow, torch", DEFAULT_SPINCOUNT),
                                            ("import torch, kvflow", "300000")])
def test_openmp_runtime_reads_the_spin_setting_when_kvflow_comes_first(order, expected):
    """libgomp prints the spin count it uses (``OMP_DISPLAY_ENV=VERBOSE``): kvflow's when kvflow
    is imported before torch, libgomp's own default (300,000) when torch came first."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", order], capture_output=True, text=True,
                         check=True, env={**env, "OMP_DISPLAY_ENV": "VERBOSE"})
    assert f"GOMP_SPINCOUNT = '{expected}'" in out.stderr


@pytest.mark.skipif(native_cpu_kernels() is None, reason="no C compiler")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
@pytest.mark.parametrize("bind", [None, "none"])
def test_default_pins_the_workers_and_the_caller_only_in_a_step(bind):
    """Two threads on a 2-CPU mask, no --cpu-threads-bind: the OpenMP worker runs on the second
    CPU alone; the calling thread keeps the whole mask (what it starts later inherits it)
    except inside its CallerPin, where it runs on the first; 'none' pins no thread."""
    first, second = sorted(os.sched_getaffinity(0))[:2]
    mask = f"{first},{second}" if second != first + 1 else f"{first}-{second}"
    script = PIN_SCRIPT.format(bind=bind, mask=[first, second]) + CALLER_CHECK
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    result, during = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    assert result["threads"] == 2
    assert result["masks"][result["main"]] == mask
    if bind is None:
        assert result["cpus"] == [first, second]
        assert sorted(result["masks"].values()).count(str(second)) == 1
        assert during == {"in_step": [first], "after": [first, second]}
    else:
        assert result["cpus"] is None
        assert set(result["masks"].values()) == {mask}
        assert during == {"in_step": [first, second], "after": [first, second]}


CALLER_CHECK = """
with caller:
    in_step = sorted(os.sched_getaffinity(0))
print(json.dumps({"in_step": in_step, "after": sorted(os.sched_getaffinity(0))}))
"""


def test_forced_isa_level_with_the_native_kernels_off_is_refused(monkeypatch):
    """KVFLOW_CPU_ISA picks which build of kvflow's native kernels loads; with
    KVFLOW_NATIVE_CPU=0 none loads, so the level was accepted and ignored in silence."""
    from kvflow.config.cpu_isa import isa_levels_for_cpu

    lowest = isa_levels_for_cpu()[-1].name  # a level every CPU of this architecture runs
    monkeypatch.setenv("KVFLOW_CPU_ISA", lowest)
    monkeypatch.setenv("KVFLOW_NATIVE_CPU", "0")
    with pytest.raises(ValueError, match=rf"^KVFLOW_CPU_ISA='{lowest}' chooses the build of "
                                         "kvflow's native CPU kernels, which "
                                         "KVFLOW_NATIVE_CPU=0 turns off"):
        EngineConfig.from_kwargs()
    monkeypatch.setenv("KVFLOW_NATIVE_CPU", "1")
    EngineConfig.from_kwargs()  # with the native kernels on it is accepted
    monkeypatch.setenv("KVFLOW_CPU_ISA", "")  # empty: unset, the best level
    monkeypatch.setenv("KVFLOW_NATIVE_CPU", "0")
    EngineConfig.from_kwargs()


def test_pool_is_not_claimed_without_the_native_kernels(monkeypatch, caplog):
    """--cpu-gemm-pool shares the native kernels' work; where they did not build (no C
    compiler) there is no pool, and the start-up line said 'GEMM work shared by kvflow's
    pool' all the same."""
    import torch

    from kvflow.kernels import cpu_threads

    monkeypatch.setattr(cpu_threads, "native_cpu_kernels", lambda: None)
    before = torch.get_num_threads()
    try:
        with caplog.at_level("INFO", logger="kvflow.kernels.cpu_threads"):
            threads, cpus, _ = cpu_threads.configure_cpu_threads(2, "none", gemm_pool=True)
    finally:
        torch.set_num_threads(before)
    assert (threads, cpus) == (2, None)
    assert "CPU compute threads: 2; native CPU kernels off (torch's kernels run)" in caplog.text
    assert "kvflow's pool" not in caplog.text


@pytest.mark.skipif(native_cpu_kernels() is None, reason="no C compiler")
def test_start_up_line_names_the_isa_level_loaded(monkeypatch, caplog):
    """Nothing in the log said which build of the native kernels an engine loaded, so a user
    forcing KVFLOW_CPU_ISA=avx2 could not see it take effect. The start-up line now names the
    level: with KVFLOW_CPU_ISA unset, the first of the levels whose features /proc/cpuinfo
    lists (the oracle: the flags file read here, not kvflow's detection)."""
    import torch

    from kvflow.config.cpu_isa import isa_levels
    from kvflow.kernels import cpu_threads

    monkeypatch.delenv("KVFLOW_CPU_ISA", raising=False)
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo
                  if line.startswith(("flags", "Features"))), [])
    best = next(level.name for level in isa_levels() if level.cpu_features <= set(flags))
    before = torch.get_num_threads()
    try:
        with caplog.at_level("INFO", logger="kvflow.kernels.cpu_threads"):
            cpu_threads.configure_cpu_threads(1, "none")
    finally:
        torch.set_num_threads(before)
    assert f"CPU compute threads: 1; native CPU kernels: {best} (the best this CPU runs)" \
        in caplog.text
    monkeypatch.setenv("KVFLOW_CPU_ISA", best)
    assert cpu_threads.native_kernels_note(native_cpu_kernels()) == \
        f"native CPU kernels: {best} (forced by KVFLOW_CPU_ISA)"
