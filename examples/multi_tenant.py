"""The seed's multi-tenant scenario: four tenants share one twinkle-server (one base model, loaded once)
and work at the same time, each with its own API key, through the unmodified Tinker SDK.

    A  private data (self-cognition), LoRA r=8, SFT on the assistant turns
    B  open data (arithmetic text), LoRA r=32, plain next-token loss on every token
    C  GRPO: sample groups from its own LoRA, reward, group-relative advantages, importance_sampling loss
    D  log-prob inference only on the base model (no training), checked against a local forward

    uv run examples/multi_tenant.py                       # starts a server in-process on a free port
    uv run examples/multi_tenant.py --model twinkle://qwen3-tiny --steps 6   # quick
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


def tenant_c(client, model, steps, group=8):
    """GRPO: reward = share of digits in the answer; the policy learns to answer with digits.

    The base model almost never samples a digit (reward ~0.003), so the signal starts sparse: groups
    of 8 give most prompts one rewarded sample, and lr 3e-3 keeps the unrewarded majority's negative
    advantages from drifting the policy away first (at 3e-2 the reward fell to 0).
    """
    from tinker import types

    tc = client.create_lora_training_client(base_model=model, rank=16, seed=3).result()
    tok = tc.get_tokenizer()
    questions = [r["question"] for r in bundled("arithmetic")[:4]]
    prompts = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
        for q in questions
    ]
    rewards_per_iter = []
    for it in range(steps):
        sampler = tc.save_weights_and_get_sampling_client().result()
        futures = [
            sampler.sample(
                types.ModelInput.from_ints(p),
                num_samples=group,
                sampling_params=types.SamplingParams(max_tokens=8, temperature=1.0, seed=100 * it + i),
            )
            for i, p in enumerate(prompts)
        ]
        data, rewards = [], []
        for prompt, fut in zip(prompts, futures):
            seqs = fut.result().sequences
            r = [sum(ch.isdigit() for ch in tok.decode(s.tokens)) / max(1, len(tok.decode(s.tokens))) for s in seqs]
            mean = sum(r) / len(r)
            rewards += r
            for s, reward in zip(seqs, r):
                n = len(prompt) - 1
                tokens = prompt + s.tokens
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={
                            "target_tokens": tokens[1:],
                            "logprobs": [0.0] * n + list(s.logprobs),
                            "advantages": [0.0] * n + [reward - mean] * len(s.tokens),
                        },
                    )
                )
        tc.forward_backward(data, "importance_sampling")
        tc.optim_step(types.AdamParams(learning_rate=3e-3)).result()
        rewards_per_iter.append(sum(rewards) / len(rewards))
    half = max(1, len(rewards_per_iter) // 2)
    first, last = sum(rewards_per_iter[:half]) / half, sum(rewards_per_iter[-half:]) / half
    return last > first, f"GRPO: mean reward {first:.3f} (first half) -> {last:.3f} (second half)"


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
    ap.add_argument("--base-url", default=None, help="an already running twinkle-server (keys: TWINKLE_KEY_A..D)")
    args = ap.parse_args()

    server = None
    if args.base_url is None:
        import twinkle

        server = twinkle.initialize(
            mode="http",
            port=0,
            data_dir=tempfile.mkdtemp(prefix="twinkle-mt-"),
            config={"models": [{"name": args.model}]},
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
                results[name] = TENANTS[name](client, args.model, args.steps)
        except Exception as e:  # noqa: BLE001 - report every tenant, then fail
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
