"""The conversion cache: each GGUF is converted once into a folder named after its contents.

A folder appears under its final name only through os.rename of a finished temp dir, so a crash,
a refused file or a full disk never leaves a half-written entry that a later start would trust.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

from pagedserve.core.errors import ConfigError, ModelNotFound

try:  # POSIX only; elsewhere the atomic rename alone keeps concurrent conversions safe
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

logger = logging.getLogger(__name__)

# Bump when the converted layout changes (names, dtype, files): old cache folders are then ignored.
CONVERTER_FORMAT_VERSION = 2  # 2: Q8_0 projections also kept undecoded (convert.py: Q8_0_FILE)
CACHE_ENV = "PAGEDSERVE_CACHE_DIR"


def default_cache_root() -> Path:
    """`$PAGEDSERVE_CACHE_DIR`, else `~/.cache/pagedserve`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagedserve"


def file_stem(name: str) -> str:
    """A file or folder name as the start of a cache entry's name: safe characters only, at most 80."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip(".-")[:80] or "model"


def content_digest(gguf_path: Path) -> str:
    """File size + a hash of the first and last MiB: a few ms, yet different for any re-quantization
    (which rewrites both the header and the tensor data at the end)."""
    size = gguf_path.stat().st_size
    digest = hashlib.sha256()
    with open(gguf_path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read(1 << 20))
    return f"{size}-{digest.hexdigest()[:12]}"


def is_complete(folder: Path) -> bool:
    # Folders only appear under their final name through os.rename of a finished temp dir, so the
    # files are enough to tell a finished folder from a hand-made one.
    return (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()


def convert_once(gguf_path: Path, root: Path, key: str, converter: Callable[..., None], progress: bool,
                 what: str) -> Path:
    """`root/key`, converting `gguf_path` into it with `converter(gguf_path, out_dir, progress=...)`
    unless it exists already.

    Safe when several processes start at once: one converts under a file lock into a temp dir inside
    the cache root and renames it into place; the others wait on the lock and then reuse the result.
    """
    target = root / key
    if is_complete(target):
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # e.g. a read-only home in a serving container
        raise ConfigError(
            f"cache folder {str(root)!r} cannot be created ({exc}); set {CACHE_ENV} to a writable folder"
        ) from exc
    with open(root / f".{key}.lock", "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, even on a crash
        if is_complete(target):  # another process converted while we waited
            return target
        message = f"pagedserve: converting {what} once into {target} (later starts reuse it)"
        if progress:  # the first start pauses here; say why and where the disk space goes
            print(message, file=sys.stderr)
        else:
            logger.info(message)
        # Holding the lock, any temp dir of this key was left by a crashed converter.
        for stale in root.glob(f".{key}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=root))
        try:
            converter(gguf_path, tmp, progress=progress)
            # mkdtemp/safetensors create owner-only modes; a shared cache must be readable by all.
            os.chmod(tmp, 0o755)
            for file in tmp.iterdir():
                os.chmod(file, 0o644)
            try:
                os.rename(tmp, target)
            except OSError:
                if not is_complete(target):  # not a lost race (e.g. no fcntl): a real failure
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename
    return target


def ensure_gguf_model(gguf_path: Path, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """The converted folder for any supported GGUF file, converting it on the first call."""
    from pagedserve.core.models.gguf import convert

    gguf_path = Path(gguf_path).expanduser()
    if not gguf_path.is_file():
        raise ModelNotFound(f"GGUF file {str(gguf_path)!r} does not exist")
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    key = f"gguf-{file_stem(gguf_path.stem)}-{content_digest(gguf_path)}-fmt{CONVERTER_FORMAT_VERSION}"
    # Looked up at call time, so tests can swap the converter on the module.
    return convert_once(gguf_path, root, key, convert.convert_gguf_to_hf, progress, gguf_path.name)
