"""Import an existing PEFT LoRA adapter (made elsewhere) as a training checkpoint of the tenant.

The upload is the adapter folder's two files, base64 in JSON: `adapter_config.json` and
`adapter_model.safetensors`. Nothing else is accepted, pickled weights (`adapter_model.bin`, `.pt`)
least of all: a checkpoint is never unpickled. Before anything is written the adapter is checked
against the base model the tenant names (its modules and their shapes, read from the model's config
on the meta device: no weights are loaded): a LoRA adapter (no DoRA, no `modules_to_save`), a rank
within the server's cap, every tensor a `lora_A` / `lora_B` of a Linear the base has, shaped
[r, in] / [out, r]. A refusal is a 400 naming the file, key or module.

The accepted adapter becomes a `training` checkpoint (`tinker://{session}:import:{id}/weights/{name}`)
held by a run that only holds it (as a copied checkpoint's run does): either API starts training
from it the way it resumes any checkpoint (Tinker `create_training_client_from_state(path)`, native
`load(path)`), with the folder's own LoraConfig (rank, alpha, targets).
"""

from __future__ import annotations

import base64
import json
import re
import uuid
from functools import lru_cache
from pathlib import Path

from twinkle.serve.core import lora_configs
from twinkle.serve.core.checkpoints import check_name
from twinkle.serve.core.records import Checkpoint
from twinkle.serve.errors import BadRequest

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PICKLED = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")
UNEMBED = ("lm_head",)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def decode_files(files) -> dict[str, bytes]:
    if not isinstance(files, dict):
        raise BadRequest(f"files must be an object of file name -> base64 contents, got {type(files).__name__}")
    for name in files:
        if not isinstance(name, str) or name.endswith(PICKLED):
            raise BadRequest(
                f"files: {name!r} holds pickled weights, which this server never loads: save the adapter "
                f"with safetensors (peft's save_pretrained default) and upload {WEIGHTS}"
            )
        if name not in (CONFIG, WEIGHTS):
            raise BadRequest(f"files: {name!r} is not part of a PEFT adapter upload; send only {CONFIG} and {WEIGHTS}")
    missing = [n for n in (CONFIG, WEIGHTS) if n not in files]
    if missing:
        raise BadRequest(f"files: the adapter folder needs {missing} (a PEFT LoRA folder has {CONFIG} and {WEIGHTS})")
    out = {}
    for name, data in files.items():
        if not isinstance(data, str):
            raise BadRequest(f"files: {name!r} must be base64 text, got {type(data).__name__}")
        try:
            out[name] = base64.b64decode(data, validate=True)
        except ValueError:  # binascii.Error, and text that is not ASCII
            raise BadRequest(f"files: {name!r} is not valid base64") from None
    return out


@lru_cache(maxsize=8)
def _base_layers(model_path: str):
    """(module path as peft names it under base_model.model -> (in_features, out_features) of every
    Linear, the model's structure) of the base model, built on the meta device: no weights are read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from twinkle.model.structure import describe

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):  # shapes only: no memory, no weights read
        model = AutoModelForCausalLM.from_config(config)
    shapes = {n: (m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    return shapes, describe(model)


def check_adapter(files: dict[str, bytes], model_path: str, base_model: str, validate) -> tuple[dict, set[str]]:
    """(the adapter's LoraConfig as a dict, the modules it adapts) once it fits the base model; a 400
    naming what does not. `validate(config)` is the LoraConfig check every adapter-creating path runs
    (twinkle.serve.core.lora_configs): ranges, rank cap, patterns; a peft LoraConfig."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load as load_safetensors

    try:
        config = json.loads(files[CONFIG])
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"{CONFIG} is not valid JSON: {e}") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else type(config).__name__
        raise BadRequest(f"{CONFIG}: peft_type is {kind!r}; only LoRA adapters can be imported")
    # the weights come from the file, so how fresh ones would be drawn is moot: peft's default, which
    # every engine builds (an adapter saved with init_lora_weights=False would otherwise be refused)
    config["init_lora_weights"] = True
    lora = validate(config)
    rank = lora.r
    try:
        tensors = load_safetensors(files[WEIGHTS])
    except (SafetensorError, ValueError) as e:
        raise BadRequest(f"{WEIGHTS} is not a safetensors file: {e}") from None
    shapes, structure = _base_layers(model_path)
    modules = set()
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise BadRequest(f"{WEIGHTS}: key {key!r} is not a LoRA weight (base_model.model.<module>.lora_A/B.weight)")
        module, which = m.group("module"), m.group("which")
        if module not in shapes:
            raise BadRequest(f"{WEIGHTS}: key {key!r} adapts module {module!r}, which {base_model} has no Linear named")
        fan_in, fan_out = shapes[module]
        want = (rank, fan_in) if which == "A" else (fan_out, rank)
        if tuple(t.shape) != want:
            raise BadRequest(
                f"{WEIGHTS}: {key!r} has shape {list(t.shape)}; {base_model}'s {module} at r={rank} needs {list(want)}"
            )
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise BadRequest(f"{WEIGHTS}: {key!r} holds a non-finite value or is not floating point ({t.dtype})")
        modules.add(module)
    if not modules:
        raise BadRequest(f"{WEIGHTS} holds no LoRA weights")
    _same_modules(lora_configs.targets(f"{CONFIG}: ", lora, list(shapes), structure), modules)
    return config, modules


def _same_modules(targeted: set[str], weighted: set[str]) -> None:
    """The config's target_modules and the file's weights name the same layers (a load would refuse otherwise)."""
    if targeted != weighted:
        missing, extra = sorted(targeted - weighted), sorted(weighted - targeted)
        raise BadRequest(
            f"{CONFIG}: target_modules selects {len(targeted)} layers of the base model but {WEIGHTS} holds "
            f"weights for {len(weighted)}: no weights for {missing[:3]}, weights for untargeted {extra[:3]}"
        )


def spec_fields(modules: set[str]) -> dict:
    """The run record's `lora` fields (what the adapter-memory planner and listings read)."""
    leaf = {m.rsplit(".", 1)[-1] for m in modules}
    return {
        "train_attn": bool(leaf & set(ATTENTION)),
        "train_mlp": bool(leaf - set(ATTENTION) - set(UNEMBED)),
        "train_unembed": bool(leaf & set(UNEMBED)),
    }


class AdapterImports:
    def __init__(self, svc):
        self.svc, self.rt = svc, svc.rt

    def import_adapter(self, tenant: str, engine, name, files, session_id=None, api: str = "tinker") -> Checkpoint:
        if session_id is not None:  # another tenant's session is a 404 before anything of the body is read
            session_id = self.svc.session(tenant, session_id).session_id
        name = check_name(name)
        decoded = decode_files(files)
        from twinkle.hub import resolve_model_path

        model_path = str(engine.entry.path or resolve_model_path(engine.entry.name))
        caps = self.rt.config.caps
        config, targets = check_adapter(
            decoded,
            model_path,
            engine.entry.name,
            lambda raw: lora_configs.lora_config(f"{CONFIG}: ", raw, engine.backend, caps),
        )
        self.svc.admit_save(tenant)
        if session_id is None:
            session_id = self.svc.create_session(tenant, [api, "import"]).session_id
        lora = {"rank": config["r"], "seed": None, **spec_fields(targets)}
        model_id = f"{session_id}:import:{uuid.uuid4().hex[:8]}"
        run = self.svc.create_run(tenant, session_id, model_id, engine, api, lora, {"imported": name})

        def fill(staging: Path) -> dict:
            (staging / WEIGHTS).write_bytes(decoded[WEIGHTS])
            (staging / CONFIG).write_text(json.dumps(config, indent=2))
            return {"lora": lora, "imported": True}

        return self.svc.checkpoints.write(run, "training", name, fill)
