"""The ranks of the remote backend: `TrainShard` (the training model) and `SamplerShard` (the sampler).

Both are `@remote_class`es: built with `remote_group='name'` after `twinkle.mesh.initialize(mode='ray')`
they are Ray actor groups, built with `remote_group=None` plain objects in this process. What the ranks
do so that a data-parallel group equals one process:

- forward_backward: each data rank gets its contiguous slice of every pass's rows (and of a custom
  loss's per-row inputs). A loss that sums over tokens (Tinker's) gives the batch's gradient as the
  sum of the ranks'; a loss normalised over its own loss tokens (a native adapter's) is scaled on
  each rank by its share of the pass's loss tokens before backward (`strategy.data_parallel_weights`:
  exact for token-mean losses, the built-ins, as `data_parallel_loss` is for torchrun ranks). A step
  sums the gradients over the process group (`strategy.sum_gradients`), then every rank takes the
  same optimizer step and the replicas stay equal.
- what a rank learns from its slice (loss, token counts, its metric record) is exchanged, so every
  rank feeds the same merged record to the adapter's metrics and answers with the same numbers.
- a request fails on every rank or on none: a failure or a non-finite loss on any rank restores
  every rank's gradients from before the pass.
- sampling: each request runs on one rank of the sampler group (round robin).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from twinkle.loss import Loss
from twinkle.mesh import remote_class, remote_method
from twinkle.mesh.device_mesh import split_bounds
from twinkle.metric import ForwardRecord
from twinkle.model.strategy import data_parallel_weights, sum_gradients
from twinkle.serve.backend.base import AdamParams, UserError
from twinkle.serve.backend.multi_lora_backend import MultiLoraBackend
from twinkle.serve.backend.sampling import TorchSampling


class PeerFailed(UserError):
    """This rank's part was fine but another data rank's failed, so the whole request failed."""


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


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _group_device() -> str | None:
    """'cuda' on a rank of a cuda DeviceGroup (Ray gave the actor its GPU); else the default (CPU)."""
    from twinkle.mesh import get_global_mesh

    return "cuda" if get_global_mesh().device_type == "cuda" else None


# -- forward_backward fan-out / fan-in ------------------------------------------------------------
def _slice_items(args, kwargs, mesh, rank):
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


def _loss_units(rows) -> int:
    """The loss tokens of rows (labels after the first position that are not -100); rows the engine
    will refuse count none, the pass fails on every rank anyway."""
    try:
        return sum(sum(int(t) != -100 for t in list(r.get("labels", r["input_ids"]))[1:]) for r in rows)
    except (KeyError, TypeError, ValueError, AttributeError):
        return 0


def merge_rank_results(per_rank: list[list]) -> list:
    """Per pass: the first real error; else the ranks' agreed outcome (`_agree` made every rank's
    numbers the whole pass's) with the rows' log-probs in row order."""
    merged = []
    for i in range(len(per_rank[0])):
        parts = [rank[i] for rank in per_rank]
        errors = [x for x in parts if isinstance(x, Exception)]
        if errors:
            merged.append(next((e for e in errors if not isinstance(e, PeerFailed)), errors[0]))
            continue
        done = [x for x in parts if x is not None]  # ranks with an empty slice did nothing
        merged.append({**done[0], "logprobs": [lp for x in done for lp in x.get("logprobs", [])]})
    return merged


class _Recorder:
    """Stands in for an adapter's metrics during a pass: keeps the rank's record for merging."""

    record: ForwardRecord | None = None

    def on_forward(self, record: ForwardRecord) -> None:
        self.record = record


def merge_records(parts: list[tuple[ForwardRecord, int]], loss: Loss) -> ForwardRecord:
    """The record one process would have made of the whole pass, from each rank's (record, rows): a
    loss that sums over tokens adds up over ranks, a mean one is averaged over loss tokens; each of
    its metrics combines as the loss says (`Loss.metric_merge`)."""
    records = [r for r, _ in parts]
    tokens = sum(r.loss_tokens for r in records)
    scored = [(r, n) for r, n in parts if r.loss_tokens]
    finite = bool(scored) and all(r.finite for r, _ in scored)
    if not finite:
        value = next((r.loss for r, _ in scored if not r.finite), float("nan"))
    elif loss.reduction == "sum":
        value = sum(r.loss or 0.0 for r, _ in scored)
    else:
        value = sum((r.loss or 0.0) * r.loss_tokens for r, _ in scored) / tokens  # a finite scored record has a loss
    extras = {}
    for key in scored[0][0].extras if finite else {}:
        values = [(r.extras.get(key, 0.0), r.loss_tokens, n) for r, n in scored]
        how = loss.metric_merge(key)
        if how == "sum":
            extras[key] = sum(v for v, _, _ in values)
        elif how == "row_mean":
            extras[key] = sum(v * n for v, _, n in values) / sum(n for _, _, n in values)
        else:
            extras[key] = sum(v * t for v, t, _ in values) / tokens
    return ForwardRecord(
        loss=value,
        loss_tokens=tokens,
        input_tokens=sum(r.input_tokens for r in records),
        correct_tokens=sum(r.correct_tokens for r in records),
        seconds=max(r.seconds for r in records),
        flops=sum(r.flops for r in records),
        finite=finite,
        extras=extras,
    )


@remote_class
class TrainShard(MultiLoraBackend):
    """One data-parallel rank of the training model (MultiLoraModel, no sampler of its own)."""

    def __init__(
        self,
        base_model: str,
        model_path: str | None,
        *,
        dtype: str = "float32",
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
    # replicas, so rank 0's files are everyone's.
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

    @remote_method(dispatch=_slice_items, collect=merge_rank_results)
    def forward_backward_many(self, items) -> list:
        states = {it.adapter: self.engine.adapters[it.adapter] for it in items if it.adapter in self.engine.adapters}
        saved = {
            it.adapter: states[it.adapter].snapshot() for it in items if not it.forward_only and it.adapter in states
        }
        recorders = {(name, train): _Recorder() for name in states for train in (True, False)}
        kept = {name: (s.train_metrics, s.eval_metrics) for name, s in states.items()}
        for name, s in states.items():
            s.train_metrics, s.eval_metrics = [recorders[(name, True)]], [recorders[(name, False)]]
        results: list = [None] * len(items)
        live = [i for i, item in enumerate(items) if item.rows]
        weights = self._rank_weights(items)
        try:
            if live:
                for i, r in zip(live, super().forward_backward_many([items[i] for i in live], weights)):
                    results[i] = r
        except Exception as e:
            for i in live:
                results[i] = e
        finally:
            for name, s in states.items():
                s.train_metrics, s.eval_metrics = kept[name]
        mine = [
            (
                isinstance(r, Exception),
                None
                if r is None or isinstance(r, Exception)
                else recorders[(item.adapter, not item.forward_only)].record,
                len(item.rows),
            )
            for item, r in zip(items, results)
        ]
        everyone: list = [mine]
        if _world() > 1:
            everyone = [None] * _world()
            dist.all_gather_object(everyone, mine)
        for i, item in enumerate(items):
            self._agree(i, item, results, [rank[i] for rank in everyone], saved.get(item.adapter))
        return results

    def _loss(self, item) -> Loss:
        """The loss that scores the pass: its own, or its adapter's configured one."""
        return item.loss if item.loss is not None else self.engine.adapters[item.adapter].loss

    def _agree(self, i, item, results, parts, saved) -> None:
        """Make pass i's outcome and effects on this rank those of the whole pass."""
        failed = any(f for f, _, _ in parts)
        records = [(r, n) for _, r, n in parts if r is not None]
        merged = None if failed or not records else merge_records(records, self._loss(item))
        if failed:
            if not isinstance(results[i], Exception):
                results[i] = PeerFailed("the request failed on another data-parallel rank")
        elif merged is not None:  # merged: some rank scored rows
            results[i] = {
                **(results[i] or {}),
                "loss": merged.loss,
                "loss_tokens": merged.loss_tokens,
                "finite": merged.finite,
                "metrics": dict(merged.extras),
            }
        state = self.engine.adapters.get(item.adapter)
        if state is None:
            return
        if saved is not None:
            if failed:  # as if the pass never ran; the ranks' counters stay equal, so they agree on the next boundary
                state.restore(saved)
            else:
                if not item.rows:  # an empty slice still counts as the window's micro-batch
                    state.count_micro_batch()
                if merged is not None and not merged.finite:  # never back-propagated, on every rank
                    state.discard_pass(saved)
        if merged is not None:
            for metric in state.metrics(not item.forward_only):
                metric.on_forward(merged)

    def _rank_weights(self, items) -> dict[str, float]:
        """Each training pass's share of its loss tokens on this rank, for losses normalised over them
        (every rank calls this with the same passes, so the one all-reduce lines up); summed losses
        need none."""
        normalised = [
            it
            for it in items
            if not it.forward_only and it.adapter in self.engine.adapters and self._loss(it).reduction == "mean"
        ]
        shares = data_parallel_weights([_loss_units(it.rows) for it in normalised])
        return {it.adapter: w for it, w in zip(normalised, shares)}

    @returns_user_errors
    def optim_step(self, name: str, params: AdamParams) -> dict[str, float]:
        sum_gradients(self._state(name).params)
        return super().optim_step(name, params)

    @returns_user_errors
    def clip_grad_and_step(self, name: str, max_grad_norm: float | None) -> dict:
        state = self._state(name)
        if state.micro_step >= state.gradient_accumulation_steps:  # every rank agrees: their counters are equal
            sum_gradients(state.params)
        return super().clip_grad_and_step(name, max_grad_norm)


def _one_rank(args, kwargs, mesh, rank):
    """The request goes to rank `route % world`; the other ranks get an empty call and answer None."""
    if kwargs.get("route", 0) % mesh.world_size == rank:
        return args, kwargs
    return (), {"route": -1}


@remote_class
class SamplerShard(TorchSampling):
    """One replica of the sampler (TorchSampler on its own copy of the base weights)."""

    def __init__(
        self,
        base_model: str,
        model_path: str | None,
        *,
        dtype: str = "float32",
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
            getattr(torch, dtype),
            max_batch_size,
            device=_group_device(),
            trust_remote_code=trust_remote_code,
        )

    def set_adapter(self, name: str, weights) -> None:
        self.sampler.set_adapter(name, weights)

    @remote_method(dispatch=_one_rank, collect=lambda results: next(r for r in results if r is not None))
    def sample_one(self, *args, route: int = 0, images=None):
        if route < 0:
            return None
        return returns_user_errors(self.sample)(*args, images=images)
