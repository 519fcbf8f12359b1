"""TRL's side of bench_peer_trl_grpo.py: `GRPOTrainer` until held-out greedy accuracy reaches a target.

Runs in the TRL peer venv (benchmarks/_peer.py); argv[1] is the JSON config's path (the warm-started model
folder, the train and held-out rows as the benchmark built them, and the hyper-parameters). A
callback evaluates every `eval_every` steps (greedy, the held-out rows) and stops the trainer at the
target; evaluation time is left out of the training time. The last stdout line is the JSON result.
"""

import json
import re
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

FORMAT = re.compile(r"-?\d+(<\|im_end\|>)?")


def text_of(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def final_number(text: str) -> str | None:
    found = re.findall(r"-?\d+", text)
    return found[-1] if found else None


def accuracy(completions, ground_truth, **_) -> list[float]:
    return [float(final_number(text_of(c)) == str(g)) for c, g in zip(completions, ground_truth)]


def answer_format(completions, **_) -> list[float]:
    return [float(FORMAT.fullmatch(text_of(c).strip()) is not None) for c in completions]


class EvalAndStop(TrainerCallback):
    def __init__(self, cfg, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.trainer, self.curve, self.step_seconds, self.reached = None, [], [], None

    def evaluate(self, model) -> float:
        self.tokenizer.padding_side = "left"
        prompts = [r["prompt"] for r in self.cfg["held_out"]]
        enc = self.tokenizer.apply_chat_template(
            prompts, add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
        )
        was_training = model.training
        model.eval()
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=self.cfg["max_tokens"], do_sample=False)
        model.train(was_training)
        texts = self.tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        truths = [r["ground_truth"] for r in self.cfg["held_out"]]
        return sum(accuracy(texts, truths)) / len(texts)

    # ARG002: transformers' TrainerCallback signature
    def on_train_begin(self, args, state, control, model=None, **kwargs):  # noqa: ARG002
        self.curve.append((0, self.evaluate(model)))
        self.t0 = time.perf_counter()

    # ARG002: transformers' TrainerCallback signature
    def on_step_end(self, args, state, control, model=None, **kwargs):  # noqa: ARG002
        self.step_seconds.append(time.perf_counter() - self.t0)
        if state.global_step % self.cfg["eval_every"] == 0:
            acc = self.evaluate(model)
            self.curve.append((state.global_step, acc))
            print(f"TRL seed {self.cfg['seed']} step {state.global_step}: held-out acc {acc:.3f}", flush=True)
            if acc >= self.cfg["target"] and self.reached is None:
                self.reached = state.global_step
                control.should_training_stop = True
        self.t0 = time.perf_counter()  # after the evaluation: it is not training time


def main():
    cfg = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(cfg["threads"])
    tokenizer = AutoTokenizer.from_pretrained(cfg["model_path"])
    dataset = Dataset.from_list(cfg["train"])
    n = cfg["prompts"] * cfg["group"]
    args = GRPOConfig(
        output_dir=cfg["out_dir"],
        use_cpu=True,
        seed=cfg["seed"],
        max_steps=cfg["max_steps"],
        per_device_train_batch_size=n,  # one optimizer step per generation batch: prompts x group
        gradient_accumulation_steps=1,
        num_generations=cfg["group"],
        num_iterations=1,
        max_completion_length=cfg["max_tokens"],
        temperature=1.0,
        learning_rate=cfg["lr"],
        lr_scheduler_type="constant",
        weight_decay=0.01,
        max_grad_norm=1.0,
        loss_type="dapo",  # one mean over every completion token of the batch, as Twinkle's GRPOLoss
        epsilon=0.2,
        epsilon_high=0.28,
        beta=0.0,
        entropy_coef=cfg["entropy_coef"],
        scale_rewards="group",
        reward_weights=cfg.get("reward_weights", [1.0, 0.1]),
        # set for a CPU, as a competent user would: no bf16 autocast, no activation checkpointing
        bf16=False,
        activation_checkpointing=False,
        logging_steps=10**9,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    lora = LoraConfig(
        r=cfg["lora_rank"], lora_alpha=2 * cfg["lora_rank"], target_modules="all-linear", lora_dropout=0.0
    )
    args.model_init_kwargs = {"dtype": torch.float32}
    trainer = GRPOTrainer(
        model=cfg["model_path"],
        reward_funcs=[accuracy, answer_format],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
    )
    callback = EvalAndStop(cfg, tokenizer)
    trainer.add_callback(callback)
    generated = []  # (seconds, completion tokens) of each step's generation: the sampling share of a step
    generate = trainer._generate

    def timed_generate(prompts):
        start = time.perf_counter()
        out = generate(prompts)
        generated.append((time.perf_counter() - start, sum(len(ids) for ids in out[1])))
        return out

    trainer._generate = timed_generate
    trainer.train()
    steps = callback.reached
    print(
        json.dumps(
            {
                "steps_to_target": steps,
                "train_s_to_target": sum(callback.step_seconds[:steps]) if steps else None,
                "curve": callback.curve,
                "step_seconds": callback.step_seconds,
                "generate_seconds": [s for s, _ in generated],
                "generated_tokens": [n for _, n in generated],
                "prompt_text": tokenizer.apply_chat_template(
                    cfg["train"][0]["prompt"], add_generation_prompt=True, tokenize=False
                ),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
