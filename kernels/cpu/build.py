"""Compile the CPU kernels (C++ through torch.utils.cpp_extension) once per machine.

The build lands in torch's extension cache (``$TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``) under a name hashed from the sources and headers, the flags and the
checkout's path (torch rebuilds whenever the recorded source path changes, so two checkouts sharing one
name would rebuild each other's). A first build takes about a minute on 2 cores and
``scripts/setup.sh`` runs it (``python -m pagedserve.kernels.cpu``), so no server pays it at
startup; later loads take about 2 s (torch still runs ninja and checks the compiler).
Concurrent first loads (two Triton model instances) wait on torch's build lock.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).parent
# Compiled into one module; HEADERS only count towards the build's name (a changed header rebuilds).
SOURCES = [HERE / "bindings.cpp", HERE / "paged_decode_attention.cpp", HERE / "fused_ops.cpp"]
HEADERS = [HERE / "ops.h", HERE / "vec.h"]
# Reassociation lets GCC vectorise the dot products and sums; no -ffast-math, which would also
# assume no NaN/inf (masked scores and softmax rely on real infinities).
CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math"]


class CpuKernelsUnavailable(RuntimeError):
    """The C++ CPU kernels could not be built or loaded here (the reference path still works)."""


def extension_name() -> str:
    h = hashlib.sha256(" ".join(CFLAGS).encode() + str(HERE).encode())
    for path in SOURCES + HEADERS:
        h.update(path.name.encode() + path.read_bytes())
    digest = h.hexdigest()
    return f"pagedserve_cpu_kernels_{digest[:12]}"


def _put_pip_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pip package's binary is not on it outside an activated venv."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


@functools.lru_cache(maxsize=1)
def load_extension() -> ModuleType:
    """Build (first time) and import the extension; raises CpuKernelsUnavailable naming why."""
    _put_pip_ninja_on_path()
    missing = [tool for tool in ("c++", "ninja") if shutil.which(tool) is None]
    if missing:
        raise CpuKernelsUnavailable(f"{' and '.join(missing)} not found on PATH (install a C++ compiler and "
                                    "`pip install ninja`), or set attention_backend='reference'")
    try:
        from torch.utils.cpp_extension import load

        # -fopenmp links libgomp.so.1, which resolves to the copy torch already loaded: one
        # OpenMP runtime, one thread team.
        return load(name=extension_name(), sources=[str(p) for p in SOURCES], extra_cflags=CFLAGS,
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # noqa: BLE001 - compiler output varies; keep its message
        raise CpuKernelsUnavailable(f"building the C++ CPU kernels failed: {exc}") from exc


def main() -> int:
    try:
        load_extension()
    except CpuKernelsUnavailable as exc:
        print(f"pagedserve: CPU kernels unavailable, the engine will use the pure-torch path: {exc}", file=sys.stderr)
        return 1
    print("pagedserve: CPU kernels built and loaded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
