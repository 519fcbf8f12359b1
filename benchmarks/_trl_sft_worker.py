"""TRL's side of bench_peer_trl_sft.py: an `SFTTrainer` run, paused between steps on the benchmark's word.

Runs in the TRL peer venv (benchmarks/_peer.py). argv[1] is the JSON config; the rows come from a
JSONL file, already in step order. The trainer's own loop runs (dataloader, collator, compute_loss,
clipping, optimizer, scheduler); a callback blocks at the end of each block of steps until the
benchmark asks for the next one, so only the trainer's own work falls inside a step's time.
"""

import json
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import SFTConfig, SFTTrainer


class LossKeepingTrainer(SFTTrainer):
    """SFTTrainer whose per-step loss is kept unrounded (its logs round it to 4 digits)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.last_loss = (loss[0] if return_outputs else loss).detach()
        return loss


class Paced(TrainerCallback):
    """Answers each request {"steps": n} with n steps' losses and seconds; EOF on stdin ends training."""

    def __init__(self):
        self.trainer, self.todo, self.losses, self.seconds = None, 0, [], []

    def _next_request(self, control):
        line = sys.stdin.readline()
        if not line:
            control.should_training_stop = True
            return
        self.todo = json.loads(line)["steps"]
        self.t0 = time.perf_counter()

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ARG002 - transformers' TrainerCallback signature
        print(json.dumps({"ready": True}), flush=True)
        self._next_request(control)

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ARG002 - transformers' TrainerCallback signature
        self.seconds.append(time.perf_counter() - self.t0)
        self.losses.append(float(self.trainer.last_loss))
        self.todo -= 1
        if self.todo > 0:
            self.t0 = time.perf_counter()
            return
        print(json.dumps({"losses": self.losses, "seconds": self.seconds}), flush=True)
        self.losses, self.seconds = [], []
        self._next_request(control)


def main():
    cfg = json.loads(sys.argv[1])
    torch.set_num_threads(cfg["threads"])
    rows = [json.loads(line) for line in Path(cfg["rows_file"]).read_text().splitlines()]
    dataset = Dataset.from_list([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows])
    base = AutoModelForCausalLM.from_pretrained(cfg["model_path"], dtype=torch.float32)
    # Twinkle's initial adapter, so both sides start from the same LoRA A matrices (B starts at zero)
    model = PeftModel.from_pretrained(base, cfg["adapter_path"], is_trainable=True)
    args = SFTConfig(
        output_dir=cfg["out_dir"],
        use_cpu=True,
        seed=0,
        max_steps=cfg["steps"],
        per_device_train_batch_size=cfg["batch"],
        gradient_accumulation_steps=1,
        learning_rate=cfg["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=cfg["weight_decay"],
        max_grad_norm=1.0,
        max_length=cfg["max_length"],
        train_sampling_strategy="sequential",  # the rows are already in Twinkle's order
        # TRL's defaults that hurt on CPU, set as a CPU user would: bf16 autocast (unless the benchmark
        # compares both sides in bf16) and gradient checkpointing (recomputing a 5M model's
        # activations buys nothing and costs a forward)
        bf16=cfg["bf16"],
        torch_compile=cfg["compile"],  # only when the benchmark compiles both sides
        activation_checkpointing=False,  # TRL says gradient_checkpointing; transformers 5 renamed it
        logging_steps=10**9,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(cfg["model_path"])
    trainer = LossKeepingTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    pace = Paced()
    pace.trainer = trainer
    trainer.add_callback(pace)
    trainer.train()


if __name__ == "__main__":
    main()
