"""The Sampler contract shared by every backend: inputs, adapters, weight versions."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

from twinkle.mesh import remote_class
from twinkle.sampler.adapters import AdapterWeights, extract_adapter, load_adapter_folder
from twinkle.sampler.params import SampleResponse, SamplingParams

Prompt = list[int]


@remote_class  # `Sampler(..., remote_group='sampler')` is a Ray actor group in ray mode
class Sampler(ABC):
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
    @abstractmethod
    def sample(self, inputs, sampling_params: SamplingParams | dict | None = None,
               adapter_name: str | Sequence[str | None] | None = None) -> list[SampleResponse]:
        ...

    @abstractmethod
    def compute_logprobs(self, inputs, adapter_name: str | Sequence[str | None] | None = None
                         ) -> list[list[float | None]]:
        """log p(token_t | tokens_<t) of every token of every input (the first is None)."""

    @abstractmethod
    def _install_adapter(self, name: str, weights: AdapterWeights) -> None:
        ...

    @abstractmethod
    def _uninstall_adapter(self, name: str) -> None:
        ...

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

    def add_adapter_from_model(self, name: str, model, adapter_name: str | None = None,
                               version: int | None = None) -> int:
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
        raise TypeError(f"cannot use {type(item).__name__} as a prompt: expected token ids, an encoded row "
                        "with input_ids, a chat (list of {role, content}) or a string")

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
        if isinstance(inputs, (str, dict)) or _is_messages(inputs) or hasattr(inputs, "tolist"):
            ids = inputs.tolist() if hasattr(inputs, "tolist") else None
            if ids is not None and ids and isinstance(ids[0], list):
                return [self._as_ids(row) for row in ids]
            return [self._encode_one(inputs)]
        if not isinstance(inputs, Sequence) or len(inputs) == 0:
            raise ValueError(f"inputs must be a non-empty prompt or list of prompts, got {inputs!r}")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in inputs):
            return [self._as_ids(inputs)]
        return [self._encode_one(item) for item in inputs]

    def _normalize_adapters(self, adapter_name, n: int) -> list[str | None]:
        names = list(adapter_name) if isinstance(adapter_name, (list, tuple)) else [adapter_name] * n
        if len(names) != n:
            raise ValueError(f"adapter_name lists {len(names)} names for {n} prompts")
        unknown = sorted({a for a in names if a is not None and a not in self._versions})
        if unknown:
            raise KeyError(f"unknown adapter(s) {unknown}; loaded: {self.adapter_names}")
        return names


def _is_messages(obj) -> bool:
    return (isinstance(obj, Sequence) and not isinstance(obj, str) and len(obj) > 0
            and all(isinstance(m, dict) and "role" in m for m in obj))
