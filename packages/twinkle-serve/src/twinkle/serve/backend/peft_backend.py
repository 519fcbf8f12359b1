"""The default backend: one transformers base model, one peft LoRA adapter per training model,
losses from `twinkle.loss` (by name, summed as Tinker defines them), sampling with
`twinkle.sampler.TorchSampler` on its own copy of the base weights.

Every call runs on the scheduler's single worker thread, so switching the active adapter is safe:
only the active adapter joins the graph, and each adapter's gradients accumulate in its own
parameters until its `optim_step`.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from twinkle.serve.backend.base import (AdamParams, Backend, Datum, ForwardResult, LoraSpec, SampledSeq,
                                        SampleParams, SampleResult, UserError)

log = logging.getLogger("twinkle.serve")

LORA_ALPHA = 32  # Tinker does not expose alpha; a fixed alpha keeps lr meaningful across ranks
# Losses a Tinker client may name, plus what each needs besides target_tokens.
TINKER_LOSSES = {
    "cross_entropy": (),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
    "gspo": ("logprobs", "advantages"),
}


class PeftBackend(Backend):
    def __init__(self, base_model: str, model_path: str, *, dtype: str = "float32", max_batch_size: int = 64):
        from transformers import AutoModelForCausalLM

        from twinkle.sampler import TorchSampler

        self.base_model, self.tokenizer_path = base_model, model_path
        torch_dtype = getattr(torch, dtype)
        self._base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).eval()
        for p in self._base.parameters():
            p.requires_grad_(False)
        self.vocab_size = self._base.get_input_embeddings().weight.shape[0]
        self.max_context = int(getattr(self._base.config, "max_position_embeddings", 4096))
        self._peft = None  # PeftModel, created with the first adapter
        self._specs: dict[str, LoraSpec] = {}
        self._optims: dict[str, torch.optim.AdamW] = {}
        self.sampler = TorchSampler(model_id=None, model=AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch_dtype), tokenizer=_load_tokenizer(model_path), max_batch_size=max_batch_size)

    # ---- adapters ----------------------------------------------------------------------------------
    def create_adapter(self, name: str, spec: LoraSpec) -> None:
        from peft import LoraConfig, get_peft_model

        if spec.rank < 1:
            raise UserError(f"lora rank must be >= 1, got {spec.rank}")
        config = LoraConfig(r=spec.rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                            target_modules=spec.target_modules(), bias="none")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed if spec.seed is not None else torch.seed() % 2**31)
            if self._peft is None:
                self._peft = get_peft_model(self._base, config, adapter_name=name)
            else:
                self._peft.add_adapter(name, config)
        self._specs[name] = spec
        params = self._adapter_params(name)
        for p in params.values():
            p.requires_grad_(True)
        self._optims[name] = torch.optim.AdamW(list(params.values()), lr=1e-4)

    def remove_adapter(self, name: str) -> None:
        if name in self._specs:
            self._peft.delete_adapter(name)
            del self._specs[name], self._optims[name]

    def _adapter_params(self, name: str) -> dict[str, torch.nn.Parameter]:
        """`module_path.lora_A` -> parameter, for adapter `name` (stable keys for checkpoints)."""
        if name not in self._specs:
            raise UserError(f"model {name!r} is not loaded on this server")
        out = {}
        for path, module in self._peft.base_model.model.named_modules():
            a = getattr(module, "lora_A", None)
            if isinstance(a, torch.nn.ModuleDict) and name in a:
                out[f"{path}.lora_A"] = a[name].weight
                out[f"{path}.lora_B"] = module.lora_B[name].weight
        return out

    def _activate(self, name: str) -> None:
        if name not in self._specs:
            raise UserError(f"model {name!r} is not loaded on this server")
        self._peft.base_model.set_adapter(name)
        for p in self._adapter_params(name).values():
            p.requires_grad_(True)  # set_adapter toggles requires_grad; ours must always train

    # ---- training ----------------------------------------------------------------------------------
    def _batch(self, data: list[Datum], loss_fn: str):
        if not data:
            raise UserError("forward_backward needs at least one datum")
        needed = ("target_tokens",) + TINKER_LOSSES.get(loss_fn, ())
        T = max(len(d.tokens) for d in data)
        if T == 0:
            raise UserError("every datum needs at least one token")
        if T > self.max_context:
            raise UserError(f"sequence of {T} tokens exceeds the model's context of {self.max_context}")
        B = len(data)
        ids = torch.zeros((B, T), dtype=torch.long)
        mask = torch.zeros((B, T), dtype=torch.long)
        targets = torch.full((B, T), -100, dtype=torch.long)
        fields: dict[str, torch.Tensor] = {}
        for i, d in enumerate(data):
            n = len(d.tokens)
            for key in needed:
                if key not in d.inputs:
                    raise UserError(f"datum {i}: loss {loss_fn!r} needs loss_fn_inputs[{key!r}]")
            for key, arr in d.inputs.items():
                if arr.size != n:
                    raise UserError(f"datum {i}: loss_fn_inputs[{key!r}] has {arr.size} values for a model "
                                    f"input of {n} tokens (shape mismatch)")
                if key != "target_tokens" and not np.all(np.isfinite(arr)):
                    raise UserError(f"datum {i}: loss_fn_inputs[{key!r}] contains NaN or inf")
            tok = np.asarray(d.tokens, dtype=np.int64)
            tgt = d.inputs["target_tokens"].astype(np.int64).reshape(-1)
            for label, arr in (("model_input", tok), ("target_tokens", tgt)):
                if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
                    bad = int(arr[(arr < 0) | (arr >= self.vocab_size)][0])
                    raise UserError(f"datum {i}: {label} token {bad} is outside the vocabulary [0, {self.vocab_size})")
            ids[i, :n], mask[i, :n], targets[i, :n] = torch.from_numpy(tok), 1, torch.from_numpy(tgt)
            for key, arr in d.inputs.items():
                if key == "target_tokens":
                    continue
                buf = fields.setdefault(key, torch.zeros((B, T), dtype=torch.float32))
                buf[i, :n] = torch.from_numpy(arr.astype(np.float32).reshape(-1))
        return ids, mask, targets, fields

    def forward_backward(self, name, data, loss_fn, loss_config, forward_only) -> ForwardResult:
        from twinkle.loss import LossContext, create_loss

        if loss_fn not in TINKER_LOSSES:
            raise UserError(f"unknown loss_fn {loss_fn!r}; supported: {', '.join(TINKER_LOSSES)}")
        try:
            loss = create_loss(loss_fn, reduction="sum", **loss_config)
        except (TypeError, ValueError) as e:
            raise UserError(f"bad loss_fn_config for {loss_fn!r}: {e}") from None
        ids, mask, targets, fields = self._batch(data, loss_fn)
        self._activate(name)
        fields = {k: v for k, v in fields.items() if k != "weights" or loss_fn == "cross_entropy"}
        with torch.set_grad_enabled(not forward_only):
            logits = self._peft(input_ids=ids, attention_mask=mask, use_cache=False).logits
            ctx = LossContext.from_logits(logits, targets, **fields)
            out = loss(ctx)
            if not torch.isfinite(out.loss):
                raise UserError(f"loss is {out.loss.item()} (not finite): no gradient was applied")
            if not forward_only:
                out.loss.backward()
        logps = ctx.logps_B_T.detach().float()
        lengths = mask.sum(1).tolist()
        metrics = {"loss:sum": float(out.loss.detach())}
        metrics.update({f"{k}:mean": float(v) for k, v in out.metrics.items()})
        return ForwardResult([logps[i, :n].numpy().copy() for i, n in enumerate(lengths)], metrics)

    def optim_step(self, name: str, params: AdamParams) -> dict[str, float]:
        self._activate(name)
        opt = self._optims[name]
        for group in opt.param_groups:
            group.update(lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps,
                         weight_decay=params.weight_decay)
        plist = [p for g in opt.param_groups for p in g["params"]]
        grads = [p.grad for p in plist if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else 0.0
        if not math.isfinite(norm):
            opt.zero_grad(set_to_none=True)
            raise UserError(f"gradient norm is {norm}: step skipped and gradients cleared")
        if params.grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(plist, params.grad_clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {"grad_norm:mean": norm}

    # ---- state -------------------------------------------------------------------------------------
    def adapter_tensors(self, name):
        from twinkle.sampler import extract_adapter

        return extract_adapter(self._peft, name)

    def optimizer_tensors(self, name):
        opt, out = self._optims[name], {}
        params = self._adapter_params(name)
        for key, p in params.items():
            state = opt.state.get(p)
            if state:
                out[f"{key}.exp_avg"] = state["exp_avg"].detach().clone()
                out[f"{key}.exp_avg_sq"] = state["exp_avg_sq"].detach().clone()
                out[f"{key}.step"] = torch.as_tensor(state["step"], dtype=torch.float32).reshape(1).clone()
        return out

    def load_adapter_tensors(self, name, weights, optimizer):
        params = self._adapter_params(name)
        with torch.no_grad():
            for module, a in weights.lora_A.items():
                for suffix, t in (("lora_A", a), ("lora_B", weights.lora_B[module])):
                    key = f"{module}.{suffix}"
                    if key not in params or params[key].shape != t.shape:
                        raise UserError(f"checkpoint tensor {key} {tuple(t.shape)} does not fit this model")
                    params[key].copy_(t)
        if optimizer:
            opt = self._optims[name]
            for key, p in params.items():
                if f"{key}.exp_avg" in optimizer:
                    opt.state[p] = {"step": optimizer[f"{key}.step"].reshape(()).clone(),
                                    "exp_avg": optimizer[f"{key}.exp_avg"].clone(),
                                    "exp_avg_sq": optimizer[f"{key}.exp_avg_sq"].clone()}

    # ---- sampling ----------------------------------------------------------------------------------
    def install_sampler_from_adapter(self, sampler, adapter):
        self._activate(adapter)
        self.sampler.set_adapter(sampler, self.adapter_tensors(adapter).clone())

    def install_sampler_from_folder(self, sampler, folder):
        if sampler not in self.sampler.adapter_names:
            self.sampler.load_adapter(sampler, folder)

    def remove_sampler(self, sampler):
        if sampler in self.sampler.adapter_names:
            self.sampler.remove_adapter(sampler)

    def sample(self, sampler, prompt, num_samples, params: SampleParams, prompt_logprobs) -> SampleResult:
        from twinkle.sampler import SamplingParams

        if not prompt:
            raise UserError("prompt is empty")
        if sampler is not None and sampler not in self.sampler.adapter_names:
            raise UserError("this sampler's weights are gone (the server restarted); save weights for it again")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise UserError(f"prompt token {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        max_tokens = params.max_tokens or 64
        if len(prompt) + max_tokens > self.max_context:
            raise UserError(f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds the context "
                            f"of {self.max_context}")
        try:
            sp = SamplingParams(max_tokens=max_tokens, temperature=params.temperature,
                                top_k=max(params.top_k, 0), top_p=params.top_p, seed=params.seed,
                                stop=params.stop or None, num_samples=num_samples, logprobs=True,
                                prompt_logprobs=prompt_logprobs)
        except ValueError as e:
            raise UserError(str(e)) from None
        (resp,) = self.sampler.sample([prompt], sp, adapter_name=sampler)
        seqs = [SampledSeq(s.tokens, list(s.logprobs or []), s.stop_reason) for s in resp.sequences]
        return SampleResult(seqs, resp.prompt_logprobs)


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
