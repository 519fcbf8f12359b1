"""Sampling shared by the backends: `twinkle.sampler.TorchSampler` on its own copy of the base weights.

A sampler adapter is a *snapshot*: installing one copies the LoRA factors, so later training of the
source adapter never changes what an existing sampling session sees.

An RL loop installs one snapshot per step (save_weights_for_sampler), and every sampled checkpoint
installs one too, so the installed adapters are bounded: past MAX_SAMPLER_ADAPTERS the least recently
used is removed. One from a checkpoint folder comes back on its next use (it is installed before
every sample); a removed snapshot answers a clear error naming what to do. A sampler superseded by a
newer one (an inflight target's older version) is retired: removed now, or when its last decode ends.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from twinkle.serve.backend.base import UserError
from twinkle.serve.backend.frozen_base import load_frozen_base
from twinkle.serve.core import slices

if TYPE_CHECKING:
    from twinkle.sampler import SampleResponse, SamplingParams

MAX_SAMPLER_ADAPTERS = 64


class TorchSampling:
    vocab_size: int
    max_context: int

    def _init_sampler(
        self,
        model_path: str,
        dtype: str,
        max_batch_size: int,
        device: str | None = None,
        trust_remote_code: bool = False,
        share_frozen_with=None,
    ) -> None:
        """The sampler on its own copy of the model, in `dtype` as the model entry names it (frozen_base);
        `share_frozen_with`: a training model in this process whose frozen base weights the sampler
        uses instead of holding them twice."""
        from transformers import AutoTokenizer

        from twinkle.sampler import TorchSampler

        trust = {"trust_remote_code": trust_remote_code}  # the operator's opt-in (ModelEntry), never the client's
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, **trust)
        self.sampler = TorchSampler(
            model=load_frozen_base(model_path, dtype, device, trust_remote_code),
            tokenizer=self.tokenizer,
            max_batch_size=max_batch_size,
            device=device,
        )
        if share_frozen_with is not None:
            from twinkle.model.multi_lora.memory import share_frozen_weights

            share_frozen_weights(share_frozen_with, self.sampler.model)

    def install_sampler_from_adapter(self, sampler, adapter):
        self.sampler.set_adapter(sampler, self.adapter_tensors(adapter).clone())  # ty: ignore[missing-attribute] - a mixin: the training backend it joins has adapter_tensors
        self._used(sampler)

    def install_sampler_from_folder(self, sampler, folder):
        if sampler not in self.sampler.adapter_names:
            self.sampler.load_adapter(sampler, folder)
        self._used(sampler)

    def remove_sampler(self, sampler):
        if sampler in self.sampler.adapter_names:
            self.sampler.remove_adapter(sampler)
        self.__dict__.setdefault("_sampler_use", {}).pop(sampler, None)

    def retire_sampler(self, sampler):
        """Remove `sampler` once no decode uses it: a decode paused between its steps (core/slices.py)
        finishes on the weights it began with."""
        if self._busy()[sampler]:
            self._retired().add(sampler)
        else:
            self.remove_sampler(sampler)

    def _used(self, sampler) -> None:
        """Mark `sampler` most recently used; past the cap, remove the least recently used others (never
        one a paused decode is still using: long decodes run in turns, core/slices.py)."""
        use: dict = self.__dict__.setdefault("_sampler_use", {})  # insertion order = recency
        busy = self._busy()
        use.pop(sampler, None)
        use[sampler] = True
        while len(use) > MAX_SAMPLER_ADAPTERS:
            idle = next((name for name in use if not busy[name]), None)
            if idle is None:
                break
            self.remove_sampler(idle)

    def _busy(self) -> collections.Counter:
        """Sampler adapters -> decodes using them now."""
        return self.__dict__.setdefault("_sampler_busy", collections.Counter())

    def _retired(self) -> set:
        """Samplers to remove when their last decode ends (retire_sampler)."""
        return self.__dict__.setdefault("_sampler_retired", set())

    def sampler_adapters(self) -> int:
        return len(self.__dict__.get("_sampler_use", {}))

    def prefix_cache_stats(self) -> dict[str, int]:
        return self.sampler.prefix_cache_stats().as_dict()

    def sample(
        self,
        sampler,
        prompt,
        params: SamplingParams,
        *,
        on_tokens=None,
        images=None,
        cache_namespace=None,
    ) -> SampleResponse:
        """Backend.sample on TorchSampler, which calls `on_tokens` at every decode step."""
        self._check_request(sampler, prompt)
        if len(prompt) + params.max_tokens > self.max_context:
            raise UserError(
                f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) exceeds the context of {self.max_context}"
            )
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise UserError(f"stop token {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        for name, k in (("prompt_logprobs", params.prompt_logprobs), ("logprobs", params.logprobs)):
            if k is not True and not 0 <= k <= self.vocab_size:
                raise UserError(f"top-k {name} must be between 0 and the vocabulary size {self.vocab_size}, got {k}")
        pixels = {"images": [images]} if images is not None else {}

        def each_step(tokens) -> None:
            if on_tokens is not None:
                on_tokens(tokens)
            slices.step()  # other tenants' work may run here; the sampler routes its rows again after

        busy = self._busy()
        busy[sampler] += 1
        try:
            (resp,) = self.sampler.sample(
                [prompt], params, adapter_name=sampler, on_tokens=each_step, cache_namespace=cache_namespace, **pixels
            )
        except ValueError as e:
            if not pixels:
                raise
            raise UserError(str(e)) from None  # the prompt's image tokens and its images disagree
        finally:
            busy[sampler] -= 1
            if not busy[sampler]:
                del busy[sampler]
                if sampler in self._retired():
                    self._retired().discard(sampler)
                    self.remove_sampler(sampler)
        return resp

    def reduce_prompt_table(self, sampler, prompt, reduce, *, images=None):
        self._check_request(sampler, prompt)
        pixels = {"images": [images]} if images is not None else {}
        (table_T_V,) = self.sampler.prompt_logprob_tables([prompt], adapter_name=sampler, **pixels)
        return reduce(table_T_V)

    def _check_request(self, sampler, prompt) -> None:
        if not prompt:
            raise UserError("prompt is empty")
        if sampler is not None and sampler not in self.sampler.adapter_names:
            raise UserError(
                "this sampler's weights are gone (the server restarted, or it was the least recently used of "
                f"more than {MAX_SAMPLER_ADAPTERS} snapshots); save weights for it again"
            )
        if sampler is not None:
            self._used(sampler)
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise UserError(f"prompt token {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
