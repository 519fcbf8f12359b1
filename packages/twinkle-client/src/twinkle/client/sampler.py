"""`Sampler` over HTTP: `sample(inputs, sampling_params, adapter_name=None)` as the local Sampler.

Adapters are named here and resolved on the server: `add_adapter_from_model(name, model)` samples
from a training model's adapter as it is when each sample call runs; `load_adapter(name, path)`
from a saved checkpoint. Inputs: token-id lists, encoded rows, or chats (encoded on the server with
the model's generation prompt).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from twinkle.client import images
from twinkle.client.future import Future
from twinkle.client.http import TwinkleClient
from twinkle.client.schema import Message, SampleOutput, SampleRequest, SampleResult, SamplingParamsModel
from twinkle.client.session import get_client

SamplingParams = SamplingParamsModel


def _prompts(inputs) -> tuple[list[list[int]] | None, list[list[Message]] | None]:
    if isinstance(inputs, Mapping) or (isinstance(inputs, Sequence) and inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    if isinstance(inputs, Sequence) and inputs and isinstance(inputs[0], Mapping) and "role" in inputs[0]:
        inputs = [inputs]
    ids, chats = [], []
    for item in inputs:
        if isinstance(item, Mapping) and "input_ids" in item:
            ids.append(list(item["input_ids"]))
        elif isinstance(item, Mapping) and "messages" in item:  # images travel as data URLs
            chats.append([Message.model_validate(m) for m in images.wire_messages(item["messages"])])
        elif isinstance(item, Sequence) and item and isinstance(item[0], Mapping):
            chats.append([Message.model_validate(m) for m in images.wire_messages(item)])
        elif isinstance(item, Sequence) and all(isinstance(t, int) for t in item):
            ids.append(list(item))
        else:
            raise ValueError(f"cannot sample from {type(item).__name__}: give token ids, encoded rows or chats")
    if ids and chats:
        raise ValueError("mix of token-id prompts and chats: send them in separate calls")
    return (ids or None), (chats or None)


class Sampler:
    def __init__(self, model_id: str | None = None, *, client: TwinkleClient | None = None, **placement):
        self.client, self.base_model = client or get_client(), model_id
        self._adapters: dict[str, dict] = {}

    def add_adapter_from_model(self, name: str, model, adapter_name: str | None = None) -> None:
        self._adapters[name] = {"model_id": model.model_id, "adapter_name": adapter_name}

    def load_adapter(self, name: str, path: str) -> None:
        self._adapters[name] = {"checkpoint": path}

    def sample(
        self, inputs, sampling_params: SamplingParams | dict | None = None, adapter_name: str | None = None
    ) -> Future:
        """Result: one SampleOutput per prompt (`.sequences[i].tokens / .logprobs / .text`)."""
        if adapter_name is not None and adapter_name not in self._adapters:
            raise ValueError(
                f"unknown adapter {adapter_name!r}; add it with add_adapter_from_model or load_adapter "
                f"(known: {sorted(self._adapters)})"
            )
        prompts, chats = _prompts(inputs)
        params = (
            SamplingParams.model_validate(sampling_params or {})
            if not isinstance(sampling_params, SamplingParams)
            else sampling_params
        )
        req = SampleRequest(
            base_model=self.base_model,
            prompts=prompts,
            chats=chats,
            sampling_params=params,
            **(self._adapters[adapter_name] if adapter_name else {}),
        )
        ref = self.client.post("/sample", req.model_dump())
        return Future(self.client, ref, parse=lambda r: SampleResult.model_validate(r).outputs)


TorchSampler = Sampler  # the server picks its sampling engine
__all__ = ["SampleOutput", "Sampler", "SamplingParams", "TorchSampler"]
