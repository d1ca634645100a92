"""The tokenizer and chat template a GGUF carries -> Hugging Face tokenizer files."""

from __future__ import annotations

import logging
from pathlib import Path

from pagedserve.core.errors import UnsupportedModel

logger = logging.getLogger(__name__)

# Mixed text (accents, digits, tabs, code, chat markers) whose ids must survive the save/reload.
_PROBE = "<|im_start|>user\nHello, wörld! 12345 \t code()<|im_end|>\n<start_of_turn>model\n"


def write_tokenizer(gguf_path: Path, out_dir: Path, max_length: int, require_chat_template: bool) -> None:
    """Save the tokenizer (vocab, merges, special tokens, chat template) the GGUF describes.

    `PreTrainedTokenizerFast(gguf_file=...)` reads only the tokenizer metadata (under a second);
    `AutoTokenizer` would also parse the whole config through the slow legacy reader.
    """
    from transformers import PreTrainedTokenizerFast

    try:
        built = PreTrainedTokenizerFast.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (KeyError, ValueError, NotImplementedError) as exc:
        raise UnsupportedModel(
            f"{gguf_path.name}: transformers cannot build a tokenizer from this GGUF's metadata ({exc})"
        ) from exc
    if not built.chat_template:
        if require_chat_template:
            raise UnsupportedModel(f"{gguf_path.name} carries no tokenizer.chat_template")
        logger.warning("%s carries no tokenizer.chat_template: chat requests will be refused", gguf_path.name)
    built.model_max_length = max_length  # otherwise saved as "unbounded" (1e30)
    built.save_pretrained(str(out_dir))
    # The saved files must tokenize exactly like the GGUF-built tokenizer, specials included.
    saved = PreTrainedTokenizerFast.from_pretrained(str(out_dir))
    if saved.encode(_PROBE) != built.encode(_PROBE) or saved.chat_template != built.chat_template:
        raise UnsupportedModel(f"the tokenizer saved from {gguf_path.name} does not match the GGUF's own")
