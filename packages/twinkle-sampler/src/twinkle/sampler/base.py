"""The Sampler contract shared by every backend: inputs, adapters, weight versions."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

from twinkle.mesh import RemoteClass, remote_method
from twinkle.mesh.device_mesh import split_bounds
from twinkle.sampler.adapters import AdapterWeights, extract_adapter, load_adapter_folder
from twinkle.sampler.params import SampleResponse, SamplingParams

Prompt = list[int]


def prompt_items(inputs) -> list:
    """The prompts in `inputs`, one item each, not yet encoded. An empty list is no prompts (what a
    rank of a remote group gets when there are fewer prompts than ranks)."""
    if hasattr(inputs, "tolist") and not isinstance(inputs, (str, dict)):
        ids = inputs.tolist()
        return ids if ids and isinstance(ids[0], list) else [ids]
    if isinstance(inputs, (str, dict)) or _is_messages(inputs):
        return [inputs]
    if isinstance(inputs, list) and not inputs:
        return []
    if not isinstance(inputs, Sequence) or len(inputs) == 0:
        raise ValueError(f"inputs must be a prompt or a list of prompts, got {inputs!r}")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in inputs):
        return [inputs]
    return list(inputs)


def split_prompts(adapter_position: int):
    """A remote_method dispatch: each data rank gets its contiguous share of the prompts (and of the
    adapter names, when given per prompt, at `adapter_position` or as `adapter_name=`); every other
    argument goes to every rank."""

    def dispatch(call_args: tuple, kwargs: dict, mesh, rank: int) -> tuple[tuple, dict]:
        args, kwargs = list(call_args), dict(kwargs)
        items = prompt_items(args[0] if args else kwargs["inputs"])
        start, stop = split_bounds(len(items), mesh.data_world_size, mesh.get_rank("data", rank))
        if args:
            args[0] = items[start:stop]
        else:
            kwargs["inputs"] = items[start:stop]
        names_positional = len(args) > adapter_position
        names = args[adapter_position] if names_positional else kwargs.get("adapter_name")
        if isinstance(names, (list, tuple)):
            if len(names) != len(items):
                raise ValueError(f"adapter_name lists {len(names)} names for {len(items)} prompts")
            if names_positional:
                args[adapter_position] = list(names)[start:stop]
            else:
                kwargs["adapter_name"] = list(names)[start:stop]
        return tuple(args), kwargs

    return dispatch


# RemoteClass: `Sampler(..., remote_group='sampler')` is a Ray actor group in ray mode
class Sampler(ABC, metaclass=RemoteClass):
    """`sample(inputs, sampling_params, adapter_name=None)` -> one SampleResponse per prompt.

    `inputs`: a list of token ids (one prompt), a list of those, an encoded row (`{"input_ids": ...}`),
    a chat (`[{"role": ..., "content": ...}, ...]` or `{"messages": [...]}`; encoded with the template's
    generation prompt), a string, or a list mixing these. `adapter_name`: None (the base model), one
    name for every prompt, or a list naming one per prompt (rows with different adapters, one batch).
    """

    def __init__(self, tokenizer=None, template=None):
        self.tokenizer = tokenizer if tokenizer is not None else getattr(template, "tokenizer", None)
        self.template = template
        self._versions: dict[str | None, int] = {None: 0}

    # ---- public contract -------------------------------------------------------------------------
    # On a multi-rank remote group each data rank takes its contiguous share of the prompts and the
    # answers come back in prompt order (subclasses inherit these declarations).
    @remote_method(dispatch=split_prompts(adapter_position=2), collect="flatten")
    @abstractmethod
    def sample(
        self,
        inputs,
        sampling_params: SamplingParams | dict | None = None,
        adapter_name: str | Sequence[str | None] | None = None,
    ) -> list[SampleResponse]: ...

    @remote_method(dispatch=split_prompts(adapter_position=1), collect="flatten")
    @abstractmethod
    def compute_logprobs(
        self, inputs, adapter_name: str | Sequence[str | None] | None = None
    ) -> list[list[float | None]]:
        """log p(token_t | tokens_<t) of every token of every input (the first is None)."""

    @abstractmethod
    def _install_adapter(self, name: str, weights: AdapterWeights) -> None: ...

    @abstractmethod
    def _uninstall_adapter(self, name: str) -> None: ...

    def set_adapter(self, name: str, weights: AdapterWeights, version: int | None = None) -> int:
        """Serve `weights` as adapter `name`; returns the weight version samples will now report."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"adapter name must be a non-empty string, got {name!r}")
        if not isinstance(weights, AdapterWeights):
            raise TypeError(f"set_adapter expects AdapterWeights, got {type(weights).__name__}")
        version = weights.version if version is None else version
        self._install_adapter(name, weights)
        self._versions[name] = version
        return version

    def add_adapter_from_model(
        self, name: str, model, adapter_name: str | None = None, version: int | None = None
    ) -> int:
        """Serve the LoRA `adapter_name` of a peft-wrapped model (or TransformersModel) under `name`."""
        weights = extract_adapter(model, adapter_name or name)
        return self.set_adapter(name, weights, self._versions.get(name, 0) + 1 if version is None else version)

    def load_adapter(self, name: str, path: str | Path, version: int | None = None) -> int:
        """Serve a LoRA saved on disk in peft format under `name`."""
        weights = load_adapter_folder(path)
        return self.set_adapter(name, weights, self._versions.get(name, 0) + 1 if version is None else version)

    def remove_adapter(self, name: str) -> None:
        self._uninstall_adapter(name)
        self._versions.pop(name, None)
        if self.synced_adapter == name:
            self.synced_adapter = None

    # twinkle-kit's CheckpointEngineManager marks the adapter it syncs; twinkle-kit's vLLMSampler.sample
    # samples it when no adapter is named (our sample's None stays the base model).
    synced_adapter: str | None = None

    def set_synced_adapter(self, name: str | None) -> None:
        if name is not None and name not in self._versions:
            raise KeyError(f"unknown adapter {name!r}; loaded: {self.adapter_names}")
        self.synced_adapter = name

    @property
    def adapter_names(self) -> list[str]:
        return sorted(n for n in self._versions if n is not None)

    def weight_version(self, adapter_name: str | None = None) -> int:
        """Version of the weights behind `adapter_name` (None: the base model); -1 if never loaded."""
        return self._versions.get(adapter_name, -1)

    # ---- helpers for backends --------------------------------------------------------------------
    def _encode_one(self, item) -> Prompt:
        if isinstance(item, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids or give the sampler a tokenizer")
            return list(self.tokenizer(item, add_special_tokens=False)["input_ids"])
        if isinstance(item, dict) and "input_ids" in item:
            return self._as_ids(item["input_ids"])
        messages = item.get("messages") if isinstance(item, dict) else item
        if _is_messages(messages):
            template = self._get_template()
            encoded = template.encode_prompt(messages)
            return self._as_ids(encoded["input_ids"] if isinstance(encoded, dict) else encoded)
        if isinstance(item, Sequence) or hasattr(item, "tolist"):
            return self._as_ids(item)
        raise TypeError(
            f"cannot use {type(item).__name__} as a prompt: expected token ids, an encoded row "
            "with input_ids, a chat (list of {role, content}) or a string"
        )

    @staticmethod
    def _as_ids(ids) -> Prompt:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        if not ids:
            raise ValueError("empty prompt: a prompt needs at least one token")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise TypeError(f"prompt token ids must be non-negative ints, got {ids[:8]!r}")
        return ids

    def _get_template(self):
        if self.template is None:
            raise ValueError("chat inputs need a template: construct the sampler with template=Template(...)")
        return self.template

    def _normalize_inputs(self, inputs) -> list[Prompt]:
        return [self._encode_one(item) for item in prompt_items(inputs)]

    def _normalize_adapters(self, adapter_name, n: int) -> list[str | None]:
        names = list(adapter_name) if isinstance(adapter_name, (list, tuple)) else [adapter_name] * n
        if len(names) != n:
            raise ValueError(f"adapter_name lists {len(names)} names for {n} prompts")
        unknown = sorted({a for a in names if a is not None and a not in self._versions})
        if unknown:
            raise KeyError(f"unknown adapter(s) {unknown}; loaded: {self.adapter_names}")
        return names


def _is_messages(obj) -> bool:
    return (
        isinstance(obj, Sequence)
        and not isinstance(obj, str)
        and len(obj) > 0
        and all(isinstance(m, dict) and "role" in m for m in obj)
    )
