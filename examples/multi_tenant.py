"""The seed's multi-tenant scenario: four tenants share one twinkle-server (one base model, loaded once)
and work at the same time, each with its own API key, through the unmodified Tinker SDK.

    A  private data (self-cognition), LoRA r=8, SFT on the assistant turns
    B  open data (arithmetic text), LoRA r=32, plain next-token loss on every token
    C  GRPO on examples/grpo.py's task from its SFT warm start (a second base model on the same server):
       sample groups from its own LoRA, reward, group-relative advantages, importance_sampling loss;
       held-out greedy accuracy before and after
    D  log-prob inference only on the base model (no training), checked against a local forward

    uv run examples/multi_tenant.py                       # starts a server in-process on a free port
    uv run examples/multi_tenant.py --model twinkle://qwen3-tiny --steps 6   # quick
    uv run examples/multi_tenant.py --rl-steps 100       # tenant C: held-out 0.775 -> 0.845 (docs/training.md)
    uv run examples/multi_tenant.py --base-url http://127.0.0.1:8000      # keys from TWINKLE_KEY_A..D

Each tenant prints its result line and the script exits non-zero if any tenant's check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")
# Tenant C: examples/grpo.py's task, warm start (the same cached SFT folder) and LoRA lr.
RL_TASK, RL_WARM_START, RL_LR = "larger", 30, 5e-4


def bundled(name: str) -> list[dict]:
    import twinkle.dataset

    path = Path(twinkle.dataset.__file__).parent / "bundled" / name / "train.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def datum(tokens, weights):
    from tinker import types

    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights[1:]},
    )


def tenant_a(client, model, steps):
    """SFT on self-cognition chats: loss only on the assistant's answer."""
    from tinker import types

    tc = client.create_lora_training_client(base_model=model, rank=8, seed=1).result()
    tok = tc.get_tokenizer()
    rows = bundled("self_cognition")[:16]
    data = []
    for row in rows:
        answer = row["response"].replace("{{NAME}}", "Twinkle").replace("{{AUTHOR}}", "ModelScope")
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": row["query"]}], tokenize=False, add_generation_prompt=True
        )
        p_ids = tok.encode(prompt, add_special_tokens=False)
        a_ids = tok.encode(answer + "<|im_end|>", add_special_tokens=False)
        data.append(datum(p_ids + a_ids, [0.0] * len(p_ids) + [1.0] * len(a_ids)))
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=3e-3))
        m = fb.result().metrics
        losses.append(m["loss:sum"] / sum(sum(d.loss_fn_inputs["weights"].data) for d in data))
    ok = losses[-1] < 0.8 * losses[0]
    return ok, f"SFT r=8: per-token loss {losses[0]:.3f} -> {losses[-1]:.3f}"


def tenant_b(client, model, steps):
    """Continued pre-training on plain text: every token counts."""
    from tinker import types

    tc = client.create_lora_training_client(base_model=model, rank=32, seed=2).result()
    tok = tc.get_tokenizer()
    text = [f"{r['question']} {r['answer']}\n" for r in bundled("arithmetic")[:24]]
    data = [datum(ids, [1.0] * len(ids)) for ids in (tok.encode(t, add_special_tokens=False) for t in text)]
    n_tokens = sum(len(d.model_input.to_ints()) for d in data)
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=3e-3))
        losses.append(fb.result().metrics["loss:sum"] / n_tokens)
    return losses[-1] < 0.8 * losses[0], f"next-token r=32: per-token loss {losses[0]:.3f} -> {losses[-1]:.3f}"


def task_prompts(tok, split):
    """(prompt token ids, ground truth) for examples/grpo.py's task, through the tenant's own tokenizer."""
    from twinkle.rl.demo import arithmetic_prompts

    rows = arithmetic_prompts(split, task=RL_TASK)
    chat = (tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True) for r in rows)
    return [(tok.encode(text, add_special_tokens=False), r["ground_truth"]) for text, r in zip(chat, rows)]


def tenant_c(client, model, steps, prompts=16, group=8):
    """GRPO on examples/grpo.py's task (which of two numbers is larger), from its SFT warm start:
    sample groups from its own LoRA, reward exact answers, group-relative advantages,
    importance_sampling loss; greedy accuracy on the held-out test split before and after."""
    import random

    from tinker import types

    from twinkle.advantage import GRPOAdvantage
    from twinkle.reward import ArithmeticAccuracy

    tc = client.create_lora_training_client(base_model=model, rank=32, seed=3).result()
    tok = tc.get_tokenizer()
    train, held_out = task_prompts(tok, "train"), task_prompts(tok, "test")
    correct, rng = ArithmeticAccuracy(), random.Random(3)

    def score(pairs, samples):  # one reward per sequence, prompt-major
        texts = [tok.decode(s.tokens) for seqs in samples for s in seqs]
        truths = [{"ground_truth": truth} for (_, truth), seqs in zip(pairs, samples) for _ in seqs]
        return correct(texts, truths).values

    def sample(sampler, pairs, n, temperature, seed=0):
        params = types.SamplingParams(max_tokens=4, temperature=temperature, seed=seed)
        futures = [
            sampler.sample(types.ModelInput.from_ints(p), num_samples=n, sampling_params=params) for p, _ in pairs
        ]
        return [f.result().sequences for f in futures]

    def accuracy(sampler):
        values = score(held_out, sample(sampler, held_out, 1, 0.0))
        return sum(values) / len(values)

    sampler = tc.save_weights_and_get_sampling_client().result()
    before, rewards_per_iter = accuracy(sampler), []
    for it in range(steps):
        batch = rng.sample(train, prompts)
        samples = sample(sampler, batch, group, 1.0, seed=it)
        rewards = score(batch, samples)
        adv = GRPOAdvantage(scale_by="group")(rewards, group_size=group).tolist()
        data = []
        for i, ((prompt, _), seqs) in enumerate(zip(batch, samples)):
            a = adv[i * group : (i + 1) * group]
            if not any(a):  # every sample agrees: no signal in this group (grpo.py skips it too)
                continue
            for s, advantage in zip(seqs, a):
                n, tokens = len(prompt) - 1, prompt + s.tokens
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={
                            "target_tokens": tokens[1:],
                            "logprobs": [0.0] * n + list(s.logprobs),
                            "advantages": [0.0] * n + [advantage] * len(s.tokens),
                        },
                    )
                )
        if data:
            tc.forward_backward(data, "importance_sampling")
            tc.optim_step(types.AdamParams(learning_rate=RL_LR)).result()
        rewards_per_iter.append(sum(rewards) / len(rewards))
        sampler = tc.save_weights_and_get_sampling_client().result()
    after = accuracy(sampler)
    half = max(1, len(rewards_per_iter) // 2)
    first, last = sum(rewards_per_iter[:half]) / half, sum(rewards_per_iter[-half:]) / half
    return after >= before, (
        f"GRPO: mean reward {first:.3f} (first half) -> {last:.3f} (second half); "
        f"held-out greedy accuracy {before:.3f} -> {after:.3f} ({len(held_out)} test prompts, {steps} steps)"
    )


def tenant_d(client, model, steps):
    """Log-prob inference only: the server's numbers equal a local forward of the same base model."""
    import torch
    from tinker import types
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from twinkle.hub import resolve_model_path

    path = resolve_model_path(model)
    tok = AutoTokenizer.from_pretrained(path)
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    sampler = client.create_sampling_client(base_model=model).result()
    worst = 0.0
    for row in bundled("arithmetic")[: max(2, steps)]:
        ids = tok.encode(f"{row['question']} {row['answer']}", add_special_tokens=False)
        remote = sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result()
        with torch.no_grad():
            logp = torch.log_softmax(local(torch.tensor([ids])).logits[0, :-1].float(), -1)
        expected = logp.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
        worst = max(worst, float((torch.tensor(remote[1:]) - expected).abs().max()))
    return worst < 1e-3, f"log-probs of {max(2, steps)} texts match a local forward (max |diff| {worst:.2e})"


TENANTS = {"A": tenant_a, "B": tenant_b, "C": tenant_c, "D": tenant_d}


def main() -> int:
    import tinker

    from twinkle.hub import DEFAULT_MODEL

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rl-steps", type=int, default=None, help="tenant C's GRPO steps (default: --steps)")
    ap.add_argument("--base-url", default=None, help="an already running twinkle-server (keys: TWINKLE_KEY_A..D)")
    ap.add_argument("--rl-model", default=None, help="tenant C's base on --base-url (default: --model)")
    args = ap.parse_args()

    server, rl_model = None, args.rl_model or args.model
    if args.base_url is None:
        import twinkle
        from twinkle.rl.demo import warm_start

        # Tenant C starts where examples/grpo.py does: the base after a brief SFT on the task, served
        # beside the shared base as a second model (RL from a random model sees only zero rewards).
        rl_path = warm_start(args.model, steps=RL_WARM_START, task=RL_TASK, log=None)
        rl_model = f"{args.model}+{RL_TASK}-sft"
        server = twinkle.initialize(
            mode="http",
            port=0,
            data_dir=tempfile.mkdtemp(prefix="twinkle-mt-"),
            config={"models": [{"name": args.model}, {"name": rl_model, "path": rl_path}]},
            block=False,
            log_level="warning",
        ).wait_ready()
        url, keys = server.url, {t: server.create_key(f"tenant-{t}") for t in TENANTS}
    else:
        url, keys = args.base_url, {t: os.environ[f"TWINKLE_KEY_{t}"] for t in TENANTS}

    results: dict[str, tuple[bool, str]] = {}
    start = time.perf_counter()

    def run(name):
        try:
            with tinker.ServiceClient(base_url=url, api_key=keys[name]) as client:
                if name == "C":
                    results[name] = tenant_c(client, rl_model, args.rl_steps or args.steps)
                else:
                    results[name] = TENANTS[name](client, args.model, args.steps)
        except Exception as e:
            results[name] = (False, f"failed: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(t,)) for t in TENANTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in TENANTS:
        ok, line = results[name]
        print(f"tenant {name}: {'ok  ' if ok else 'FAIL'} {line}")
    print(f"all tenants done in {time.perf_counter() - start:.1f} s on {args.model}")
    if server is not None:
        print(f"fused multi-tenant passes: {server.runtime.engines[args.model].scheduler.fused_passes}")
        server.stop()
    return 0 if all(ok for ok, _ in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
