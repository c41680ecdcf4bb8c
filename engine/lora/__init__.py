"""LoRA adapters per request: vLLM's `LoRARequest`, PEFT folders read and checked, a host
cache of parsed adapters, the device slots the model's projections read, and each step's
adapters (`manager.py`); the kernels are `batchlm.kernels.lora_*`."""

from .registry import LoRAModules, LoRARegistry
from .request import LoRARequest, lora_requests_per_prompt

__all__ = ["LoRAModules", "LoRARegistry", "LoRARequest", "lora_requests_per_prompt"]
