"""The multi-LoRA backend with its training model and sampler as twinkle.mesh remote groups.

`TrainShard` (the training model) and `SamplerShard` (the sampler) are `@remote_class`es: built with
`remote_group='name'` after `twinkle.mesh.initialize(mode='ray', ...)` they are Ray actor groups, built
with `remote_group=None` they are plain objects in this process, and `RemoteBackend` calls them the
same way in both cases. Ray, placement and the RPC are twinkle-mesh's; this module only says how each
call fans out (`@remote_method`) and what the ranks do so that the result equals one process:

- forward_backward: each data rank gets its contiguous slice of every request's datums. Losses are
  token sums, so the full batch's gradient is the sum of the ranks' gradients; `optim_step`
  all-reduces (sums) them first, then every rank takes the same AdamW step and the replicas stay equal.
- a request fails on every rank or on none: the driver validates datums before dispatch, and a
  non-finite loss on any rank restores every rank's gradients from before the pass.
- sampling: each request runs on one rank of the sampler group (round robin); adapters are
  installed on every rank.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from twinkle.mesh import remote_class, remote_method
from twinkle.mesh.device_mesh import split_bounds
from twinkle.serve.backend.base import AdamParams, Backend, DatumsPass, ForwardResult, LoraSpec, UserError
from twinkle.serve.backend.multi_lora_backend import MultiLoraBackend
from twinkle.serve.backend.sampling import TorchSampling
from twinkle.serve.backend.validate import check_datums, make_loss


class PeerFailed(UserError):
    """This rank's part was fine but another data rank's failed, so the whole request failed."""


def _returns_user_errors(fn):
    """Answer a UserError as a value: the driver re-raises it as the user's error (a raised one would
    come back as a RemoteError, a server error)."""
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            return e

    run.__name__, run.__doc__ = fn.__name__, fn.__doc__
    return run


def _raise_user_error(value):
    if isinstance(value, UserError):
        raise UserError(str(value))
    return value


def _read_files(folder) -> dict[str, bytes]:
    return {str(f.relative_to(folder)): f.read_bytes() for f in Path(folder).rglob("*") if f.is_file()}


def _write_files(files: dict[str, bytes], folder) -> None:
    for relative, data in files.items():
        (Path(folder) / relative).parent.mkdir(parents=True, exist_ok=True)
        (Path(folder) / relative).write_bytes(data)


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _group_device() -> str | None:
    """'cuda' on a rank of a cuda DeviceGroup (Ray gave the actor its GPU); else the default (CPU)."""
    from twinkle.mesh import get_global_mesh

    return "cuda" if get_global_mesh().device_type == "cuda" else None


# -- forward_backward fan-out / fan-in ------------------------------------------------------------
def _slice_items(args, kwargs, mesh, rank):
    """Rank `rank` gets its data rank's contiguous slice of every request's datums."""
    (items,) = args
    data_rank, parts = mesh.get_rank("data", rank), mesh.data_world_size
    cut = []
    for item in items:
        start, stop = split_bounds(len(item.data), parts, data_rank)
        cut.append(dataclasses.replace(item, data=item.data[start:stop]))
    return (cut,), kwargs


def merge_rank_results(per_rank: list[dict]) -> list:
    """Per request: the first real error, else logprobs in datum order, `:sum` metrics summed and the
    rest averaged over tokens."""
    merged = []
    for i in range(len(per_rank[0]["results"])):
        parts = [(r["results"][i], r["tokens"][i]) for r in per_rank]
        errors = [x for x, _ in parts if isinstance(x, Exception)]
        if errors:
            merged.append(next((e for e in errors if not isinstance(e, PeerFailed)), errors[0]))
            continue
        done = [(x, n) for x, n in parts if x is not None]  # ranks with an empty slice did nothing
        total = sum(n for _, n in done)
        metrics = {}
        for key in done[0][0].metrics:
            values = [(x.metrics[key], n) for x, n in done]
            metrics[key] = (sum(v for v, _ in values) if key.endswith(":sum")
                            else sum(v * n for v, n in values) / total)
        merged.append(ForwardResult([lp for x, _ in done for lp in x.logprobs], metrics))
    return merged


@remote_class
class TrainShard(MultiLoraBackend):
    """One data-parallel rank of the training model (MultiLoraModel, no sampler of its own)."""

    def __init__(self, base_model: str, model_path: str | None, *, dtype: str = "float32",
                 trust_remote_code: bool = False):
        if model_path is None:  # resolved on this rank's node, as a hub id is
            from twinkle.hub import resolve_model_path

            model_path = str(resolve_model_path(base_model))
        super().__init__(base_model, model_path, dtype=dtype, device=_group_device(),
                         trust_remote_code=trust_remote_code)

    def _init_sampler(self, *args, **kwargs) -> None:
        pass  # sampling is the SamplerShard's

    def describe(self) -> dict:
        return {"vocab_size": self.vocab_size, "max_context": self.max_context}

    create_adapter = _returns_user_errors(MultiLoraBackend.create_adapter)
    remove_adapter = _returns_user_errors(MultiLoraBackend.remove_adapter)

    # Tensors cross to the server on the CPU (it may have no GPU).
    @_returns_user_errors
    def adapter_tensors(self, name):
        return super().adapter_tensors(name).to(device="cpu")

    # Checkpoints cross as the folder's files, so no rank needs the server's disk; the ranks are
    # replicas, so rank 0's files are everyone's.
    @_returns_user_errors
    def checkpoint_files(self, name: str, training_state: bool) -> dict[str, bytes]:
        with tempfile.TemporaryDirectory() as folder:
            super().save_checkpoint(name, folder, training_state)
            return _read_files(folder)

    @_returns_user_errors
    def load_checkpoint_files(self, name: str, files: dict[str, bytes], training_state: bool, implicit_adam: bool) -> dict:
        with tempfile.TemporaryDirectory() as folder:
            _write_files(files, folder)
            return super().load_checkpoint(name, folder, training_state, implicit_adam)

    @remote_method(dispatch=_slice_items, collect=merge_rank_results)
    def forward_backward_many(self, items) -> dict:
        saved = {it.adapter: [None if p.grad is None else p.grad.clone() for p in self.engine.adapters[it.adapter].params]
                 for it in items if not it.forward_only and it.adapter in self.engine.adapters}
        results: list = [None] * len(items)
        live = [i for i, item in enumerate(items) if item.data]
        if live:
            try:
                for i, r in zip(live, super().forward_backward_many([items[i] for i in live])):
                    results[i] = r
            except Exception as e:  # noqa: BLE001 - every rank must still reach the collective below
                for i in live:
                    results[i] = e
        ok = torch.tensor([0.0 if isinstance(r, Exception) else 1.0 for r in results], device=self.engine.device)
        if _world() > 1:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        for i, item in enumerate(items):
            if ok[i] == 0:
                for p, grad in zip(self.engine.adapters[item.adapter].params, saved.get(item.adapter, ())):
                    p.grad = grad  # as if the request never ran, on every rank
                if not isinstance(results[i], Exception):
                    results[i] = PeerFailed("the request failed on another data-parallel rank")
        return {"results": results, "tokens": [sum(len(d.tokens) for d in item.data) for item in items]}

    @_returns_user_errors
    def optim_step(self, name: str, params: AdamParams) -> dict[str, float]:
        state = self._state(name)
        if _world() > 1:  # sum the ranks' gradients: the gradient of the whole batch's summed loss
            has = torch.tensor([float(any(p.grad is not None for p in state.params))], device=self.engine.device)
            dist.all_reduce(has, op=dist.ReduceOp.MAX)
            if has.item():
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in state.params]
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat)
                for p, chunk in zip(state.params, flat.split([p.numel() for p in state.params])):
                    p.grad = chunk.view_as(p).clone()
        return super().optim_step(name, params)


def _one_rank(args, kwargs, mesh, rank):
    """The request goes to rank `route % world`; the other ranks get an empty call and answer None."""
    if kwargs.get("route", 0) % mesh.world_size == rank:
        return args, kwargs
    return (), {"route": -1}


@remote_class
class SamplerShard(TorchSampling):
    """One replica of the sampler (TorchSampler on its own copy of the base weights)."""

    def __init__(self, base_model: str, model_path: str | None, *, dtype: str = "float32",
                 max_batch_size: int = 64, trust_remote_code: bool = False):
        from transformers import AutoConfig

        if model_path is None:
            from twinkle.hub import resolve_model_path

            model_path = str(resolve_model_path(base_model))
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.vocab_size = config.vocab_size
        self.max_context = int(getattr(config, "max_position_embeddings", 4096))
        self._init_sampler(model_path, getattr(torch, dtype), max_batch_size, device=_group_device(),
                           trust_remote_code=trust_remote_code)

    def set_adapter(self, name: str, weights) -> None:
        self.sampler.set_adapter(name, weights)

    @remote_method(dispatch=_one_rank, collect=lambda results: next(r for r in results if r is not None))
    def sample_one(self, *args, route: int = 0):
        if route < 0:
            return None
        return _returns_user_errors(self.sample)(*args)


class RemoteBackend(Backend):
    """The `multi_lora` backend over a TrainShard and a SamplerShard, each local or a remote group.

    With training in this process (no `remote_group`: only sampling is remote) the local shard's
    MultiLoraModel is `multi_lora`, so the native API drives it as on the plain backend. With training
    on a remote group the engine lives on the actors: `multi_lora` is None, and the native API (which
    drives the engine's full surface in process) refuses it by name while the Tinker API serves it."""

    def __init__(self, base_model: str, model_path: str, *, dtype: str = "float32", max_batch_size: int = 64,
                 remote_group: str | None = None, sampler_remote_group: str | None = None,
                 shard_model_path: str | None = None, trust_remote_code: bool = False):
        from transformers import AutoTokenizer

        self.base_model, self.tokenizer_path = base_model, model_path
        # the operator's trust_remote_code travels to every rank with the other construction options
        self.trainer = TrainShard(base_model, shard_model_path, dtype=dtype, trust_remote_code=trust_remote_code,
                                  remote_group=remote_group)
        self.samplers = SamplerShard(base_model, shard_model_path, dtype=dtype, max_batch_size=max_batch_size,
                                     trust_remote_code=trust_remote_code, remote_group=sampler_remote_group)
        if remote_group is None:  # a local shard: its engine and base model are in this process
            self.multi_lora, self.base_module = self.trainer.engine, self.trainer.base_module
        info = self.trainer.describe()
        self.vocab_size, self.max_context = info["vocab_size"], info["max_context"]
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self._adapters: set[str] = set()
        self._sampler_names: set[str] = set()
        self._route = itertools.count()

    # ---- adapters ----------------------------------------------------------------------------------
    def create_adapter(self, name: str, spec: LoraSpec) -> None:
        if spec.seed is None:  # drawn here, so every rank initialises the same LoRA
            spec = dataclasses.replace(spec, seed=random.randrange(2**31 - 1))
        _raise_user_error(self.trainer.create_adapter(name, spec))
        self._adapters.add(name)

    def remove_adapter(self, name: str) -> None:
        _raise_user_error(self.trainer.remove_adapter(name))
        self._adapters.discard(name)

    # ---- training ----------------------------------------------------------------------------------
    def forward_backward_many(self, items) -> list:
        """Bad requests are answered here, before any rank sees them (so none trains on part of one)."""
        if self.multi_lora is not None and not all(isinstance(item, DatumsPass) for item in items):
            # native rows with training in this process: the local shard runs them as the plain backend does
            return MultiLoraBackend.forward_backward_many(self.trainer, items)
        results: list = [None] * len(items)
        valid = []
        for i, item in enumerate(items):
            try:
                if not isinstance(item, DatumsPass):
                    raise UserError("this base model trains on Ray remote groups, which take Tinker datums only")
                if item.adapter not in self._adapters:
                    raise UserError(f"model adapter {item.adapter!r} is not loaded on this server")
                check_datums(item.data, item.loss_fn, self.vocab_size, self.max_context)
                make_loss(item.loss_fn, item.loss_config)
                valid.append(i)
            except UserError as e:
                results[i] = e
        if valid:
            out = self.trainer.forward_backward_many([items[i] for i in valid])
            if isinstance(out, dict):  # a local shard: one rank's answer, not yet collected
                out = merge_rank_results([out])
            for i, r in zip(valid, out):
                results[i] = UserError(str(r)) if isinstance(r, UserError) else r
        return results

    def optim_step(self, name: str, params: AdamParams) -> dict[str, float]:
        return _raise_user_error(self.trainer.optim_step(name, params))

    # ---- state -------------------------------------------------------------------------------------
    def adapter_tensors(self, name):
        return _raise_user_error(self.trainer.adapter_tensors(name))

    def save_checkpoint(self, name, folder, training_state):
        _write_files(_raise_user_error(self.trainer.checkpoint_files(name, training_state)), folder)

    def load_checkpoint(self, name, folder, training_state, implicit_adam=False):
        counters = _raise_user_error(self.trainer.load_checkpoint_files(name, _read_files(folder), training_state,
                                                                        implicit_adam))
        self._adapters.add(name)  # built from the folder's config when it was new
        return counters

    # ---- samplers: weights travel as tensors, so no rank needs the server's disk ---------------------
    def install_sampler_from_adapter(self, sampler, adapter):
        # a snapshot: an in-process shard hands out its live tensors, so copy before installing
        self.samplers.set_adapter(sampler, self.adapter_tensors(adapter).clone())
        self._sampler_names.add(sampler)

    def install_sampler_from_folder(self, sampler, folder):
        from twinkle.sampler import load_adapter_folder

        if sampler not in self._sampler_names:
            self.samplers.set_adapter(sampler, load_adapter_folder(folder))
            self._sampler_names.add(sampler)

    def remove_sampler(self, sampler):
        if sampler in self._sampler_names:
            self.samplers.remove_sampler(sampler)
            self._sampler_names.discard(sampler)

    def sample(self, sampler, prompt, num_samples, params, prompt_logprobs):
        if sampler is not None and sampler not in self._sampler_names:
            raise UserError("this sampler's weights are gone (the server restarted); save weights for it again")
        return _raise_user_error(self.samplers.sample_one(sampler, prompt, num_samples, params, prompt_logprobs,
                                                          route=next(self._route)))

    def close(self) -> None:
        """Stop the remote groups' actors (local shards have none)."""
        from twinkle.mesh.ray_group import RemoteGroup

        for part in (self.trainer, self.samplers):
            if isinstance(part, RemoteGroup):
                part.remote_shutdown()
