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

from twinkle.serve.backend.adapter_state import adam_state_tensors, load_adapter_state
from twinkle.serve.backend.sampling import TorchSampling
from twinkle.serve.backend.validate import check_datums, make_loss
from twinkle.serve.backend.base import (AdamParams, Backend, Datum, ForwardResult, LoraSpec, UserError)

log = logging.getLogger("twinkle.serve")

LORA_ALPHA = 32  # Tinker does not expose alpha; a fixed alpha keeps lr meaningful across ranks


class PeftBackend(TorchSampling, Backend):
    def __init__(self, base_model: str, model_path: str, *, dtype: str = "float32", max_batch_size: int = 64,
                 trust_remote_code: bool = False):
        from transformers import AutoModelForCausalLM

        self.base_model, self.tokenizer_path = base_model, model_path
        torch_dtype = getattr(torch, dtype)
        self._base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype,
                                                          trust_remote_code=trust_remote_code).eval()
        self.base_module = self._base  # for the adapter memory estimate (twinkle.serve.adapter_memory)
        for p in self._base.parameters():
            p.requires_grad_(False)
        self.vocab_size = self._base.get_input_embeddings().weight.shape[0]
        self.max_context = int(getattr(self._base.config, "max_position_embeddings", 4096))
        self._peft = None  # PeftModel, created with the first adapter
        self._specs: dict[str, LoraSpec] = {}
        self._optims: dict[str, torch.optim.AdamW] = {}
        self._init_sampler(model_path, torch_dtype, max_batch_size, trust_remote_code=trust_remote_code)

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
        check_datums(data, loss_fn, self.vocab_size, self.max_context)
        B, T = len(data), max(len(d.tokens) for d in data)
        ids = torch.zeros((B, T), dtype=torch.long)
        mask = torch.zeros((B, T), dtype=torch.long)
        targets = torch.full((B, T), -100, dtype=torch.long)
        fields: dict[str, torch.Tensor] = {}
        for i, d in enumerate(data):
            n = len(d.tokens)
            ids[i, :n], mask[i, :n] = torch.as_tensor(d.tokens, dtype=torch.long), 1
            targets[i, :n] = torch.from_numpy(d.inputs["target_tokens"].astype(np.int64).reshape(-1))
            for key, arr in d.inputs.items():
                if key != "target_tokens":
                    buf = fields.setdefault(key, torch.zeros((B, T), dtype=torch.float32))
                    buf[i, :n] = torch.from_numpy(arr.astype(np.float32).reshape(-1))
        return ids, mask, targets, fields

    def forward_backward(self, name, data, loss_fn, loss_config, forward_only) -> ForwardResult:
        from twinkle.loss import LossContext

        loss = make_loss(loss_fn, loss_config)
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
        return adam_state_tensors(self._optims[name], self._adapter_params(name))

    def load_adapter_tensors(self, name, weights, optimizer):
        # the optimizer is only touched when there are moments to restore
        load_adapter_state(self._adapter_params(name), weights, optimizer,
                           self._optims[name] if optimizer else None)
