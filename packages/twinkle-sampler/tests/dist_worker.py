"""One rank of the torch.distributed weight-sync test (spawned; importable by module name)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

PROMPT = [11, 22, 33, 44, 55]


def run(rank: int, world: int, port: int, model_path: str, out_dir: str) -> None:
    from contract_model import hf_greedy, make_trainer

    from twinkle.checkpoint_engine import BroadcastCheckpointEngine
    from twinkle.sampler import SamplingParams, TorchSampler, extract_adapter

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    engine = BroadcastCheckpointEngine(src=0)
    out = Path(out_dir)
    try:
        if rank == 0:  # the trainer: sync, take a real optimizer step, sync again
            trainer = make_trainer(model_path, adapters=("policy",))
            versions = [engine.sync(trainer, None, "policy")]
            params = [p for n, p in trainer.named_parameters() if "lora_" in n]
            optimizer = torch.optim.SGD(params, lr=0.5)
            ids = torch.tensor([[*PROMPT, 66, 77, 88]])
            trainer.train()
            trainer(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            trainer.eval()
            versions.append(engine.sync(trainer, None, "policy"))
            w = extract_adapter(trainer, "policy")
            torch.save({"A": w.lora_A, "B": w.lora_B, "scaling": w.scaling}, out / "trainer.pt")
            result = {"versions": versions, "greedy": hf_greedy(trainer, PROMPT, 8, "policy")}
        else:  # a sampler rank
            sampler = TorchSampler(model_path)
            versions = [engine.sync(None, sampler, "policy"), engine.sync(None, sampler, "policy")]
            w = sampler.router.adapters["policy"]
            torch.save({"A": w.lora_A, "B": w.lora_B, "scaling": w.scaling}, out / f"sampler{rank}.pt")
            response = sampler.sample([PROMPT], SamplingParams(max_tokens=8, temperature=0), adapter_name="policy")[0]
            result = {
                "versions": versions,
                "greedy": response.sequences[0].tokens,
                "weight_version": response.weight_version,
            }
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
