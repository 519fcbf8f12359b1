"""The ranks of the remote backend: `TrainShard` (the training model) and `SamplerShard` (the sampler).

Both have `metaclass=RemoteClass`: built with `remote_group='name'` after `twinkle.mesh.initialize(mode='ray')`
they are Ray actor groups, built with `remote_group=None` plain objects in this process. They place
work; the data parallelism itself is the model layer's:

- forward_backward: each data rank gets its contiguous slice of every pass's rows (and of a custom
  loss's per-row inputs). Each actor's MultiLoraModel holds the group's DeviceMesh (an actor's global
  mesh), and runs its slice as its share of the whole pass (twinkle.model.multi_lora.data_parallel):
  a 'mean' loss weighted by its global units (`Loss.units`), one record of the whole pass, failures
  and non-finite losses agreed by every rank, gradients summed on the step's boundary. The ranks'
  answers are then the same numbers; the rows' log-probs are concatenated in row order.
- sampling: each request runs on one rank of the sampler group (round robin).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from twinkle.mesh import RemoteClass, remote_method
from twinkle.mesh.device_mesh import split_bounds
from twinkle.serve.backend.base import UserError
from twinkle.serve.backend.multi_lora_backend import MultiLoraBackend
from twinkle.serve.backend.sampling import TorchSampling


def returns_user_errors(fn):
    """Answer a UserError as a value: the driver re-raises it as the user's error (a raised one would
    come back as a RemoteError, a server error)."""

    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            return e

    run.__name__, run.__doc__ = fn.__name__, fn.__doc__
    return run


def read_files(folder) -> dict[str, bytes]:
    return {str(f.relative_to(folder)): f.read_bytes() for f in Path(folder).rglob("*") if f.is_file()}


def write_files(files: dict[str, bytes], folder) -> None:
    for relative, data in files.items():
        (Path(folder) / relative).parent.mkdir(parents=True, exist_ok=True)
        (Path(folder) / relative).write_bytes(data)


def _group_device() -> str | None:
    """'cuda' on a rank of a cuda DeviceGroup (Ray gave the actor its GPU); else the default (CPU)."""
    from twinkle.mesh import get_global_mesh

    return "cuda" if get_global_mesh().device_type == "cuda" else None


# -- forward_backward fan-out / fan-in ------------------------------------------------------------
def slice_items(args, kwargs, mesh, rank):
    """Rank `rank` gets its data rank's contiguous slice of every pass's rows; a custom loss holds
    per-row inputs, so it gets the same slice of them."""
    (items,) = args
    data_rank, parts = mesh.get_rank("data", rank), mesh.data_world_size
    cut = []
    for item in items:
        start, stop = split_bounds(len(item.rows), parts, data_rank)
        loss = item.loss.sliced(start, stop) if item.loss is not None else None
        cut.append(dataclasses.replace(item, rows=item.rows[start:stop], loss=loss))
    return (cut,), kwargs


def merge_rank_results(per_rank: list[list]) -> list:
    """Per pass: the ranks agreed (twinkle.model.multi_lora.data_parallel), so a failure is every rank's
    and the numbers are the whole pass's; the rows' log-probs come back in row order."""
    merged = []
    for i in range(len(per_rank[0])):
        parts = [rank[i] for rank in per_rank]
        error = next((x for x in parts if isinstance(x, Exception)), None)
        merged.append(error or {**parts[0], "logprobs": [lp for x in parts for lp in x.get("logprobs", [])]})
    return merged


class TrainShard(MultiLoraBackend, metaclass=RemoteClass):
    """One data-parallel rank of the training model (MultiLoraModel, no sampler of its own)."""

    def __init__(
        self,
        base_model: str,
        model_path: str | None,
        *,
        dtype: str = "auto",
        trust_remote_code: bool = False,
        activation_checkpointing: bool = False,
    ):
        if model_path is None:  # resolved on this rank's node, as a hub id is
            from twinkle.hub import resolve_model_path

            model_path = str(resolve_model_path(base_model))
        super().__init__(
            base_model,
            model_path,
            dtype=dtype,
            device=_group_device(),
            trust_remote_code=trust_remote_code,
            sampler=False,  # sampling is the SamplerShard's
            activation_checkpointing=activation_checkpointing,
        )

    def describe(self) -> dict:
        return {"vocab_size": self.vocab_size, "max_context": self.max_context}

    create_adapter = returns_user_errors(MultiLoraBackend.create_adapter)
    remove_adapter = returns_user_errors(MultiLoraBackend.remove_adapter)
    add_lora = returns_user_errors(MultiLoraBackend.add_lora)
    configure_adapter = returns_user_errors(MultiLoraBackend.configure_adapter)
    calculate_metric = returns_user_errors(MultiLoraBackend.calculate_metric)

    # Tensors cross to the server on the CPU (it may have no GPU).
    @returns_user_errors
    def adapter_tensors(self, name):
        return super().adapter_tensors(name).to(device="cpu")

    # Checkpoints cross as the folder's files, so no rank needs the server's disk; the ranks are
    # replicas: data rank 0 writes them (MultiLoraModel.save) and its answer is the group's.
    @returns_user_errors
    def checkpoint_files(self, name: str, training_state: bool) -> dict[str, bytes]:
        with tempfile.TemporaryDirectory() as folder:
            super().save_checkpoint(name, folder, training_state)
            return read_files(folder)

    @returns_user_errors
    def load_checkpoint_files(
        self, name: str, files: dict[str, bytes], training_state: bool, implicit_adam: bool
    ) -> dict:
        with tempfile.TemporaryDirectory() as folder:
            write_files(files, folder)
            return super().load_checkpoint(name, folder, training_state, implicit_adam)

    @remote_method(dispatch=slice_items, collect=merge_rank_results)
    def forward_backward_many(self, passes) -> list:
        return super().forward_backward_many(passes)

    optim_step = returns_user_errors(MultiLoraBackend.optim_step)
    clip_grad_and_step = returns_user_errors(MultiLoraBackend.clip_grad_and_step)


def _one_rank(args, kwargs, mesh, rank):
    """The request goes to rank `route % world`; the other ranks get an empty call and answer None."""
    if kwargs.get("route", 0) % mesh.world_size == rank:
        return args, kwargs
    return (), {"route": -1}


class SamplerShard(TorchSampling, metaclass=RemoteClass):
    """One replica of the sampler (TorchSampler on its own copy of the base weights)."""

    def __init__(
        self,
        base_model: str,
        model_path: str | None,
        *,
        dtype: str = "auto",
        max_batch_size: int = 64,
        trust_remote_code: bool = False,
    ):
        from transformers import AutoConfig

        if model_path is None:
            from twinkle.hub import resolve_model_path

            model_path = str(resolve_model_path(base_model))
        # a vision-language config keeps the language model's sizes in its text config
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).get_text_config()
        self.vocab_size = config.vocab_size
        self.max_context = int(getattr(config, "max_position_embeddings", 4096))
        self._init_sampler(
            model_path,
            dtype,
            max_batch_size,
            device=_group_device(),
            trust_remote_code=trust_remote_code,
        )

    def set_adapter(self, name: str, weights) -> None:
        self.sampler.set_adapter(name, weights)

    @remote_method(dispatch=_one_rank, collect=lambda results: next(r for r in results if r is not None))
    def sample_one(self, *args, route: int = 0, images=None, cache_namespace=None):
        if route < 0:
            return None
        return returns_user_errors(self.sample)(*args, images=images, cache_namespace=cache_namespace)

    @remote_method(dispatch=_one_rank, collect=lambda results: next(r for r in results if r is not None))
    def reduce_prompt_table_one(self, *args, route: int = 0, images=None):
        if route < 0:
            return None
        return returns_user_errors(self.reduce_prompt_table)(*args, images=images)
