"""Rollouts: prompts in, sampled completions out, then reward context and training rows.

One `Rollout` holds P prompts × G samples, flattened prompt-major (the G samples of a prompt are
adjacent, so `group_size=G` groups them for the advantage). `training_rows(advantages)` gives
rows `TransformersModel.forward_backward` takes: `input_ids` = prompt + completion, `labels` = -100
over the prompt, `logprobs` = the sampler's log-prob of each completion token (the behaviour policy
q, for the importance ratio), `advantages` = one number per row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from twinkle.data_format.labels import IGNORE_INDEX
from twinkle.sampler import SampledSequence, SampleResponse, SamplingParams

# Keys of a prompt row that are not reward context.
_NOT_CONTEXT = ("input_ids", "labels", "messages", "tools", "attention_mask", "position_ids")


class Decoder(Protocol):
    """What a rollout needs from a tokenizer: ids back to text."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...


@dataclass
class Rollout:
    prompt_rows: list[dict]  # one per prompt: what the dataset gave (ground truth, ...)
    responses: list[SampleResponse]  # one per prompt, each with G sequences
    group_size: int
    tokenizer: Decoder | None = None
    meta: dict = field(default_factory=dict)

    @property
    def sequences(self):
        return [s for r in self.responses for s in r.sequences]

    def __len__(self) -> int:
        return len(self.responses) * self.group_size

    @property
    def weight_versions(self) -> list[int]:
        return [r.weight_version for r in self.responses for _ in r.sequences]

    @property
    def texts(self) -> list[str]:
        out = []
        for seq in self.sequences:
            if seq.text is not None:
                out.append(seq.text)
            elif self.tokenizer is not None:
                out.append(self.tokenizer.decode(seq.tokens, skip_special_tokens=False))
            else:
                raise ValueError("the sampler returned no text and the rollout has no tokenizer to decode with")
        return out

    def to_json(self) -> dict:
        """Plain JSON (prompt rows must be JSON already): how a checkpoint keeps a queued rollout."""
        return {
            "prompt_rows": self.prompt_rows,
            "responses": [asdict(r) for r in self.responses],
            "group_size": self.group_size,
            "meta": self.meta,
        }

    @classmethod
    def from_json(cls, data: dict, tokenizer: Decoder | None = None) -> Rollout:
        responses = [
            SampleResponse(
                **{k: v for k, v in r.items() if k != "sequences"},
                sequences=[SampledSequence(**s) for s in r["sequences"]],
            )
            for r in data["responses"]
        ]
        return cls(data["prompt_rows"], responses, data["group_size"], tokenizer, dict(data["meta"]))

    def reward_rows(self) -> list[dict]:
        """Per-sample reward context: the prompt row's fields plus `num_tokens` and `stop_reason`."""
        rows = []
        for prompt_row, response in zip(self.prompt_rows, self.responses):
            context = {k: v for k, v in prompt_row.items() if k not in _NOT_CONTEXT}
            for seq in response.sequences:
                rows.append({**context, "num_tokens": len(seq.tokens), "stop_reason": seq.stop_reason})
        return rows

    def training_rows(self, advantages: Sequence[float], skip_zero: bool = False) -> list[dict]:
        """Rows for `forward_backward`. `skip_zero` drops rows whose advantage is exactly 0 (no gradient
        from the policy term); keep them when the loss has a KL or entropy term."""
        if len(advantages) != len(self):
            raise ValueError(f"{len(advantages)} advantages for {len(self)} sampled sequences")
        rows, i = [], 0
        for response in self.responses:
            prompt = list(response.prompt_tokens)
            for seq in response.sequences:
                adv = float(advantages[i])
                i += 1
                if skip_zero and adv == 0.0:
                    continue
                if seq.logprobs is None:
                    raise ValueError(
                        "sample with SamplingParams(logprobs=True): the loss needs the sampler's log-probs"
                    )
                rows.append(
                    {
                        "input_ids": prompt + list(seq.tokens),
                        "labels": [IGNORE_INDEX] * len(prompt) + list(seq.tokens),
                        "logprobs": [0.0] * len(prompt) + list(seq.logprobs),
                        "advantages": adv,
                    }
                )
        return rows


def sample_rollout(
    sampler,
    prompt_rows: Sequence[Mapping],
    sampling_params: SamplingParams | dict,
    adapter_name: str | None = None,
    template=None,
) -> Rollout:
    """Sample `num_samples` completions for each prompt row with the sampler's current weights.

    A prompt row is an encoded prompt (`input_ids` from `Template.encode_prompt`) or a trajectory with
    `messages` (encoded here through `template`, or the sampler's own template); other keys (ground
    truth) travel along as reward context.
    """
    params = SamplingParams.from_dict(sampling_params)
    rows = [dict(r) for r in prompt_rows]
    if not rows:
        raise ValueError("sample_rollout needs at least one prompt row")
    prompts = []
    for i, row in enumerate(rows):
        if "input_ids" not in row:
            template = template or _template_of(sampler)
            if template is None:
                raise ValueError(f"prompt row {i} has no input_ids: pass template= to encode its messages")
            row.update(template.encode_prompt(row))
        prompts.append(list(row["input_ids"]))
    responses = sampler.sample(prompts, params, adapter_name=adapter_name)
    tokenizer = getattr(sampler, "tokenizer", None) or getattr(template, "tokenizer", None)
    return Rollout(rows, responses, params.num_samples, tokenizer)


# One template per tokenizer, made on first use; bounded by the tokenizers a process loads (a handful).
_TEMPLATES: dict[int, Any] = {}


def _template_of(sampler):
    """The sampler's template, else one over its tokenizer's chat template (made once per sampler)."""
    if getattr(sampler, "template", None) is not None:
        return sampler.template
    tokenizer = getattr(sampler, "tokenizer", None)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None
    cached = _TEMPLATES.get(id(tokenizer))
    if cached is None or cached.tokenizer is not tokenizer:  # an id can be reused once its tokenizer is gone
        from twinkle.template import Template

        cached = _TEMPLATES[id(tokenizer)] = Template(tokenizer=tokenizer)
    return cached
