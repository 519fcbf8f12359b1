"""GRPO through the unmodified Tinker SDK that survives `kill -9` of itself or of the server: with
`--resume` it continues from its newest checkpoint and ends with the adapter bit for bit as a run that
was never interrupted.

A checkpoint is two halves, written in this order:
  server  `save_state` — the LoRA weights and the optimizer's state (Adam moments, step count);
  client  `loop_state.json` (written atomically after the server acknowledged its half) — the next
          step, the data position (this epoch's order and the index in it), the shuffling RNG's
          state, the path of the server half, the reward history.
Everything else is a rule of the step number, so a resumed step repeats the lost one exactly: the
learning-rate schedule, and the sampling seeds (a function of the run seed, the step and the prompt's
slot: the server's seeded sampling is a function of the request alone, whatever else it is running).

The task is on token ids (no tokenizer to load): after a fixed instruction, a prompt counts up,
`a, a+1, a+2, a+3`, and a completion earns partial credit for going on counting.

    uv run twinkle-server --port 8000 --data-dir ./twinkle-data        # in another terminal
    uv run twinkle-server keys create alice --data-dir ./twinkle-data  # prints alice's key
    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-... uv run examples/tinker_grpo_resume.py --checkpoint-dir ckpt
    # kill it (or the server) at any point, restart the server if needed, then:
    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-... uv run examples/tinker_grpo_resume.py --checkpoint-dir ckpt --resume
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")

import tinker
from tinker import types

STATE_FILE = "loop_state.json"
INSTRUCTION = [5, 6, 7, 8, 9, 10]  # every prompt starts with it, as with a chat template (the prefix cache serves it)


def make_prompts(n: int) -> list[list[int]]:
    """The data set: n counting prompts starting at different token ids."""
    return [[*INSTRUCTION, a, a + 1, a + 2, a + 3] for a in range(20, 20 + 7 * n, 7)]


def reward(prompt: list[int], completion: list[int]) -> float:
    """Mean credit per token: 1 for the next number of the count, less the further off it is."""
    want = range(prompt[-1] + 1, prompt[-1] + 1 + len(completion))
    return sum(max(0.0, 1.0 - abs(t - w) / 50) for t, w in zip(completion, want)) / max(1, len(completion))


def sampling_seed(run_seed: int, step: int, slot: int) -> int:
    """The sampling seeds' rule: a pure function of (run, step, prompt slot), so a replayed step draws
    what the lost one drew."""
    return (run_seed * 1_000_003 + step) * 1009 + slot


def learning_rate(args, step: int) -> float:
    """The schedule is a rule of the step (linear warm-up, then constant): no state to save."""
    return args.lr * min(1.0, (step + 1) / args.warmup)


def fresh_state(args) -> dict:
    rng = random.Random(args.seed)
    return {"step": 0, "epoch": 0, "position": 0, "order": [], "rng": rng.getstate(), "rewards": []}


def next_batch(state: dict, n_prompts: int, size: int) -> list[int]:
    """The next `size` prompt indices; a new epoch reshuffles with the run's own RNG stream."""
    rng = random.Random()
    rng.setstate(state["rng"])
    batch = []
    while len(batch) < size:
        if state["position"] >= len(state["order"]):
            state["order"] = rng.sample(range(n_prompts), n_prompts)
            state["epoch"], state["position"] = state["epoch"] + 1, 0
        batch.append(state["order"][state["position"]])
        state["position"] += 1
    state["rng"] = rng.getstate()
    return batch


def save_loop_state(folder: Path, state: dict) -> None:
    """Atomic: a kill leaves the previous file or this one, never half of one."""
    tmp = folder / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, folder / STATE_FILE)


def load_loop_state(folder: Path) -> dict | None:
    path = folder / STATE_FILE
    if not path.exists():
        return None
    state = json.loads(path.read_text())
    version, internal, gauss = state["rng"]  # JSON turned random's state tuples into lists
    state["rng"] = (version, tuple(internal), gauss)
    return state


def grpo_data(prompt: list[int], seqs, rewards: list[float]) -> list[types.Datum]:
    """One datum per sample: group-relative advantages on the completion's tokens, the sampler's
    log-probs as the behaviour policy. A group whose samples all scored alike teaches nothing."""
    mean = sum(rewards) / len(rewards)
    if all(r == mean for r in rewards):
        return []
    pad = [0.0] * (len(prompt) - 1)  # the prompt's positions carry no loss
    full = [prompt + list(s.tokens) for s in seqs]
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": tokens[1:],
                "logprobs": pad + list(s.logprobs),
                "advantages": pad + [r - mean] * len(s.tokens),
            },
        )
        for tokens, s, r in zip(full, seqs, rewards)
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=None, help="default: $TINKER_BASE_URL")
    ap.add_argument("--model", default="twinkle://qwen3-tiny")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--dataset-size", type=int, default=16)
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--loss", default="importance_sampling", choices=["importance_sampling", "ppo"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint-dir", type=Path, required=True)
    ap.add_argument("--checkpoint-every", type=int, default=5)
    ap.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir's newest checkpoint")
    args = ap.parse_args()

    prompts = make_prompts(args.dataset_size)
    service = tinker.ServiceClient(base_url=args.base_url)
    state = load_loop_state(args.checkpoint_dir) if args.resume else None
    if state is None:
        tc = service.create_lora_training_client(base_model=args.model, rank=args.rank, seed=args.seed).result()
        state = fresh_state(args)
    else:  # the server half: weights and optimizer state
        tc = service.create_training_client_from_state_with_optimizer(state["state_path"]).result()
        print(f"resumed from step {state['step']} ({state['state_path']})", flush=True)
    args.checkpoint_dir.mkdir(parents=True, exist_ok=True)

    while state["step"] < args.steps:
        step = state["step"]
        sampler = tc.save_weights_and_get_sampling_client().result()
        batch = next_batch(state, len(prompts), args.prompts)
        futures = [
            sampler.sample(
                types.ModelInput.from_ints(prompts[i]),
                num_samples=args.group,
                sampling_params=types.SamplingParams(
                    max_tokens=args.max_tokens, temperature=1.0, seed=sampling_seed(args.seed, step, slot)
                ),
            )
            for slot, i in enumerate(batch)
        ]
        data, rewards = [], []
        for i, future in zip(batch, futures):
            seqs = future.result().sequences
            scores = [reward(prompts[i], list(s.tokens)) for s in seqs]
            rewards += scores
            data += grpo_data(prompts[i], seqs, scores)
        if data:
            tc.forward_backward(data, args.loss).result()
            tc.optim_step(types.AdamParams(learning_rate=learning_rate(args, step))).result()
        state["rewards"].append(sum(rewards) / len(rewards))
        state["step"] = step + 1
        print(f"step {step}: reward {state['rewards'][-1]:.4f} ({len(data)} datums)", flush=True)
        if state["step"] % args.checkpoint_every == 0 or state["step"] == args.steps:
            state["state_path"] = tc.save_state(f"step-{state['step']:06d}").result().path
            save_loop_state(args.checkpoint_dir, state)
            print(f"checkpoint step {state['step']}: {state['state_path']}", flush=True)
    quarter = max(1, len(state["rewards"]) // 4)
    first, last = (sum(part) / len(part) for part in (state["rewards"][:quarter], state["rewards"][-quarter:]))
    print(f"mean reward {first:.3f} (first {quarter} steps) -> {last:.3f} (last {quarter})")
    print(f"final: {state['state_path']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
