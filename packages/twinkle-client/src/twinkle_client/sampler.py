"""`vLLMSampler`: twinkle-kit's client sampler, on our native sampler proxy (twinkle.client.sampler).

The server picks its sampling engine (torch or vLLM), so the class name is kept and nothing else of
vLLM is implied. With a template set (`set_template`, twinkle-data on this machine), chats are
encoded here and every sequence comes back with `new_input_feature`: the prompt row plus the
completion, encoded for training, as twinkle-kit's GRPO loops feed it to forward_backward.
"""

from __future__ import annotations

from collections.abc import Mapping

from twinkle.client.http import TwinkleClient
from twinkle.client.sampler import Sampler
from twinkle.client.schema import IGNORE_INDEX
from twinkle_client.inputs import local_template
from twinkle_client.types import SampledSequence, SampleResponse

PASSED_ON = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "num_samples")


def _params(sampling_params, num_samples: int | None) -> dict:
    params = dict(getattr(sampling_params, "__dict__", None) or sampling_params or {})
    logprobs = params.pop("logprobs", None)
    if logprobs not in (None, 0, 1):
        raise NotImplementedError(f"logprobs={logprobs}: the sampled token's log-prob is returned (logprobs=1)")
    for name, neutral in (("repetition_penalty", 1.0), ("prompt_logprobs", None)):
        if params.pop(name, neutral) != neutral:
            raise NotImplementedError(f"sampling_params {name!r} is not offered by the native sampling API")
    unknown = sorted(set(params) - set(PASSED_ON))
    if unknown:
        raise ValueError(f"unknown sampling_params {unknown}; known: {sorted(PASSED_ON)} and logprobs")
    if num_samples is not None:
        params["num_samples"] = num_samples
    return {k: v for k, v in params.items() if v is not None}


class vLLMSampler:
    def __init__(self, model_id: str, *, client: TwinkleClient | None = None):
        self.proxy = Sampler(model_id, client=client)
        self.model_id = model_id
        self.template = None
        self._adapters: dict[str, str] = {}

    # ARG002: twinkle-kit's signature; one template
    def set_template(self, template_cls="Template", adapter_name: str = "", *, model_id: str | None = None, **kwargs):  # noqa: ARG002
        self.template = local_template(template_cls, model_id or self.model_id, kwargs)

    def _prompt(self, row):
        """(what to send: token ids or a chat, the prompt's encoded row or None)."""
        if isinstance(row, Mapping) and "input_ids" in row:
            return list(row["input_ids"]), dict(row)
        if self.template is not None:
            encoded = self.template.encode_prompt(row)
            return list(encoded["input_ids"]), encoded
        return row, None

    def sample(
        self, inputs, sampling_params=None, adapter_name: str = "", adapter_uri=None, num_samples: int | None = None
    ) -> list[SampleResponse]:
        """One SampleResponse per input. `adapter_uri`: a checkpoint path (model.save's twinkle_path);
        `adapter_name`: one added with add_adapter_from_model."""
        rows = [inputs] if isinstance(inputs, Mapping) else list(inputs)
        prompts = [self._prompt(r) for r in rows]
        name = adapter_name or None
        if adapter_uri is not None:
            path = str(getattr(adapter_uri, "twinkle_path", adapter_uri))
            name = self._adapters.setdefault(path, f"uri-{len(self._adapters)}")
            self.proxy.load_adapter(name, path)
        outputs = self.proxy.sample([p for p, _ in prompts], _params(sampling_params, num_samples), name).result()
        return [
            SampleResponse(sequences=[self._sequence(seq, prompt) for seq in out.sequences])
            for out, (_, prompt) in zip(outputs, prompts)
        ]

    def add_adapter_from_model(self, name: str, model) -> None:
        self.proxy.add_adapter_from_model(name, getattr(model, "proxy", model))

    def _sequence(self, seq, prompt: dict | None) -> SampledSequence:
        tokens = list(seq.tokens)
        logprobs = [[(t, float(lp))] for t, lp in zip(tokens, seq.logprobs)] if seq.logprobs else None
        decoded = seq.text
        if decoded is None and self.template is not None:
            decoded = self.template.decode(tokens, skip_special_tokens=True)
        feature = None
        if prompt is not None:
            ids = list(prompt["input_ids"])
            carried = {k: v for k, v in prompt.items() if k not in ("input_ids", "labels", "attention_mask")}
            messages = [*carried.pop("messages", []), {"role": "assistant", "content": decoded or ""}]
            feature = {
                **carried,
                "messages": messages,
                "input_ids": ids + tokens,
                "labels": [IGNORE_INDEX] * len(ids) + tokens,
            }
        return SampledSequence(
            stop_reason=seq.stop_reason, tokens=tokens, logprobs=logprobs, decoded=decoded, new_input_feature=feature
        )
