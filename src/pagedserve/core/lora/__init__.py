"""Multi-LoRA serving: PEFT adapters chosen per request, mixed in one batch (docs/lora.md)."""

from pagedserve.core.lora.manager import LoRAManager, LoRAStats, lora_stats

__all__ = ["LoRAManager", "LoRAStats", "lora_stats"]
