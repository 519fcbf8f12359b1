"""The cost of the Ray remote group: one LoRA training step of the same global batch, run
(a) in local mode, in this process, and (b) as a 2-actor Ray remote group (DDP over gloo, each
actor one thread, so both sides use the machine's two cores). Prints a final JSON line with
`ratio` = ray step time / local step time (medians) and the raw per-step times. The two
alternate step by step, so load from other processes on the machine hits both alike.

    uv run benchmarks/bench_ray_remote_group.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import twinkle.mesh as tm
from twinkle.mesh import DeviceGroup, DeviceMesh, RemoteClass, remote_method


def make_rows(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, vocab, (length,), generator=g).tolist()} for _ in range(n)]


class BenchTrainer(metaclass=RemoteClass):
    """Plain torch + peft LoRA step; the loss is the global-batch token mean on every layout."""

    def __init__(self, model_id: str, device_mesh: DeviceMesh | None = None, threads: int = 2):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        from twinkle.hub import resolve_model_path

        torch.set_num_threads(threads)
        self.mesh = device_mesh or tm.get_global_mesh()
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(resolve_model_path(model_id), dtype=torch.float32)
        self.model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
        self.group = None
        if self.mesh.data_world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.group = self.mesh.get_group("data")
            self.model = DistributedDataParallel(self.model, process_group=self.group)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-4)

    @remote_method(dispatch="slice", collect="first")
    def train_step(self, rows: list[dict]) -> float:
        ids_B_T = torch.tensor([r["input_ids"] for r in rows])
        logits_B_T_V = self.model(input_ids=ids_B_T).logits
        loss_sum = F.cross_entropy(
            logits_B_T_V[:, :-1].reshape(-1, logits_B_T_V.shape[-1]), ids_B_T[:, 1:].reshape(-1), reduction="sum"
        )
        tokens = torch.tensor(float(ids_B_T[:, 1:].numel()))
        if self.group is not None:
            dist.all_reduce(tokens, group=self.group)
        (loss_sum / tokens * self.mesh.data_world_size).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.group is not None:
            loss_sum = loss_sum.detach().clone()
            dist.all_reduce(loss_sum, group=self.group)
        return (loss_sum / tokens).item()

    @remote_method(collect="first")
    def vocab_size(self) -> int:
        model = self.model.module if hasattr(self.model, "module") else self.model
        return model.config.vocab_size


def main() -> None:
    from twinkle.hub import DEFAULT_MODEL

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--steps", type=int, default=8, help="timed steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    parser.add_argument("--length", type=int, default=128, help="tokens per row")
    parser.add_argument("--local-threads", type=int, default=2, help="torch threads of the local step")
    args = parser.parse_args()

    start = time.perf_counter()
    tm.initialize(mode="ray", groups=[DeviceGroup("model", 2, "cpu")])
    ray_init_s = time.perf_counter() - start
    # Built without remote_group: the local-mode object, in this process.
    local = BenchTrainer(args.model, threads=args.local_threads)
    local_1thread = BenchTrainer(args.model, threads=1)
    start = time.perf_counter()
    remote = BenchTrainer(args.model, device_mesh=DeviceMesh.from_sizes(dp_size=2), threads=1, remote_group="model")
    group_start_s = time.perf_counter() - start
    vocab = local.vocab_size()
    batches = [make_rows(args.batch, args.length, vocab, seed=i) for i in range(args.warmup + args.steps)]

    # Interleaved, so drifting load from other processes on the machine hits every side alike. The
    # local step also runs on one thread: on a loaded machine multi-threaded torch can stall on
    # descheduled threads, and the one-thread time shows when that is what the ratio measures.
    times: dict[str, list[float]] = {"local": [], "local_1thread": [], "ray": []}
    losses: dict[str, list[float]] = {"local": [], "local_1thread": [], "ray": []}
    for i, batch in enumerate(batches):
        for name, trainer in (("local", local), ("local_1thread", local_1thread), ("ray", remote)):
            torch.set_num_threads(1 if name == "local_1thread" else args.local_threads)
            start = time.perf_counter()
            losses[name].append(trainer.train_step(batch))
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    remote.remote_shutdown()

    local_s, ray_s = statistics.median(times["local"]), statistics.median(times["ray"])
    local1_s = statistics.median(times["local_1thread"])
    print(
        json.dumps(
            {
                "benchmark": "ray_remote_group_step",
                "model": args.model,
                "global_batch": args.batch,
                "tokens_per_row": args.length,
                "timed_steps": args.steps,
                "ray_ranks": 2,
                "ray_threads_per_rank": 1,
                "local_threads": args.local_threads,
                "ratio": round(ray_s / local_s, 3),
                "local_step_s": round(local_s, 4),
                "ray_step_s": round(ray_s, 4),
                "local_1thread_step_s": round(local1_s, 4),
                "ratio_vs_local_1thread": round(ray_s / local1_s, 3),
                "local_times_s": [round(t, 4) for t in times["local"]],
                "ray_times_s": [round(t, 4) for t in times["ray"]],
                "local_1thread_times_s": [round(t, 4) for t in times["local_1thread"]],
                "ray_init_s": round(ray_init_s, 2),
                "ray_group_start_s": round(group_start_s, 2),
                # Same batches, same init, same optimizer: the three runs must agree (a correctness guard).
                "max_loss_diff": max(
                    abs(a - b) for name in ("local", "local_1thread") for a, b in zip(losses[name], losses["ray"])
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
