"""kernels/cpu/build.py: build once (a list of .cpp sources hashed together), then import the built
library directly, without torch.utils.cpp_extension, unless something it depends on changed."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import pagedserve.kernels.cpu.build as cpu_build
from pagedserve.core.errors import ConfigError
from pagedserve.core.layers.attention import select_attention_backend
from pagedserve.kernels import reference


def use_sources(monkeypatch, folder):
    monkeypatch.setattr(cpu_build, "HERE", folder)
    monkeypatch.setattr(cpu_build, "SOURCES", tuple(sorted(folder.glob("*.cpp"))))
    monkeypatch.setattr(cpu_build, "HEADERS", tuple(sorted(folder.glob("*.h"))))


def test_without_a_compiler_or_a_built_library_auto_falls_back_and_cpu_fails(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("PATH", os.environ["PATH"])  # restored afterwards: the loader may extend it
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built there
    monkeypatch.setattr(cpu_build.shutil, "which", lambda tool: None)
    cpu_build.load_extension.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert select_attention_backend("auto", torch.device("cpu")) is reference
        assert "c++ and ninja not found" in caplog.text
        with pytest.raises(ConfigError, match="attention_backend='cpu'.*not found on PATH"):
            select_attention_backend("cpu", torch.device("cpu"))
    finally:
        cpu_build.load_extension.cache_clear()


def test_the_build_name_follows_every_source_header_and_flag(monkeypatch, tmp_path):
    name = cpu_build.extension_name()
    copy = tmp_path / "copy"
    copy.mkdir()
    for src in (*cpu_build.SOURCES, *cpu_build.HEADERS):
        (copy / src.name).write_bytes(src.read_bytes())
    use_sources(monkeypatch, copy)
    assert cpu_build.extension_name() == name  # the same sources elsewhere (an installed wheel) share the build
    (copy / "extra.cpp").write_text("// a second translation unit\n")
    use_sources(monkeypatch, copy)
    names = [name, cpu_build.extension_name()]
    (copy / "extra.cpp").write_text("// a second translation unit, edited\n")
    names.append(cpu_build.extension_name())
    (copy / "shared.h").write_text("#pragma once\n")
    use_sources(monkeypatch, copy)
    names.append(cpu_build.extension_name())
    (copy / "shared.h").write_text("#pragma once\n// edited\n")
    names.append(cpu_build.extension_name())
    monkeypatch.setattr(cpu_build, "CFLAGS", [*cpu_build.CFLAGS, "-DX"])
    names.append(cpu_build.extension_name())
    assert len(set(names)) == len(names), names


# Plain Python C API, no torch headers: each unit compiles in well under a second.
TWO_SOURCES = {
    "answer.cpp": "int pagedserve_test_answer(int x) { return 2 * x + 1; }\n",
    "bind.cpp": textwrap.dedent("""\
        #include <Python.h>
        int pagedserve_test_answer(int x);
        static PyObject* answer(PyObject*, PyObject* x) { return PyLong_FromLong(pagedserve_test_answer(PyLong_AsLong(x))); }
        static PyMethodDef methods[] = {{"answer", answer, METH_O, ""}, {nullptr, nullptr, 0, nullptr}};
        #define STR_(x) #x
        #define STR(x) STR_(x)
        #define CAT_(a, b) a##b
        #define CAT(a, b) CAT_(a, b)
        static PyModuleDef module = {PyModuleDef_HEAD_INIT, STR(TORCH_EXTENSION_NAME), nullptr, -1, methods};
        PyMODINIT_FUNC CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module); }
        """),
}


def test_a_list_of_sources_builds_once_then_loads_directly(monkeypatch, tmp_path):
    """Two translation units make one library; the second load imports it without building, a
    changed source builds again, and a stamp for other sources is never trusted."""
    src = tmp_path / "src"
    src.mkdir()
    for name, text in TWO_SOURCES.items():
        (src / name).write_text(text)
    use_sources(monkeypatch, src)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "builds"))
    builds = []
    real_build = cpu_build._build
    monkeypatch.setattr(cpu_build, "_build", lambda *a: builds.append(a[0]) or real_build(*a))
    load = cpu_build.load_extension.__wrapped__  # the uncached function: every call loads afresh
    assert load().answer(20) == 41 and len(builds) == 1
    first = builds[0]
    assert (tmp_path / "builds" / first / cpu_build.STAMP).read_text().strip() == cpu_build.source_digest()
    assert load().answer(3) == 7 and len(builds) == 1  # loaded directly
    (src / "answer.cpp").write_text(TWO_SOURCES["answer.cpp"].replace("2 * x + 1", "3 * x"))
    assert load().answer(3) == 9 and len(builds) == 2 and builds[1] != first
    # A stamp that names other sources (e.g. a build that was interrupted and redone elsewhere) is a miss.
    (tmp_path / "builds" / builds[1] / cpu_build.STAMP).write_text("0" * 64 + "\n")
    assert load().answer(3) == 9 and len(builds) == 3


def test_a_fresh_process_loads_the_built_kernels_without_cpp_extension():
    """What every server start does once setup.sh has built the kernels."""
    cpu_build.load_extension()  # built already by setup.sh, or now
    code = ("import sys, torch; from pagedserve.kernels.cpu.build import load_extension; "
            "m = load_extension(); print(hasattr(m, 'paged_decode_attention'), "
            "'torch.utils.cpp_extension' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False"], out


def two_source_build(monkeypatch, tmp_path, tag):
    """The two-unit test extension as this process's sources, built under tmp_path; returns its
    build directory. `tag` makes the sources, hence the build's name, this test's own (torch
    renames a build whose name this process already built elsewhere)."""
    src = tmp_path / "src"
    src.mkdir()
    for name, text in TWO_SOURCES.items():
        (src / name).write_text(f"// {tag}\n{text}")
    use_sources(monkeypatch, src)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "builds"))
    build_dir = tmp_path / "builds" / cpu_build.extension_name()
    build_dir.mkdir(parents=True)
    return build_dir


# Takes torch's own build lock (the file cpp_extension.load creates) in argv[1], then either dies
# holding it, as a killed build does, or holds it for argv[3] seconds and releases it.
TORCH_BUILD = textwrap.dedent("""\
    import os, signal, sys, time
    from torch.utils.file_baton import FileBaton
    baton = FileBaton(os.path.join(sys.argv[1], "lock"))
    assert baton.try_acquire()
    print("held", flush=True)
    if sys.argv[2] == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(float(sys.argv[3]))
    baton.release()  # raises if someone removed the lock meanwhile
    """)


@pytest.mark.timeout(300)  # without the fix cpp_extension.load waits on the left lock forever
def test_a_lock_left_by_a_killed_build_is_removed_and_the_build_goes_on(monkeypatch, tmp_path, caplog):
    build_dir = two_source_build(monkeypatch, tmp_path, "killed")
    killed = subprocess.run([sys.executable, "-c", TORCH_BUILD, str(build_dir), "killed"], capture_output=True, text=True)
    assert killed.returncode == -9 and (build_dir / "lock").exists()
    with caplog.at_level(logging.WARNING):
        assert cpu_build.load_extension.__wrapped__().answer(20) == 41
    assert "left by a build of the CPU kernels that was killed" in caplog.text
    assert not (build_dir / "lock").exists()


@pytest.mark.timeout(300)
def test_a_build_running_outside_the_lock_is_waited_for_not_broken(monkeypatch, tmp_path, caplog):
    """A live holder of torch's lock is building right now: its lock stays, and the load waits for it
    and imports what it built (here built beforehand, its stamp removed)."""
    build_dir = two_source_build(monkeypatch, tmp_path, "alive")
    load = cpu_build.load_extension.__wrapped__
    assert load().answer(3) == 7
    (build_dir / cpu_build.STAMP).unlink()
    holder = subprocess.Popen([sys.executable, "-c", TORCH_BUILD, str(build_dir), "alive", "4"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with caplog.at_level(logging.WARNING):
            assert load().answer(3) == 7
        assert holder.wait(timeout=60) == 0, holder.stderr.read()  # its own release found its lock
    finally:
        holder.kill()
        holder.wait()
    assert f"waiting for process {holder.pid}" in caplog.text


CONCURRENT_LOAD = textwrap.dedent("""\
    import pathlib, sys
    import pagedserve.kernels.cpu.build as b
    src = pathlib.Path(sys.argv[1])
    b.HERE, b.SOURCES, b.HEADERS = src, tuple(sorted(src.glob("*.cpp"))), ()
    print(b.load_extension().answer(20), "torch.utils.cpp_extension" in sys.modules)
    """)


@pytest.mark.timeout(300)
def test_two_first_loads_at_once_build_once(monkeypatch, tmp_path):
    """Two engines starting together on a machine without the build: one builds, the other waits
    for it and imports what it built (or, arriving later, finds it built)."""
    build_dir = two_source_build(monkeypatch, tmp_path, "concurrent")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(build_dir.parent)}
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT_LOAD, str(cpu_build.HERE)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sorted(out.split()[1] for out, _ in outs) == ["False", "True"], outs  # one ran cpp_extension
    assert all(out.split()[0] == "41" for out, _ in outs), outs
