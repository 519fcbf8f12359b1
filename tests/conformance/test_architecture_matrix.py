"""The architecture conformance matrix (issue 26): every family in twinkle.model.families x
{train + save + peft loads it; loss = a hand-written transformers + peft loss; fused multi-tenant =
each tenant alone; the sampler serves the trained adapter with the trainer's log-probs; tp=2 = one
process or a refusal by name; torch.compile'd layers train as eager; LoRA coverage of what train_attn / train_mlp / train_unembed name}.

LoRA targets everywhere are the server's mapping of Tinker's flags (all three on). Cells are ✓,
"refused: <message>" (a refusal at construction that names the module and what to use instead),
or a percentage; a crash fails the test. The matrix is written to $CONFORMANCE_ARCH_MATRIX, else
printed after the session (conftest); docs/architecture-matrix.md is its committed copy.

fp32 throughout; tolerances are relative to the compared values' magnitude: what differs between
the two sides is summation order (padding, fused tenants' concatenation, sharded matmuls), ~1e-7
relative per op over a few dozen ops, so 1e-5 for forward values; gradients go through the
backward too, 1e-4.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import arch_cells as cells
import arch_tinker
import arch_tp_worker
import pytest
import torch
from arch_cells import cell, max_rel

from twinkle.model.families import FAMILIES

HERE = Path(__file__).parent
FORWARD, BACKWARD = 1e-5, 1e-4


class Family:
    """One family's engines, built once and shared by its cells (module-scoped)."""

    def __init__(self, name: str, folder: Path):
        self.name, self.folder = name, folder

    @functools.cached_property
    def transformers(self):
        """TransformersModel with the server's LoRA on a perturbed init, or its refusal message."""
        from twinkle.model import TransformersModel
        from twinkle.model.families import tiny_config

        torch.manual_seed(0)
        tm = TransformersModel(config=tiny_config(self.name))
        self.base = copy.deepcopy(tm.hf_model)  # the init weights, before peft wraps them
        self.config = cells.lora_config(tm.hf_model)
        try:
            tm.add_adapter_to_model("tinker", self.config)
        except ValueError as refusal:
            return str(refusal)
        cells.perturb(tm.states["tinker"].params, seed=1)
        tm.set_optimizer("AdamW", lr=1e-2)
        return tm

    @functools.cached_property
    def fused(self):
        from twinkle.model.families import tiny_model

        base = tiny_model(self.name)
        configs = {"alice": cells.lora_config(base, 4, 8), "bob": cells.lora_config(base, 2, 2)}
        return base, cells.multi_lora(base, configs)


@pytest.fixture(scope="module", params=FAMILIES)
def fam(request, tmp_path_factory):
    torch.set_num_threads(2)
    return Family(request.param, tmp_path_factory.mktemp(request.param))


def _refusal(fam, column, result):
    """TransformersModel refused this family's targets: the message names what to use instead."""
    message = fam.transformers
    assert "MultiLoraModel" in message, message
    result["cell"] = f"refused: {message}"


def test_train_save_and_peft_loads_it(fam):
    from peft import PeftModel

    with cell(fam.name, "peft") as result:
        tm = fam.transformers
        if isinstance(tm, str):
            return _refusal(fam, "peft", result)
        fam.first_loss = tm.forward_backward(cells.rows(1))["loss"]
        fam.init = copy.deepcopy(fam.base)
        fam.init_adapter = {k: v.detach().clone() for k, v in _adapter_state(tm).items()}
        tm.clip_grad_and_step()
        tm.forward_backward(cells.rows(2))
        tm.clip_grad_and_step()
        tm.save(fam.folder / "tinker", "tinker")
        loaded = PeftModel.from_pretrained(copy.deepcopy(fam.base), fam.folder / "tinker").eval()
        ids = torch.tensor([r["input_ids"] for r in cells.rows(3)])
        with torch.no_grad():
            got, want, plain = loaded(input_ids=ids).logits, tm.peft_model(input_ids=ids).logits, fam.base(ids).logits
        result.within(max_rel(got, want), FORWARD)
        assert max_rel(plain, want) > 1e-3  # the adapter changes the logits: the check has teeth


def _adapter_state(tm):
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(tm.peft_model, adapter_name="tinker", save_embedding_layers=False)


def test_loss_equals_handwritten_transformers_and_peft(fam):
    from peft import get_peft_model, set_peft_model_state_dict

    with cell(fam.name, "loss") as result:
        tm = fam.transformers
        if isinstance(tm, str):
            return _refusal(fam, "loss", result)
        if not hasattr(fam, "first_loss"):
            pytest.skip("needs test_train_save_and_peft_loads_it's first step")
        reference = get_peft_model(fam.init, copy.deepcopy(fam.config))
        missing = set_peft_model_state_dict(reference, fam.init_adapter).unexpected_keys
        assert not missing, missing
        want = cells.handwritten_loss(reference.eval(), cells.rows(1))
        result.within(abs(fam.first_loss - want) / want, FORWARD)
        plain = cells.handwritten_loss(fam.base, cells.rows(1))
        assert abs(plain - want) / want > 1e-3  # the perturbed adapter changes the loss: the check has teeth


def test_fused_tenants_equal_each_alone(fam):
    with cell(fam.name, "fused") as result:
        _, model = fam.fused
        data = {"alice": cells.rows(4, 2, 9), "bob": cells.rows(5, 3, 7)}
        fused = model.forward_backward_fused(data)
        fused_grads = {n: [p.grad.clone() for p in model.adapters[n].params] for n in data}
        for name in data:
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.adapters[name].params)
            _zero(model, name)
        for name, batch in data.items():
            alone = model.forward_backward_fused({name: batch})[name]
            result.within(abs(alone["loss"] - fused[name]["loss"]) / fused[name]["loss"], FORWARD)
            for p, g in zip(model.adapters[name].params, fused_grads[name]):
                result.within(max_rel(p.grad, g), BACKWARD)
            _zero(model, name)


def _zero(model, name):
    for p in model.adapters[name].params:
        p.grad = None


def test_sampler_serves_the_trained_adapter(fam):
    from twinkle.sampler import SamplingParams, TorchSampler

    with cell(fam.name, "sampler") as result:
        trainer = fam.transformers
        if isinstance(trainer, str):
            base, trainer = fam.fused  # TransformersModel refused this family: the fused engine's tenant
            trainer.save(fam.folder / "tinker", "alice")
            adapter, result["cell"] = "alice", "✓ (MultiLoraModel's adapter)"
        else:
            base, adapter = fam.base, "tinker"
            if not (fam.folder / "tinker").exists():  # run alone: the perturbed adapter, untrained
                trainer.save(fam.folder / "tinker", "tinker")
        sampler = TorchSampler(model=copy.deepcopy(base))
        sampler.load_adapter("t", fam.folder / "tinker")
        params = SamplingParams(max_tokens=6, temperature=0)
        tuned = sampler.sample(cells.PROMPTS, params, adapter_name=["t", "t"])
        plain = sampler.sample(cells.PROMPTS, params, adapter_name=[None, None])
        differs = False
        for prompt, response, untuned in zip(cells.PROMPTS, tuned, plain):
            seq = response.sequences[0]
            ids = prompt + seq.tokens
            expected = trainer.forward_only([{"input_ids": ids, "labels": ids}], adapter)["logprobs"][0][len(prompt) :]
            result.within(max_rel(seq.logprobs, expected), FORWARD)
            differs |= max_rel(untuned.sequences[0].logprobs, seq.logprobs) > 1e-3
        assert differs  # without the adapter the sampler's log-probs differ: it did serve it


@pytest.fixture(scope="module")
def tp_ranks(tmp_path_factory):
    """ONE torchrun launch (2 gloo ranks) builds every family at tp=2."""
    folder = tmp_path_factory.mktemp("tp")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    done = subprocess.run([*cmd, str(HERE / "arch_tp_worker.py"), str(folder)], env=env, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]


def test_tp2_equals_one_process_or_refuses_by_name(fam, tp_ranks):
    import twinkle.mesh as tm

    with cell(fam.name, "tp2") as result:
        ranks = [r[fam.name] for r in tp_ranks]
        if "refused" in ranks[0]:
            message = ranks[0]["refused"]
            assert ranks[1] == ranks[0]
            assert re.search(rf"cannot shard model\.\S+ \({fam.name}\): .*tp_size=1", message), message
            result["cell"] = f"refused: {message}"
            return
        one = arch_tp_worker.train(fam.name, tm.DeviceMesh.from_sizes(dp_size=1))
        for rank in ranks:
            assert rank["sharded"] >= 2 * 7  # q/k/v/o/gate/up/down of both layers at least
            result.within(max_rel(rank["losses"], one["losses"]), FORWARD)
            result.within(max_rel(rank["logprobs"], one["logprobs"]), FORWARD)


def _two_steps(family: str, compile: bool) -> tuple[list[float], list[list[float]]]:
    """The server's LoRA on a perturbed init, two steps, then the log-probs of a third batch."""
    from twinkle.model import TransformersModel
    from twinkle.model.families import tiny_config

    torch.manual_seed(0)
    tm = TransformersModel(config=tiny_config(family), compile=compile)
    tm.add_adapter_to_model("tinker", cells.lora_config(tm.hf_model))
    cells.perturb(tm.states["tinker"].params, seed=1)
    tm.set_optimizer("AdamW", lr=1e-2)
    losses = []
    for seed in (1, 2):
        losses.append(tm.forward_backward(cells.rows(seed))["loss"])
        tm.clip_grad_and_step()
    return losses, tm.forward_only(cells.rows(3))["logprobs"]


def test_compiled_layers_train_as_eager(fam):
    with cell(fam.name, "compile") as result:
        if isinstance(fam.transformers, str):
            return _refusal(fam, "compile", result)
        torch._dynamo.reset()  # as in a fresh process: the families before it filled dynamo's caches
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        losses, logps = _two_steps(fam.name, compile=True)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs  # inductor compiled something
        eager_losses, eager_logps = _two_steps(fam.name, compile=False)
        result.within(abs(losses[0] - eager_losses[0]) / eager_losses[0], FORWARD)
        result.within(abs(losses[1] - eager_losses[1]) / eager_losses[1], BACKWARD)  # after a step
        result.within(max_rel(torch.tensor(logps[0]), torch.tensor(eager_logps[0])), BACKWARD)
        assert losses[1] != losses[0]  # the step trained


def test_lora_covers_everything_the_flags_name(fam):
    with cell(fam.name, "coverage") as result:
        base, model = fam.fused
        named = cells.named_by_flags(base)
        modules = set(model.adapters["alice"].module_names)
        experts = {f"{m}.{w}" for m, weights in model.expert_targets("alice").items() for w in weights}
        covered = {n for n in named if n.rsplit(".", 1)[0] in modules or n in experts}
        share = sum(named[n] for n in covered) / sum(named.values())
        result["cell"] = f"{100 * share:.0f}%"
        assert share == 1.0, sorted(set(named) - covered)
        tm = fam.transformers
        if not isinstance(tm, str):  # TransformersModel (peft) adapts the same weights: the same saved keys
            ours = {k.replace(".alice.", ".") for k in model.adapter_state_dict("alice")}
            assert set(_adapter_state(tm)) == ours


@pytest.fixture(scope="module")
def tinker_server(tmp_path_factory):
    pytest.importorskip("tinker")
    server = arch_tinker.start_server(tmp_path_factory.mktemp("tinker"), FAMILIES)
    yield server
    server.stop()


def test_tinker_sdk_trains_and_samples(fam, tinker_server):
    with cell(fam.name, "tinker") as result:
        out = arch_tinker.run(tinker_server, fam.name)
        assert out["arch"] == fam.name
        assert out["losses"][1] < out["losses"][0], out["losses"]  # the step trained
        result.within(max_rel(out["served"], out["trained"]), FORWARD)
        assert max_rel(out["untrained"], out["trained"]) > 10 * FORWARD  # the served adapter matters
        assert len(out["sampled"]) == 3
