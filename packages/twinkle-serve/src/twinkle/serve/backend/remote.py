"""The multi-LoRA backend with its training model and sampler as twinkle.mesh remote groups.

`TrainShard` and `SamplerShard` (twinkle.serve.backend.shards) are built local or remote alike, and
`RemoteBackend` calls them the same way in both cases; Ray, placement and the RPC are twinkle-mesh's.
Both APIs' passes run here as the engine's rows, and the native API's adapter operations.

A rank that dies (kill -9, out of memory, a lost node) fails the request in flight with an error
naming the rank, its pid and node; so does one that stops answering (SIGSTOP, a hang) once the
config's `ray.call_timeout_s` passes. The group is then rebuilt at once; the adapters it held are gone
(their tenants resume from their last checkpoint, which the server's store still has) and every
later request for one of them says so, instead of "not found".
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import time

from twinkle.mesh import WorkerDied
from twinkle.serve.backend.base import AdamParams, Backend, LoraSpec, UserError
from twinkle.serve.backend.shards import SamplerShard, TrainShard, read_files, write_files

log = logging.getLogger("twinkle.serve")


class GroupRebuilt(RuntimeError):
    """A rank of a remote group died during this request; the group was rebuilt without its state.

    A server fault the tenant must act on (resume from a checkpoint), so its future says it whole."""

    @property
    def client_message(self) -> str:
        return str(self)


def _raise_user_error(value):
    if isinstance(value, UserError):
        raise UserError(str(value))
    return value


class RemoteBackend(Backend):
    """The `multi_lora` backend over a TrainShard and a SamplerShard, each local or a remote group.

    With training in this process (no `remote_group`: only sampling is remote) the local shard's base
    model is `base_module`; with training on a remote group the engine lives on the actors and
    `base_module` is None. Either way both APIs drive it through the Backend operations."""

    runs_on_remote_groups = True

    def __init__(
        self,
        base_model: str,
        model_path: str,
        *,
        dtype: str = "auto",
        max_batch_size: int = 64,
        remote_group: str | None = None,
        sampler_remote_group: str | None = None,
        shard_model_path: str | None = None,
        trust_remote_code: bool = False,
        call_timeout_s: float | None = None,
        activation_checkpointing: bool = False,
    ):
        from transformers import AutoTokenizer

        from twinkle.mesh.ray_group import RemoteGroup

        self.base_model, self.tokenizer_path = base_model, model_path
        # the operator's trust_remote_code travels to every rank with the other construction options
        # remote_group= is the keyword RemoteClass (the shards' metaclass) adds to their construction
        self.trainer = TrainShard(
            base_model,
            shard_model_path,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            activation_checkpointing=activation_checkpointing,
            remote_group=remote_group,
        )
        self.samplers = SamplerShard(
            base_model,
            shard_model_path,
            dtype=dtype,
            max_batch_size=max_batch_size,
            trust_remote_code=trust_remote_code,
            remote_group=sampler_remote_group,
        )
        for part in (self.trainer, self.samplers):  # a frozen rank fails the call like a dead one
            if isinstance(part, RemoteGroup):
                part.remote_call_timeout_s = call_timeout_s
        if remote_group is None:  # a local shard: its engine and base model are in this process
            self.base_module = self.trainer.base_module
        info = self.trainer.describe()
        self.vocab_size, self.max_context = info["vocab_size"], info["max_context"]
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self._adapters: dict[str, int] = {}  # adapter -> LoRA rank
        self._lost: dict[str, str] = {}  # adapter -> why it is gone (its group was rebuilt)
        self._sampler_names: set[str] = set()
        self._route = itertools.count()

    # ---- calls into the groups: a dead rank rebuilds its group ---------------------------------------
    def _train(self, method: str, *args, **kwargs):
        try:
            return _raise_user_error(getattr(self.trainer, method)(*args, **kwargs))
        except WorkerDied as e:
            lost = sorted(self._adapters)
            why = f"{e}; the group was rebuilt and the adapters it held are gone: resume from the last checkpoint"
            self._lost.update({name: why for name in lost})
            self._adapters.clear()
            log.error("%s (%d adapters lost); rebuilding", e, len(lost))
            started = time.monotonic()
            self.trainer.remote_rebuild()  # ty: ignore[missing-union-attribute] - only a RemoteGroup raises WorkerDied
            log.warning("remote group rebuilt in %.1f s", time.monotonic() - started)
            raise GroupRebuilt(why) from None

    def _sample(self, method: str, *args, **kwargs):
        try:
            return _raise_user_error(getattr(self.samplers, method)(*args, **kwargs))
        except WorkerDied as e:
            self._sampler_names.clear()
            log.error("%s; rebuilding the sampler group", e)
            self.samplers.remote_rebuild()  # ty: ignore[missing-union-attribute] - only a RemoteGroup raises WorkerDied
            raise GroupRebuilt(f"{e}; the sampler group was rebuilt: save weights for a sampler again") from None

    def _check(self, name: str) -> None:
        if name not in self._adapters:
            raise UserError(self._lost.get(name, f"model adapter {name!r} is not loaded on this server"))

    def _known(self, name: str, rank: int) -> None:
        self._adapters[name] = rank
        self._lost.pop(name, None)

    # ---- adapters ----------------------------------------------------------------------------------
    def create_adapter(self, name: str, spec: LoraSpec) -> None:
        if spec.seed is None:  # drawn here, so every rank initialises the same LoRA
            spec = dataclasses.replace(spec, seed=random.randrange(2**31 - 1))
        self._train("create_adapter", name, spec)
        self._known(name, spec.rank)

    def remove_adapter(self, name: str) -> None:
        self._lost.pop(name, None)
        if self._adapters.pop(name, None) is not None:
            self._train("remove_adapter", name)

    def add_lora(self, name, config, gradient_accumulation_steps, seed):
        if seed is None:  # drawn here, so every rank initialises the same LoRA
            seed = random.randrange(2**31 - 1)
        self._known(name, self._train("add_lora", name, config, gradient_accumulation_steps, seed))
        return self._adapters[name]

    def adapter_rank(self, name):
        return self._adapters.get(name)

    def configure_adapter(self, name, what, component, kwargs, is_training=True):
        self._check(name)
        self._train("configure_adapter", name, what, component, kwargs, is_training)

    def clip_grad_and_step(self, name, max_grad_norm, *, gradient_accumulation_steps=None):
        self._check(name)
        return self._train(
            "clip_grad_and_step", name, max_grad_norm, gradient_accumulation_steps=gradient_accumulation_steps
        )

    def calculate_metric(self, name, is_training):
        self._check(name)
        return self._train("calculate_metric", name, is_training)

    # ---- training ----------------------------------------------------------------------------------
    def forward_backward_many(self, passes) -> list:
        """An unknown adapter is answered here, before any rank sees its pass (so none trains on part of
        one); the rows arrive checked by the API layer that made them."""
        results: list = [None] * len(passes)
        valid = []
        for i, item in enumerate(passes):
            try:
                self._check(item.adapter)
                valid.append(i)
            except UserError as e:
                results[i] = e
        if valid:
            out = self._train("forward_backward_many", [passes[i] for i in valid])
            for i, r in zip(valid, out):
                results[i] = UserError(str(r)) if isinstance(r, UserError) else r
        return results

    def optim_step(self, name: str, params: AdamParams) -> dict[str, float]:
        self._check(name)
        return self._train("optim_step", name, params)

    # ---- state -------------------------------------------------------------------------------------
    def adapter_tensors(self, name):
        self._check(name)
        return self._train("adapter_tensors", name)

    def save_checkpoint(self, name, folder, training_state):
        self._check(name)
        write_files(self._train("checkpoint_files", name, training_state), folder)

    def load_checkpoint(self, name, folder, training_state, implicit_adam=False):
        counters = self._train("load_checkpoint_files", name, read_files(folder), training_state, implicit_adam)
        # built from the folder's config when it was new
        self._known(name, self._train("adapter_rank", name))
        return counters

    # ---- samplers: weights travel as tensors, so no rank needs the server's disk ---------------------
    def install_sampler_from_adapter(self, sampler, adapter):
        # a snapshot: an in-process shard hands out its live tensors, so copy before installing
        self._sample("set_adapter", sampler, self.adapter_tensors(adapter).clone())
        self._sampler_names.add(sampler)

    def install_sampler_from_folder(self, sampler, folder):
        from twinkle.sampler import load_adapter_folder

        if sampler not in self._sampler_names:
            self._sample("set_adapter", sampler, load_adapter_folder(folder))
            self._sampler_names.add(sampler)

    def remove_sampler(self, sampler):
        if sampler in self._sampler_names:
            self._sample("remove_sampler", sampler)
            self._sampler_names.discard(sampler)

    def sample(
        self,
        sampler,
        prompt,
        params,
        *,
        on_tokens=None,  # noqa: ARG002 - the contract's; a rank's decode steps do not reach this process
        images=None,
        cache_namespace=None,
    ):
        """Backend.sample on a sampler rank: `images` (numpy arrays) travel to it as they are, the
        prefix cache of `cache_namespace` is that rank's. `on_tokens` is never called: a step's tokens
        stay on the rank, and a stream gets the whole answer at its end."""
        self._installed(sampler)
        extra = {"images": images} if images is not None else {}
        if cache_namespace is not None:
            extra["cache_namespace"] = cache_namespace
        return self._sample("sample_one", sampler, prompt, params, route=next(self._route), **extra)

    def reduce_prompt_table(self, sampler, prompt, reduce, *, images=None):
        """On one sampler rank: the table stays there, `reduce`'s answer comes back."""
        self._installed(sampler)
        return self._sample("reduce_prompt_table_one", sampler, prompt, reduce, route=next(self._route), images=images)

    def _installed(self, sampler) -> None:
        if sampler is not None and sampler not in self._sampler_names:
            raise UserError("this sampler's weights are gone (the server restarted); save weights for it again")

    def close(self) -> None:
        """Stop the remote groups' actors (local shards have none)."""
        from twinkle.mesh.ray_group import RemoteGroup

        for part in (self.trainer, self.samplers):
            if isinstance(part, RemoteGroup):
                part.remote_shutdown()
