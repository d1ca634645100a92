"""Build the CPU kernels (C++ through torch.utils.cpp_extension) once, then load the built library
directly.

Every ``*.cpp`` beside this file is one translation unit of the extension (``*.h`` may hold what
they share). The extension's name is a hash of all of them, the flags and torch's and Python's
versions: checkouts and installs with the same sources share one build, any difference makes its
own. The build lands in
``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) under ``<name>/``, and a stamp
holding the full hash is written beside the library once it has been built and imported.

Loading, in order:

* the stamp matches: import ``<name>.so`` directly (a few milliseconds). This is every start after
  the first: ``torch.utils.cpp_extension.load`` would import itself (about a second), run ninja
  and check the compiler each time, about 2 s on 2 cores, before finding nothing to do;
* otherwise build on demand through ``cpp_extension.load`` (about a minute on 2 cores, once;
  ``scripts/setup.sh`` runs it, ``python -m pagedserve.kernels.cpu``), then write the stamp.
  Concurrent first builds (two engines starting at once) wait on one flock per build directory,
  and the one that waited loads what the first built. torch's own lock file, which a killed build
  leaves behind and every later build would wait on forever, is cleared under it (build_lock.py).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import sys
from pathlib import Path
from types import ModuleType

if __package__:
    from .build_lock import exclusive_build
    from .isa import isa_cap
else:  # run as a file (scripts/setup.sh): this folder is sys.path[0]
    from build_lock import exclusive_build
    from isa import isa_cap

HERE = Path(__file__).resolve().parent
SOURCES: tuple[Path, ...] = tuple(sorted(HERE.glob("*.cpp")))
"""The extension's translation units: every .cpp file in this folder."""
HEADERS: tuple[Path, ...] = tuple(sorted(HERE.glob("*.h")))
# Reassociation lets GCC vectorise the dot products and sums; no -ffast-math, which would also
# assume no NaN/inf (masked scores and softmax rely on real infinities).
CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math"]
# -fopenmp links libgomp.so.1, which resolves to the copy torch already loaded: one OpenMP
# runtime, one thread team.
LDFLAGS = ["-fopenmp"]
STAMP = "pagedserve-build.sha256"


class CpuKernelsUnavailable(RuntimeError):
    """The C++ CPU kernels could not be built or loaded here (the reference path still works)."""


def source_digest() -> str:
    """Hash of everything the built library depends on: any change means another build. Reads
    torch's version from its metadata, so checking a build does not import torch."""
    h = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    torch_version = importlib.metadata.version("torch")
    for part in (" ".join(CFLAGS), " ".join(LDFLAGS), torch_version, sys.version, platform.machine()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def extension_name(digest: str | None = None) -> str:
    return f"pagedserve_cpu_kernels_{(digest or source_digest())[:12]}"


def build_root() -> Path:
    """$TORCH_EXTENSIONS_DIR, else torch's default (~/.cache/torch_extensions, XDG_CACHE_HOME aware)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions"


def _import_library(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _built_library(name: str, build_dir: Path, digest: str) -> Path | None:
    """The library built earlier for exactly these sources, if there is one."""
    library = build_dir / f"{name}.so"
    try:
        return library if (build_dir / STAMP).read_text().strip() == digest and library.is_file() else None
    except OSError:
        return None


def is_built() -> bool:
    """Whether these sources were built here already (checked without importing torch)."""
    digest = source_digest()
    return _built_library(extension_name(digest), build_root() / extension_name(digest), digest) is not None


def _load_built(name: str, build_dir: Path, digest: str) -> ModuleType | None:
    library = _built_library(name, build_dir, digest)
    if library is None:
        return None
    import torch  # noqa: F401 - the library links libtorch: load it first

    try:
        return _import_library(name, library)
    except ImportError:
        return None  # a stale or foreign library: rebuild it


def _put_pip_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pip package's binary is not on it outside an activated venv."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def _build(name: str, build_dir: Path, digest: str) -> ModuleType:
    _put_pip_ninja_on_path()
    missing = [tool for tool in ("c++", "ninja") if shutil.which(tool) is None]
    if missing:
        raise CpuKernelsUnavailable(f"{' and '.join(missing)} not found on PATH (install a C++ compiler and "
                                    "`pip install ninja`), or set attention_backend='reference'")
    if not SOURCES:
        raise CpuKernelsUnavailable(f"no C++ sources in {HERE}; reinstall pagedserve")
    with exclusive_build(build_dir):
        module = _load_built(name, build_dir, digest)  # built by the process this one waited for
        if module is not None:
            return module
        try:
            from torch.utils.cpp_extension import load

            # Copies of the flags: load() appends torch's own libraries to the lists it is given.
            module = load(name=name, sources=[str(s) for s in SOURCES], extra_cflags=list(CFLAGS),
                          extra_ldflags=list(LDFLAGS), build_directory=str(build_dir), verbose=False)
        except Exception as exc:  # noqa: BLE001 - compiler output varies; keep its message
            raise CpuKernelsUnavailable(f"building the C++ CPU kernels failed: {exc}") from exc
        tmp = build_dir / f"{STAMP}.{os.getpid()}"
        tmp.write_text(digest + "\n")
        tmp.replace(build_dir / STAMP)  # atomic: a concurrent loader sees the old stamp or the new one
        return module


@functools.lru_cache(maxsize=1)
def load_extension() -> ModuleType:
    """Import the extension, building it first if these sources were never built here; raises
    CpuKernelsUnavailable naming why it cannot (and ValueError for a PAGEDSERVE_CPU_ISA it does
    not know, which the C++ side would ignore)."""
    isa_cap()
    digest = source_digest()
    name = extension_name(digest)
    build_dir = build_root() / name
    return _load_built(name, build_dir, digest) or _build(name, build_dir, digest)


def main(argv: list[str] | None = None) -> int:
    """`python -m pagedserve.kernels.cpu [--if-needed]`: build (or check) and load the kernels;
    --if-needed returns at once when they are built already (scripts/setup.sh)."""
    if "--if-needed" in (sys.argv[1:] if argv is None else argv) and is_built():
        print("pagedserve: CPU kernels already built")
        return 0
    try:
        load_extension()
    except CpuKernelsUnavailable as exc:
        print(f"pagedserve: CPU kernels unavailable, the engine will use the pure-torch path: {exc}", file=sys.stderr)
        return 1
    print("pagedserve: CPU kernels built and loaded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
