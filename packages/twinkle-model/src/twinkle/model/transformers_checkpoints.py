"""TransformersModel's checkpoints: save, load, resume and upload, in the one format of
`twinkle.model.checkpoint` (a PEFT folder for a LoRA adapter, a `save_pretrained` folder for the whole
model, the training state beside either)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twinkle.mesh import remote_method
from twinkle.model import checkpoint
from twinkle.model.kit import progress, save_target
from twinkle.model.state import FULL_MODEL, AdapterState
from twinkle.model.strategy import barrier, data_parallel_size, full_tensor, is_main_process
from twinkle.model.transformers_core import TransformersCore

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class TransformersCheckpoints(TransformersCore):
    """save / load / resume_from_checkpoint / push_to_hub of TransformersCore's adapters."""

    def _tokenizer(self, state: AdapterState) -> PreTrainedTokenizerBase | None:
        template = state.template
        return getattr(template, "tokenizer", None)

    @remote_method()
    def save(
        self,
        path: str | os.PathLike,
        adapter_name: str | None = None,
        save_training_state: bool = False,
        data_position: int | None = None,
        *,
        output_dir: str | None = None,
        save_optimizer: bool | None = None,
        consumed_train_samples: int | None = None,
    ) -> str:
        """A PEFT folder for a LoRA adapter, a `save_pretrained` folder for the whole model;
        with `save_training_state`, also optimizer, scheduler, RNG and data position. twinkle-kit's
        keywords: `output_dir` (the folder `path` is written in), `save_optimizer`
        (= save_training_state), `consumed_train_samples` (kept with the training state)."""
        from peft import get_peft_model_state_dict

        folder, save_training_state = save_target(path, save_training_state, output_dir, save_optimizer)
        path = Path(folder)
        state = self._state(adapter_name)
        if state.name == FULL_MODEL:
            module = getattr(self._wrapped, "module", self._wrapped)  # DDP keeps the model under .module
            source = module if module is self.hf_model else self.hf_model
            weights = {k: full_tensor(v).detach().to("cpu") for k, v in source.state_dict().items()}
            if is_main_process():
                checkpoint.save_full(self.hf_model, weights, path, self._tokenizer(state))
        else:
            peft_model = self.peft_model
            assert peft_model is not None  # a LoRA adapter exists, so the peft wrapper does
            # save_embedding_layers=False: with lm_head among the targets peft would otherwise also
            # write the frozen base head (vocab x hidden) into the adapter, which no sampler expects
            lora = get_peft_model_state_dict(peft_model, adapter_name=state.name, save_embedding_layers=False)
            weights = {k: full_tensor(v) for k, v in lora.items()}
            if is_main_process():
                checkpoint.save_adapter(
                    path,
                    peft_model.peft_config[state.name],
                    weights,
                    checkpoint.base_model_id(self.model_id, self.model_path),
                )
        if save_training_state:  # every rank: sharded optimizer state is gathered, rank 0 writes
            checkpoint.save_adapter_state(
                path, state, data_position, write=is_main_process(), consumed_train_samples=consumed_train_samples
            )
        barrier()
        return str(path)

    @remote_method()
    def push_to_hub(self, repo_id: str, adapter_name: str | None = None, **kwargs: Any) -> str | None:
        """Upload what `save` writes to `org/name` (Hugging Face), `hf://org/name` or `ms://org/name`;
        private=, token=, endpoint=, commit_message= as in twinkle.model.hub_upload.push_to_hub."""
        from twinkle.model.hub_upload import push_to_hub

        return push_to_hub(self, repo_id, adapter_name, **kwargs)

    @remote_method()
    def load(self, path: str | os.PathLike, adapter_name: str | None = None) -> None:
        """Load weights saved by `save` into the adapter (or the whole model); a LoRA folder for an
        adapter that does not exist yet creates it from the folder's adapter_config.json."""
        from peft import set_peft_model_state_dict

        path = Path(path)
        if self._wrapped is not None and self.strategy == "fsdp2" and data_parallel_size(self.device_mesh) > 1:
            raise RuntimeError(
                "load / resume_from_checkpoint before the first forward_backward under FSDP2: "
                "the weights are sharded now; build a new TransformersModel and load into it"
            )
        if checkpoint.is_adapter_folder(path) and (
            adapter_name not in self.states if adapter_name else not self.adapter_names
        ):
            config, _ = checkpoint.load_adapter(path)
            self.add_adapter_to_model(adapter_name or "default", config)
        state = self._state(adapter_name)
        if state.name == FULL_MODEL:
            checkpoint.load_full(self.hf_model, path)
            return
        _, tensors = checkpoint.load_adapter(path)
        result = set_peft_model_state_dict(self.peft_model, tensors, adapter_name=state.name)
        unexpected = getattr(result, "unexpected_keys", None)
        if unexpected:
            raise ValueError(f"checkpoint {path} does not fit adapter {state.name!r}: unexpected keys {unexpected[:5]}")

    @remote_method()
    def resume_from_checkpoint(
        self, path: str | os.PathLike, adapter_name: str | None = None, *, resume_only_model: bool = False
    ) -> dict:
        """Weights plus training state; returns {'data_position', 'optimizer_steps', 'micro_step'}: skip
        that many batches of the data loader to continue exactly where the saved run was (plus
        twinkle-kit's 'cur_step' and 'consumed_train_samples'). `resume_only_model=True` loads the
        weights only and reports the saved counters without restoring them."""
        self.load(path, adapter_name)
        state = self._state(adapter_name)
        if resume_only_model:
            return progress(checkpoint.read_counters(path), state.gradient_accumulation_steps)
        self._activate(state)  # wrapped first: under FSDP2 the moments load into their shards
        return progress(checkpoint.resume_adapter_state(path, state), state.gradient_accumulation_steps)
