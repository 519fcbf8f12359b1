"""Multi-tenant LoRA: many adapters over one frozen base, trained together in fused passes."""

from twinkle.model.multi_lora.layer import MultiLoraLinear, Routing
from twinkle.model.multi_lora.model import MultiLoraModel
from twinkle.model.multi_lora.spec import AdapterSpec

__all__ = ["AdapterSpec", "MultiLoraLinear", "MultiLoraModel", "Routing"]
