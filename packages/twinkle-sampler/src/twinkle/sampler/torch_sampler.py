"""TorchSampler: batched decoding with a KV cache on any transformers causal LM, on any device.

Prompts are left-padded into one batch (position ids follow the attention mask, as in HF
`generate`), prefilled once, then decoded one token per step against the cache. Finished rows leave
the batch (the cache drops them), so long and short answers do not pay for each other. Each row may
use its own LoRA adapter (see routing.py); each sequence draws from its own seeded generator.
A prefix cache (prefix_cache.py, prefill.py) keeps prefilled KV per (adapter, weights, namespace,
tokens): `sample` and `compute_logprobs` prefill only what no earlier call of either in the same
`cache_namespace` already did.
"""

from __future__ import annotations

import inspect

import torch

from twinkle.model import preemption
from twinkle.model.structure import decoder_layer_list
from twinkle.sampler import decode_attention, kv_room, prefill, vision
from twinkle.sampler.adapters import AdapterWeights
from twinkle.sampler.base import Prompt, Sampler, prompt_items
from twinkle.sampler.decoding import OnTokens, StepToken, StopChecker, choose_tokens, row_seed
from twinkle.sampler.params import SampledSequence, SampleResponse, SamplingParams, StopReason
from twinkle.sampler.prefix_cache import PrefixCache, PrefixCacheStats
from twinkle.sampler.routing import LoRARouter
from twinkle.sampler.step_threads import StepThreads, StepTimes

# Default prefix-cache budget, as a fraction of the model's weight bytes: room for many prompts' KV
# on a small model without rivalling the weights themselves for device memory.
PREFIX_CACHE_FRACTION = 0.2
# A half-precision model decodes on a float32 copy of its KV cache (decode_attention.py: sdpa's bf16 kernel
# is several times slower for one-query rows) while that copy stays under this fraction of the weights'
# bytes; a longer decode keeps its cache in the model's dtype (and bf16 attention), not twice the memory.
FLOAT32_KV_FRACTION = 0.5


class TorchSampler(Sampler):
    """`TorchSampler(model_id)` or `TorchSampler(model=hf_causal_lm, tokenizer=...)`.

    `prefix_cache_bytes`: the prefix cache's budget in bytes (None: PREFIX_CACHE_FRACTION of the
    weights; 0: no prefix cache, every call prefills in full as before)."""

    def __init__(
        self,
        model_id: str | None = None,
        *,
        model=None,
        tokenizer=None,
        template=None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        max_batch_size: int = 64,
        prefix_cache_bytes: int | None = None,
    ):
        from transformers import AutoTokenizer

        from twinkle.model.vision import load_pretrained

        if (model_id is None) == (model is None):
            raise ValueError("TorchSampler needs exactly one of model_id= or model=")
        if model is None:
            assert model_id is not None  # exactly one of the two, checked above
            from twinkle.hub import resolve_model_path

            path = resolve_model_path(model_id)
            model = load_pretrained(path, dtype=dtype or torch.float32)  # a causal LM or a vision-language model
            if tokenizer is None and template is None:
                tokenizer = AutoTokenizer.from_pretrained(path)
        if hasattr(model, "peft_config"):
            raise TypeError(
                "TorchSampler wants the plain base model; serve peft adapters with "
                "set_adapter / add_adapter_from_model instead of passing a PeftModel"
            )
        super().__init__(tokenizer=tokenizer, template=template)
        self.model_id = model_id
        self.model = model.eval()
        if device is not None:
            self.model.to(device)
        if dtype is not None:
            self.model.to(dtype)
        self.device = next(self.model.parameters()).device
        self.max_batch_size = max_batch_size
        self.router = LoRARouter(self.model)
        preemption.enable(self.model, decoder_layer_list(self.model))  # a long prefill may pause (served)
        self.float32_decode = decode_attention.enable(self.model)
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        pad = getattr(gen, "pad_token_id", None)
        if pad is None:
            pad = getattr(self.tokenizer, "pad_token_id", None)
        self.pad_token_id = pad if pad is not None else (self.eos_token_ids or [0])[0]
        # transformers renamed `past_key_values` to `cache` (5.x); speak whichever this model takes.
        params = inspect.signature(self.model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        # Collected before any LoRA wrapping: their version counters fingerprint the base weights.
        self._base_params = list(self.model.parameters())
        if prefix_cache_bytes is None:
            weight_bytes = sum(p.numel() * p.element_size() for p in self._base_params)
            prefix_cache_bytes = int(PREFIX_CACHE_FRACTION * weight_bytes)
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        # None: learnt at the first store, from the cache's layers (prefill.py)
        self.kv_cacheable: bool | None = None if prefill.full_attention_only(self.model.config) else False
        self.head_ok: bool | None = None
        self.step_times = StepTimes()  # decode steps' times per thread count, across decodes (step_threads.py)
        self._adapter_tensors: dict[str, list[torch.Tensor]] = {}

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """hits, misses, tokens_reused, bytes_held, entries, evictions, invalidations, budget_bytes."""
        return self.prefix_cache.stats()

    def cache_key(self, adapter: str | None, namespace: str | None = None) -> tuple:
        """What the KV of a prefix under `adapter` depends on besides its tokens (and whose KV it may
        reuse: only its `namespace`'s). The weight version
        alone is not enough: an in-process sync shares storage with the trainer, so an optimizer step
        changes the served weights in place without a new version. Every in-place write bumps a
        tensor's version counter, so their sum moves with the weights (a re-install, whose new tensors
        could repeat the sum, drops the adapter's entries explicitly)."""
        tensors = self._base_params + (self._adapter_tensors[adapter] if adapter is not None else [])
        return adapter, (self.weight_version(adapter), sum(_tensor_version(t) for t in tensors)), namespace

    # ---- adapters --------------------------------------------------------------------------------
    def _install_adapter(self, name: str, weights: AdapterWeights) -> None:
        # `.to` is a no-op (same storage) when device and dtype already match: in-process syncs share memory.
        weights = weights.to(device=self.device)
        self.prefix_cache.drop_adapter(name)  # new weights, even under an old version number
        self.router.set_adapter(name, weights)
        # what the router serves shares these tensors' storage and version counters (experts included)
        self._adapter_tensors[name] = [*weights.lora_A.values(), *weights.lora_B.values()]

    def _uninstall_adapter(self, name: str) -> None:
        self.router.remove_adapter(name)
        self._adapter_tensors.pop(name, None)
        self.prefix_cache.drop_adapter(name)

    def _decode_kv_dtype(self, cache, tokens: int) -> torch.dtype | None:
        """float32 for a half-precision model's decode cache where decode_attention runs and the copy
        fits FLOAT32_KV_FRACTION of the weights; None (the cache's own dtype) otherwise."""
        layers = getattr(cache, "layers", None) or []
        keys = getattr(layers[0], "keys", None) if layers else None
        if not self.float32_decode or keys is None or keys.dtype not in (torch.bfloat16, torch.float16):
            return None
        weight_bytes = sum(p.numel() * p.element_size() for p in self._base_params)
        return torch.float32 if kv_room.float32_bytes(cache, tokens) <= FLOAT32_KV_FRACTION * weight_bytes else None

    # ---- forward pieces --------------------------------------------------------------------------
    def left_pad(self, prompts: list[Prompt]):
        width = max(len(p) for p in prompts)
        ids_B_T = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask_B_T = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids_B_T[i, width - len(p) :] = torch.tensor(p)
            mask_B_T[i, width - len(p) :] = 1
        return ids_B_T.to(self.device), mask_B_T.to(self.device)

    @staticmethod
    def token_logprobs(logits_B_T_V, ids_B_T, mask_B_T, top_k: int = 0) -> tuple[list, list | None]:
        """(log p(token_t | tokens_<t) per row, first None; with top_k > 0 each position's k most likely
        (id, log-prob) pairs per row, most likely first, first None, else None). Rows are left-padded."""
        logp_B_T_V = torch.log_softmax(logits_B_T_V[:, :-1].float(), dim=-1)
        logp_B_T = logp_B_T_V.gather(-1, ids_B_T[:, 1:, None]).squeeze(-1)
        top = logp_B_T_V.topk(min(top_k, logp_B_T_V.shape[-1]), dim=-1) if top_k else None
        lps, tops = [], []
        for i in range(ids_B_T.shape[0]):
            start = int((mask_B_T[i] == 0).sum())  # left padding
            lps.append([None, *logp_B_T[i, start:].tolist()])
            if top is not None:
                tops.append(
                    [None]
                    + [
                        list(zip(ids, vals))
                        for ids, vals in zip(top.indices[i, start:].tolist(), top.values[i, start:].tolist())
                    ]
                )
        return lps, tops if top_k else None

    def _prefill_chunks(self, inputs, adapter_name, images=None):
        """(prompts of a chunk, their logits [B, T, V], ids, mask) per max_batch_size chunk: no cache."""
        prompts = self._normalize_inputs(inputs)
        adapters = self._normalize_adapters(adapter_name, len(prompts))
        images = self._normalize_images(inputs, images, len(prompts))
        for lo in range(0, len(prompts), self.max_batch_size):
            chunk, chunk_adapters = prompts[lo : lo + self.max_batch_size], adapters[lo : lo + self.max_batch_size]
            ids_B_T, mask_B_T = self.left_pad(chunk)
            vis = vision.prefill_inputs(self.model, ids_B_T, mask_B_T, images[lo : lo + self.max_batch_size])
            pos = vis.pop("position_ids", None)
            with self.router.route(chunk_adapters, self.device):
                logits = self.model(
                    input_ids=ids_B_T,
                    attention_mask=mask_B_T,
                    position_ids=(mask_B_T.cumsum(-1) - 1).clamp(min=0) if pos is None else pos,
                    use_cache=False,
                    **vis,
                ).logits
            yield chunk, logits, ids_B_T, mask_B_T

    @staticmethod
    def _normalize_images(inputs, images, n: int) -> list[dict | None]:
        """Per prompt its images: `images` as given (one per prompt), else what encoded rows carry."""
        if images is None:
            images = [vision.item_images(item) for item in prompt_items(inputs)]
        if len(images) != n:
            raise ValueError(f"images lists {len(images)} entries for {n} prompts")
        return list(images)

    @torch.no_grad()
    def compute_logprobs(
        self, inputs, adapter_name=None, images=None, cache_namespace: str | None = None
    ) -> list[list[float | None]]:
        result = []
        if not self.prefix_cache.enabled:
            for _, logits, ids_B_T, mask_B_T in self._prefill_chunks(inputs, adapter_name, images):
                result.extend(self.token_logprobs(logits, ids_B_T, mask_B_T)[0])
            return result
        prompts = self._normalize_inputs(inputs)
        adapters = self._normalize_adapters(adapter_name, len(prompts))
        images = self._normalize_images(inputs, images, len(prompts))
        for lo in range(0, len(prompts), self.max_batch_size):
            hi = lo + self.max_batch_size
            with self.router.route(adapters[lo:hi], self.device):
                pre = prefill.run(
                    self, prompts[lo:hi], adapters[lo:hi], images[lo:hi], all_logits=True, namespace=cache_namespace
                )
                result.extend(prefill.prompt_logprobs(self, pre)[0])
        return result

    @torch.no_grad()
    def prompt_logprob_tables(self, inputs, adapter_name=None, images=None) -> list[torch.Tensor]:
        """Per prompt, the model's log-softmax over the vocabulary at every position that predicts a prompt
        token: row t-1 is log p(. | tokens_<t), a float32 [len(prompt) - 1, V] tensor on the CPU. For
        scoring chosen ids or drawing alternatives at every prompt position (a full table: V floats a row)."""
        tables = []
        for chunk, logits, _, _ in self._prefill_chunks(inputs, adapter_name, images):
            width = logits.shape[1]
            for i, prompt in enumerate(chunk):  # left padding: a prompt's rows are the last len(prompt) ones
                rows_T_V = logits[i, width - len(prompt) : -1].float()
                tables.append(torch.log_softmax(rows_T_V, dim=-1).cpu())
        return tables

    # ---- sampling --------------------------------------------------------------------------------
    @torch.no_grad()
    def sample(
        self,
        inputs,
        sampling_params=None,
        adapter_name=None,
        on_tokens: OnTokens | None = None,
        images=None,
        cache_namespace: str | None = None,
    ) -> list[SampleResponse]:
        """`on_tokens`: called after every decode step with that step's tokens (streaming); an exception it
        raises ends the sampling there and propagates (how a stream whose reader left stops it). It may
        run other sampling on this sampler before it returns (the decode routes its rows again after).
        `images`: per prompt its {pixel_values, image_grid_thw} or None (default: what encoded rows carry).
        `cache_namespace`: the prefix cache's namespace these prompts reuse and store KV in (None: shared)."""
        params = SamplingParams.from_dict(sampling_params)
        prompts = self._normalize_inputs(inputs)
        adapters = self._normalize_adapters(adapter_name, len(prompts))
        images = self._normalize_images(inputs, images, len(prompts))
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        # One row per (prompt, sample); rows of a prompt are adjacent.
        rows = [(p, j) for p in range(len(prompts)) for j in range(params.num_samples)]
        sequences: list[SampledSequence] = []  # in row order: chunks are consecutive
        prompt_lps: dict[int, tuple] = {}
        cached: dict[int, int] = {}  # prompt -> tokens its first prefill took from the prefix cache
        n = params.num_samples
        # whole groups per chunk when they fit, so a prompt's n samples share one prefill (GRPO groups)
        step = self.max_batch_size - self.max_batch_size % n if n <= self.max_batch_size else self.max_batch_size
        for lo in range(0, len(rows), step):
            chunk = rows[lo : lo + step]
            seqs, lps, reused = self._decode(
                [prompts[p] for p, _ in chunk],
                [adapters[p] for p, _ in chunk],
                [row_seed(seed, j) for _, j in chunk],
                params,
                images=[images[p] for p, _ in chunk],
                group=n if n > 1 and step % n == 0 else 1,
                on_tokens=on_tokens,
                first_index=lo,
                namespace=cache_namespace,
            )
            sequences.extend(seqs)
            for k, (p, _) in enumerate(chunk):
                cached.setdefault(p, reused[k])
                if lps is not None:
                    prompt_lps.setdefault(p, (lps[0][k], lps[1][k] if lps[1] is not None else None))
        responses = []
        for p, prompt in enumerate(prompts):
            n = params.num_samples
            lps, tops = prompt_lps.get(p, (None, None))
            responses.append(
                SampleResponse(
                    sequences=sequences[p * n : (p + 1) * n],
                    prompt_tokens=prompt,
                    adapter_name=adapters[p],
                    weight_version=self.weight_version(adapters[p]),
                    prompt_logprobs=lps,
                    prompt_top_logprobs=tops,
                    cached_prompt_tokens=cached.get(p, 0),
                )
            )
        return responses

    def _decode(
        self,
        prompts: list[Prompt],
        adapters: list[str | None],
        seeds: list[int],
        params: SamplingParams,
        group: int = 1,
        on_tokens: OnTokens | None = None,
        first_index: int = 0,
        images: list[dict | None] | None = None,
        namespace: str | None = None,
    ) -> tuple[list[SampledSequence], tuple | None, list[int]]:
        """-> (one sequence per row, None or (prompt log-probs per row, prompt top-k per row or None),
        per row the prompt tokens its prefill took from the prefix cache of `namespace`).

        `group` > 1: rows come in runs of `group` equal (prompt, adapter) pairs; each run's prompt is
        prefilled once and its KV cache expanded to the run's rows. `on_tokens` gets each step's tokens,
        row r as sequence `first_index + r` of the response order."""
        n = len(prompts)
        stop = StopChecker(params, [] if params.ignore_eos else self.eos_token_ids, self.tokenizer)
        generators = [torch.Generator(device=self.device).manual_seed(s) for s in seeds]
        tokens = [[] for _ in range(n)]
        logps = [[] for _ in range(n)]
        tops = [[] for _ in range(n)]
        text_len = [0] * n
        reasons: list[StopReason] = ["length"] * n
        active = list(range(n))  # batch row -> original row
        prompt_lps = None
        # An unseeded decode picks its steps' thread count by timing them (step_threads.py); a seeded one
        # keeps the caller's, so that its tokens depend on its request alone, as with the prefix cache.
        threads = StepThreads(self.step_times, adaptive=params.seed is None and self.device.type == "cpu")
        with self.router.route(adapters[::group], self.device), threads:
            threads.use_faster()
            pre = prefill.run(
                self,
                prompts[::group],
                adapters[::group],
                (images or [None] * n)[::group],
                bool(params.prompt_logprobs),
                namespace,
                reuse=params.seed is None,  # a seeded sample is a function of its request alone, to the bit
            )
            cache, mask_B_T = pre.cache, pre.mask_B_T
            if params.prompt_logprobs:
                prompt_lps = prefill.prompt_logprobs(self, pre, params.prompt_top_logprobs)
                prompt_lps = tuple(
                    None if rows is None else [r for r in rows for _ in range(group)] for rows in prompt_lps
                )
            logits_B_V = pre.logits_B_S_V[:, -1].float()
            next_pos_B = vision.next_positions(pre.pos_B_S)
            if group > 1:
                cache.batch_repeat_interleave(group)
                logits_B_V, mask_B_T, next_pos_B = (
                    t.repeat_interleave(group, dim=0) for t in (logits_B_V, mask_B_T, next_pos_B)
                )
                self.router.reroute(adapters, self.device)
            kv_room.make_room(cache, params.max_tokens, self._decode_kv_dtype(cache, params.max_tokens))
            for step in range(params.max_tokens):
                logp_B_V = torch.log_softmax(logits_B_V, dim=-1)
                next_B = choose_tokens(logits_B_V, params, [generators[r] for r in active])
                chosen_lp = logp_B_V.gather(-1, next_B[:, None]).squeeze(-1).tolist()
                top = (
                    logp_B_V.topk(min(params.top_logprobs, logp_B_V.shape[-1]), dim=-1) if params.top_logprobs else None
                )
                keep = []
                for b, r in enumerate(active):
                    tok = int(next_B[b])
                    tokens[r].append(tok)
                    logps[r].append(chosen_lp[b])
                    if top is not None:
                        tops[r].append(list(zip(top.indices[b].tolist(), top.values[b].tolist())))
                    done, text_len[r] = stop(tokens[r], text_len[r])
                    if done:
                        reasons[r] = "stop"
                    else:
                        keep.append(b)
                if on_tokens is not None:
                    emitted = [(r, tops[r][-1] if top is not None else None) for r in active]
                    on_tokens([StepToken(first_index + r, tokens[r][-1], logps[r][-1], t) for r, t in emitted])
                if not keep or step == params.max_tokens - 1:
                    break
                if len(keep) < len(active):  # finished rows leave the batch and the cache
                    idx = torch.tensor(keep, device=self.device)
                    cache.batch_select_indices(idx)
                    mask_B_T, next_B, next_pos_B = mask_B_T[idx], next_B[idx], next_pos_B[idx]
                    active = [active[b] for b in keep]
                # routed again at every step: on_tokens may have let other sampling use this sampler
                # in between (a server runs long decodes in turns), and finished rows leave the batch
                self.router.reroute([adapters[r] for r in active], self.device)
                mask_B_T = torch.cat([mask_B_T, mask_B_T.new_ones((len(active), 1))], dim=1)
                with threads.step():
                    out = self.model(
                        input_ids=next_B[:, None],
                        attention_mask=mask_B_T,
                        position_ids=next_pos_B[:, None],
                        use_cache=True,
                        **{self.cache_kw: cache},
                    )
                logits_B_V = out.logits[:, -1].float()
                next_pos_B = next_pos_B + 1
        tokenizer = self.tokenizer
        seqs = [
            SampledSequence(
                tokens=tokens[r],
                logprobs=logps[r] if params.logprobs is not False else None,
                stop_reason=reasons[r],
                text=tokenizer.decode(tokens[r], skip_special_tokens=False) if tokenizer is not None else None,
                top_logprobs=tops[r] if params.top_logprobs else None,
            )
            for r in range(n)
        ]
        return seqs, prompt_lps, [k for k in pre.reused for _ in range(group)]


def _tensor_version(t: torch.Tensor) -> int:
    try:  # torch's in-place write counter, which it exposes under no public name
        return getattr(t, "_version")
    except RuntimeError:  # an inference-mode tensor keeps no version counter (and cannot be written in place)
        return 0
