"""A client's LoraConfig, checked once for every path that creates an adapter from one.

The native `add_adapter_to_model` (a JSON body) and adapter import (an uploaded `adapter_config.json`)
both call `lora_config`: the wire schema's ranges (`LoraConfigModel`: rank, alpha and dropout
finite and in range), the server's rank cap, the pattern checks of `target_modules`, the nesting
bound, peft's own constructor and the multi-LoRA engine's refusals (`AdapterSpec`), each a 400
naming the field. `targets` then resolves `target_modules` against the base model's Linear layers
by the engine's own rule (a config that adapts nothing is refused before anything is written).
"""

from __future__ import annotations

from pydantic import ValidationError

from twinkle.client.schema import LoraConfigModel
from twinkle.serve.core import bounds
from twinkle.serve.errors import BadRequest


def _first_error(prefix: str, e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err.get("loc", ()))
    return f"{prefix}{loc} = {err.get('input')!r}: {err.get('msg')}"


def lora_config(prefix: str, raw: dict, backend, caps: bounds.ServerCaps):
    """The peft LoraConfig `raw` describes, or a 400 naming the field (`prefix` + its name: the native
    body's "lora_config.", an upload's "adapter_config.json: ") that is wrong."""
    from peft import LoraConfig

    from twinkle.model.multi_lora.spec import AdapterSpec

    where = prefix.rstrip(".: ")
    if not isinstance(raw, dict):
        raise BadRequest(f"{where} must be an object of LoraConfig fields, got {type(raw).__name__}")
    bounds.json_depth(where, raw, caps)
    try:
        checked = LoraConfigModel.model_validate(raw)
    except ValidationError as e:
        raise BadRequest(_first_error(prefix, e)) from None
    bounds.lora_rank(f"{prefix}r", checked.r, backend, caps)
    bounds.target_modules(f"{prefix}target_modules", checked.target_modules)
    try:
        config = LoraConfig(**checked.model_dump())
        AdapterSpec.from_lora_config(config)
    except (TypeError, ValueError) as e:  # peft's constructor and the engine name what they refuse
        raise BadRequest(f"{where}: {str(e).strip()}") from None
    return config


def targets(prefix: str, config, linear_names: list[str], structure) -> set[str]:
    """The base model's Linear layers `config.target_modules` selects (the engine's rule); a 400 if none."""
    from twinkle.model.multi_lora.spec import AdapterSpec

    try:
        return set(AdapterSpec.from_lora_config(config).select_from(linear_names, structure))
    except ValueError as e:
        raise BadRequest(f"{prefix}target_modules: {e}") from None
