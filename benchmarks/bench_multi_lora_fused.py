"""Small tenants' steps fused into one pass vs sequential adapter switching, side by side.

Two configurations, each on twinkle.hub.DEFAULT_MODEL (or `--model`) with LoRA tenants of ranks
8/16/32/8 (repeated), every attention and MLP Linear (twinkle.model.structure's all_linear: peft's
"all-linear" without the MoE router, named explicitly on both sides) plus, on a MoE model, every
expert weight (peft's target_parameters), AdamW, clip 1.0: 4 tenants x 2 sequences x 32 tokens, and 8 tenants x 1 sequence x 16
tokens. Three loops, alternating step by step so machine load hits all alike, medians compared:
  fused       MultiLoraModel.forward_backward_fused (one pass over the base) + 4 optimizer steps
  peft        one peft PeftModel holding 4 adapters: set_adapter(t), forward, backward, step, per tenant
  sequential  MultiLoraModel, one tenant per pass (the engine without fusion)
  single      MultiLoraModel with ONE adapter (rank 16, the tenants' mean) over all the same rows in
              one pass and one optimizer step: the physical bound of fusing (nothing per tenant)
Final line: JSON with `speedup` = the smaller of the two configurations' fused tokens/s / peft
tokens/s (goal >= 1.8), each configuration's figures under its own key; `fused_over_single` is the
larger of the two configurations' fused / single step times (issue 29's goal: <= 1.15).

Where the time goes, per configuration: `phases` splits the fused and peft steps into the pass
(forward + backward) and the optimizer part (clip + step + zero_grad), medians of wall and CPU
seconds; `base_floor` times the frozen base alone (no adapters, no optimizer) over the fused rows
in one pass and over each tenant's rows in its own pass. Their ratio bounds what fusing can gain
on the base's share of the step, since adapters and optimizer do the same FLOPs on both sides.

    uv run python benchmarks/bench_multi_lora_fused.py [--steps 12] [--threads 2] [--configs 4x2x32,8x1x16]
    uv run python benchmarks/bench_multi_lora_fused.py --model twinkle://qwen3-moe-tiny
"""

import argparse
import json
import os
import random
import statistics
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from twinkle.hub import DEFAULT_MODEL, resolve_model_path
from twinkle.model.multi_lora import MultiLoraModel
from twinkle.model.structure import describe

RANKS = (8, 16, 32, 8)
LR = 1e-4


# Read from the base model's structure in main: its Linear targets and 3-D expert weights (none if dense)
LINEARS: list[str] = []
EXPERTS: list[str] = []


def lora(rank):
    return LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=list(LINEARS), target_parameters=list(EXPERTS) or None
    )


def tenants(count: int) -> dict[str, int]:
    return {f"t{i}": RANKS[i % len(RANKS)] for i in range(count)}


def make_batches(tenants, rows, seq, vocab, seed=0):
    rng = random.Random(seed)
    batches = {}
    for tenant in tenants:
        batch = []
        for _ in range(rows):
            ids = [rng.randrange(3, vocab) for _ in range(seq)]
            batch.append({"input_ids": ids, "labels": [-100] * 4 + ids[4:]})
        batches[tenant] = batch
    return batches


def make_engine(path_or_id, tenants):
    engine = MultiLoraModel(path_or_id)
    for tenant, rank in tenants.items():
        engine.add_adapter_to_model(tenant, lora(rank))
        engine.set_optimizer("AdamW", adapter_name=tenant, lr=LR)
    return engine


class Phases:
    """(wall, CPU) seconds of each phase of a step, one entry per timed step."""

    def __init__(self):
        self.times: dict[str, list[tuple[float, float]]] = {}
        self.recording = False

    def clock(self) -> tuple[float, float]:
        return time.perf_counter(), time.process_time()

    def add(self, phase: str, since: tuple[float, float]) -> None:
        if self.recording:
            wall, cpu = self.clock()
            self.times.setdefault(phase, []).append((wall - since[0], cpu - since[1]))

    def summary(self) -> dict:
        return {
            phase: {
                "median_s": round(statistics.median(w for w, _ in t), 5),
                "median_cpu_s": round(statistics.median(c for _, c in t), 5),
            }
            for phase, t in self.times.items()
        }


class PeftSwitching:
    """The baseline: one peft model with every tenant's adapter, switched per tenant."""

    def __init__(self, path, ranks, batches):
        torch.manual_seed(0)
        tenants = list(ranks)
        self.model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
            lora(ranks[tenants[0]]),
            adapter_name=tenants[0],
        )
        for tenant in tenants[1:]:
            self.model.add_adapter(tenant, lora(ranks[tenant]))
        self.params, self.optimizers, self.tensors = {}, {}, {}
        for tenant in tenants:
            self.model.set_adapter(tenant)
            self.params[tenant] = [p for p in self.model.parameters() if p.requires_grad]
            self.optimizers[tenant] = torch.optim.AdamW(self.params[tenant], lr=LR)
            self.tensors[tenant] = (
                torch.tensor([r["input_ids"] for r in batches[tenant]]),
                torch.tensor([r["labels"] for r in batches[tenant]]),
            )

    def step(self, phases: Phases | None = None):
        for tenant, (ids, labels) in self.tensors.items():
            start = phases.clock() if phases else None
            self.model.set_adapter(tenant)
            logits = self.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
            )
            loss.backward()
            if phases:
                phases.add(f"pass_{tenant}", start)
                start = phases.clock()
            torch.nn.utils.clip_grad_norm_(self.params[tenant], 1.0)
            self.optimizers[tenant].step()
            self.optimizers[tenant].zero_grad(set_to_none=True)
            if phases:
                phases.add(f"optimizer_{tenant}", start)


def fused_step(engine, batches, phases: Phases | None = None):
    start = phases.clock() if phases else None
    engine.forward_backward_fused(batches)
    if phases:
        phases.add("pass", start)
        start = phases.clock()
    for tenant in batches:
        engine.clip_grad_and_step(adapter_name=tenant)
    if phases:
        phases.add("optimizer", start)


def base_pass(engine, batch_ids):
    """Forward + backward of the frozen base alone (every adapter off) over one batch of rows;
    the input embeddings take the gradient, so backward runs through every layer as in training."""
    ids = torch.tensor(batch_ids)
    engine.routing.set([(None, ids.shape[0], ids.shape[1])], training=True)
    try:
        embeds = engine.base.get_input_embeddings()(ids).detach().requires_grad_(True)
        logits = engine.base(inputs_embeds=embeds, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
    finally:
        engine.routing.clear()


def single_adapter(model_id, batches) -> tuple[MultiLoraModel, list[dict]]:
    engine = make_engine(model_id, {"all": 16})
    return engine, [row for batch in batches.values() for row in batch]


def single_step(engine, rows):
    engine.forward_backward(rows, adapter_name="all")
    engine.clip_grad_and_step(adapter_name="all")


def sequential_step(engine, batches):
    for tenant, batch in batches.items():
        engine.forward_backward(batch, adapter_name=tenant)
        engine.clip_grad_and_step(adapter_name=tenant)


def _per_phase(summary: dict) -> dict:
    """peft's per-tenant phases summed into one pass and one optimizer figure per step."""
    out = {}
    for phase in ("pass", "optimizer"):
        parts = [v for k, v in summary.items() if k.startswith(f"{phase}_")]
        out[phase] = {key: round(sum(p[key] for p in parts), 5) for key in ("median_s", "median_cpu_s")}
    return out


def measure(loops: dict, steps: int, warmup: int, recorders=()) -> dict[str, list[tuple[float, float]]]:
    """Alternate the loops step by step; (wall, process CPU) seconds per step of each. CPU time
    is the steadier figure on a shared machine: it does not count time spent waiting for a core.
    `recorders` (Phases) start recording once the warmup is over."""
    times = {name: [] for name in loops}
    for i in range(warmup + steps):
        for recorder in recorders:
            recorder.recording = i >= warmup
        for name, step in loops.items():
            start, cpu = time.perf_counter(), time.process_time()
            step()
            if i >= warmup:
                times[name].append((time.perf_counter() - start, time.process_time() - cpu))
    return times


def summary(times: list[tuple[float, float]], tokens: int) -> dict:
    median = statistics.median(w for w, _ in times)
    cpu = statistics.median(c for _, c in times)
    return {
        "median_s": round(median, 5),
        "tokens_per_s": round(tokens / median, 1),
        "median_cpu_s": round(cpu, 5),
        "tokens_per_cpu_s": round(tokens / cpu, 1),
        "all_s": [round(w, 5) for w, _ in times],
    }


def run_config(count: int, rows: int, seq: int, args) -> dict:
    ranks = tenants(count)
    path = resolve_model_path(args.model)
    engine = make_engine(args.model, ranks)
    batches = make_batches(ranks, rows, seq, engine.base.config.vocab_size)
    baseline = PeftSwitching(path, ranks, batches)
    tokens = sum(len(r["input_ids"]) for b in batches.values() for r in b)
    single_engine, all_rows = single_adapter(args.model, batches)
    fused_phases, peft_phases = Phases(), Phases()
    times = measure(
        {
            "fused": lambda: fused_step(engine, batches, fused_phases),
            "peft": lambda: baseline.step(peft_phases),
            "sequential": lambda: sequential_step(engine, batches),
            "single": lambda: single_step(single_engine, all_rows),
        },
        args.steps,
        args.warmup,
        recorders=(fused_phases, peft_phases),
    )
    rows_of = {tenant: [r["input_ids"] for r in batch] for tenant, batch in batches.items()}
    floor_times = measure(
        {
            "fused_rows": lambda: base_pass(engine, [ids for rows in rows_of.values() for ids in rows]),
            "per_tenant": lambda: [base_pass(engine, rows) for rows in rows_of.values()],
        },
        args.steps,
        args.warmup,
    )
    result = {name: summary(t, tokens) for name, t in times.items()}
    floor = {name: summary(t, tokens) for name, t in floor_times.items()}
    fused, peft, sequential = (result[k]["tokens_per_s"] for k in ("fused", "peft", "sequential"))
    return {
        "tenants": ranks,
        "rows_per_tenant": rows,
        "seq": seq,
        **result,
        "phases": {"fused": fused_phases.summary(), "peft": _per_phase(peft_phases.summary())},
        "base_floor": {
            **floor,
            "ratio": round(floor["fused_rows"]["tokens_per_s"] / floor["per_tenant"]["tokens_per_s"], 3),
        },
        "speedup_vs_engine_sequential": round(fused / sequential, 3),
        "fused_over_single": round(result["fused"]["median_s"] / result["single"]["median_s"], 3),
        "fused_over_single_cpu": round(result["fused"]["median_cpu_s"] / result["single"]["median_cpu_s"], 3),
        "cpu_speedup": round(result["fused"]["tokens_per_cpu_s"] / result["peft"]["tokens_per_cpu_s"], 3),
        "speedup": round(fused / peft, 3),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--configs", default="4x2x32,8x1x16", help="tenants x rows x tokens, comma-separated")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a twinkle:// preset, hub id or folder")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with torch.device("meta"):  # the structure only
        structure = describe(
            AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(resolve_model_path(args.model)))
        )
    LINEARS[:], EXPERTS[:] = structure.all_linear(), structure.expert_parameters("experts")
    configs = {}
    for config in args.configs.split(","):
        count, rows, seq = (int(v) for v in config.split("x"))
        configs[config] = run_config(count, rows, seq, args)
        print(json.dumps({config: configs[config]}))
    print(
        json.dumps(
            {
                "benchmark": "multi_lora_fused_small",
                "model": args.model,
                "expert_weights": len(EXPERTS),
                "threads": args.threads,
                "load_avg": os.getloadavg()[0],
                **{f"speedup_{k}": v["speedup"] for k, v in configs.items()},
                **{f"cpu_speedup_{k}": v["cpu_speedup"] for k, v in configs.items()},
                "fused_over_single": max(v["fused_over_single"] for v in configs.values()),
                "fused_over_single_cpu": max(v["fused_over_single_cpu"] for v in configs.values()),
                "configs": configs,
                "speedup": min(v["speedup"] for v in configs.values()),
            }
        )
    )


if __name__ == "__main__":
    main()
