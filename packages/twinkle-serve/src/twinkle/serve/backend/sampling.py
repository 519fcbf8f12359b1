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

from twinkle.serve.backend.base import SampledSeq, SampleParams, SampleResult, UserError
from twinkle.serve.core import slices

MAX_SAMPLER_ADAPTERS = 64


class TorchSampling:
    vocab_size: int
    max_context: int

    def _init_sampler(
        self,
        model_path: str,
        torch_dtype,
        max_batch_size: int,
        device: str | None = None,
        trust_remote_code: bool = False,
        share_frozen_with=None,
    ) -> None:
        """The sampler on its own copy of the model; `share_frozen_with`: a training model in this
        process whose frozen base weights the sampler uses instead of holding them twice."""
        from transformers import AutoTokenizer

        from twinkle.model.vision import load_pretrained
        from twinkle.sampler import TorchSampler

        trust = {"trust_remote_code": trust_remote_code}  # the operator's opt-in (ModelEntry), never the client's
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, **trust)
        self.sampler = TorchSampler(
            model=load_pretrained(model_path, dtype=torch_dtype, **trust),
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
        num_samples,
        params: SampleParams,
        prompt_logprobs,
        *,
        on_tokens=None,
        images=None,
        cache_namespace=None,
    ) -> SampleResult:
        """Backend.sample on TorchSampler, which calls `on_tokens` at every decode step."""
        from twinkle.sampler import SamplingParams

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
        max_tokens = params.max_tokens
        if max_tokens is None:  # as many as the context leaves
            max_tokens = self.max_context - len(prompt)
            if max_tokens < 1:
                raise UserError(f"prompt ({len(prompt)}) fills the context of {self.max_context}: no room to sample")
        if len(prompt) + max_tokens > self.max_context:
            raise UserError(
                f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds the context of {self.max_context}"
            )
        stop = [params.stop] if isinstance(params.stop, (str, int)) else params.stop
        bad = [t for t in stop or [] if isinstance(t, int) and not isinstance(t, bool) and not 0 <= t < self.vocab_size]
        if bad:
            raise UserError(f"stop token {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        for name, k in (("topk_prompt_logprobs", params.topk_prompt), ("topk_sample_logprobs", params.topk_sample)):
            if not 0 <= k <= self.vocab_size:
                raise UserError(f"{name} must be between 0 and the vocabulary size {self.vocab_size}, got {k}")
        last_n = params.prompt_logprobs_last_n
        if last_n is not None and not 1 <= last_n <= len(prompt) - 1:
            raise UserError(
                f"prompt_logprobs_last_n must be between 1 and len(prompt) - 1 = {len(prompt) - 1}, got {last_n}"
            )
        try:
            sp = SamplingParams(
                max_tokens=max_tokens,
                temperature=params.temperature,
                top_k=0 if params.top_k == -1 else params.top_k,
                top_p=params.top_p,
                seed=params.seed,
                # Tinker: an explicit empty list turns off every stop, EOS included
                stop=stop or None,
                ignore_eos=stop == [],
                num_samples=num_samples,
                logprobs=params.topk_sample or True,
                prompt_logprobs=params.topk_prompt or bool(prompt_logprobs),
            )
        except ValueError as e:
            raise UserError(str(e)) from None
        targets = params.target_prompt_ids
        if targets is not None and (
            targets.ndim != 2
            or targets.shape[0] != len(prompt) - 1
            or not ((targets >= -1) & (targets < self.vocab_size)).all()
        ):
            raise UserError(
                f"target_prompt_logprobs must be [len(prompt) - 1 = {len(prompt) - 1}, K] token ids "
                f"in [0, {self.vocab_size}) or -1"
            )
        pixels = {"images": [images]} if images is not None else {}

        def each_step(tokens) -> None:
            if on_tokens is not None:
                on_tokens(tokens)
            slices.step()  # other tenants' work may run here; the sampler routes its rows again after

        busy = self._busy()
        busy[sampler] += 1
        try:
            (resp,) = self.sampler.sample(
                [prompt], sp, adapter_name=sampler, on_tokens=each_step, cache_namespace=cache_namespace, **pixels
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
        seqs = [SampledSeq(s.tokens, list(s.logprobs or []), s.stop_reason, s.top_logprobs) for s in resp.sequences]
        scored = _from_position(len(prompt) - last_n if last_n is not None else 0)
        result = SampleResult(
            seqs,
            scored(resp.prompt_logprobs) if prompt_logprobs else None,
            scored(resp.prompt_top_logprobs) if params.topk_prompt else None,
            prompt_cache_hit_tokens=resp.cached_prompt_tokens,
        )
        if targets is not None or params.prompt_alt_tokens_k:
            import torch

            # a second prefill: these need the whole distribution at every prompt position
            (table_T_V,) = self.sampler.prompt_logprob_tables([prompt], adapter_name=sampler, **pixels)
            if targets is not None:
                ids = torch.from_numpy(targets).clamp(min=0)
                scores = table_T_V.gather(1, ids).masked_fill(torch.from_numpy(targets) < 0, 0.0)
                result.target_prompt_logprobs = scores.numpy()
            if params.prompt_alt_tokens_k:
                result.prompt_alt_tokens = _draw_alternatives(
                    table_T_V, params.prompt_alt_tokens_k, params.temperature, params.seed
                )
        return result


def _draw_alternatives(table_T_V, k: int, temperature: float, seed: int | None):
    """k draws with replacement at `temperature` from each row's distribution -> (ids, their model log-probs)."""
    import random

    import numpy as np
    import torch

    from twinkle.sampler.decoding import row_seed

    if temperature == 0 or table_T_V.shape[0] == 0:
        ids_T_K = table_T_V.argmax(-1, keepdim=True).expand(-1, k)
    else:
        # seeded like the request's samples, on a stream of its own (sample index -1)
        g = torch.Generator().manual_seed(row_seed(seed if seed is not None else random.randrange(2**62), -1))
        shifted_T_V = table_T_V - table_T_V.max(-1, keepdim=True).values  # a tiny temperature must not give NaN
        # below float32's smallest normal (5e-324 arrives from JSON) the divisor would round to 0 (0/0 = NaN)
        temperature = max(temperature, torch.finfo(torch.float32).tiny)
        ids_T_K = torch.multinomial(torch.softmax(shifted_T_V / temperature, dim=-1), k, replacement=True, generator=g)
    return ids_T_K.numpy().astype(np.int64), table_T_V.gather(1, ids_T_K).numpy().astype(np.float32)


def _from_position(first: int):
    """A function that blanks (None) a per-prompt-position list before `first` (prompt_logprobs_last_n)."""
    return lambda rows: None if rows is None else [None] * first + list(rows[first:])
