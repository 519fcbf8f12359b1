"""One checkpoint format between the library and the server (twinkle.model.checkpoint), both ways:

- a checkpoint TransformersModel saved locally resumes on the server through the native API and the
  Tinker SDK, and the server's next step equals a local MultiLoraModel's next step from the same
  checkpoint bit for bit (the server's engine is MultiLoraModel; versus TransformersModel's own next
  step the difference is the engines' summation order, as in twinkle-model's interop test);
- a checkpoint either API saved resumes in TransformersModel and loads with
  peft.AutoPeftModelForCausalLM from its folder alone.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file

from twinkle.hub import TEST_MODEL, resolve_model_path
from twinkle.model import TransformersModel
from twinkle.model.multi_lora import MultiLoraModel

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
OPTIMIZER = {"lr": 1e-2, "weight_decay": 0.01}
SCHEDULER = {"num_warmup_steps": 1, "num_training_steps": 10}
TINKER_ADAM = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-12, "weight_decay": 0.0}  # SDK AdamParams defaults
CROSS_ENGINE_ATOL = 1e-5  # peft's LoRA layer and the fused multi-LoRA layer add the same terms in another order
TENANT = "ckpt-fmt"


@pytest.fixture(scope="module")
def rows():
    from twinkle.template import Template

    template = Template(model_id=TEST_MODEL)
    chats = [
        [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "I am Glimmer."}],
        [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}],
    ]
    return [template.encode({"messages": chat}) for chat in chats]


@pytest.fixture(scope="module")
def clients(server):
    import tinker

    from twinkle.client import TwinkleClient

    key = server.create_key(TENANT)
    return TwinkleClient(server.url, key), tinker.ServiceClient(base_url=server.url, api_key=key)


def configure(model):
    model.set_loss("CrossEntropyLoss")
    model.set_optimizer("AdamW", **OPTIMIZER)
    model.set_lr_scheduler("CosineWarmupScheduler", **SCHEDULER)


def folder_of(server, path):
    from twinkle.serve.core.checkpoints import CheckpointOps

    ops = CheckpointOps(server.runtime)
    return ops.folder(ops.readable(TENANT, path))


def give_tenant(server, client, name, source, rank=4):
    """What an operator does to hand a tenant a checkpoint made elsewhere: the folder goes into the
    tenant's checkpoint store (under a native run of theirs), as the server's own saves do."""
    from twinkle.client.model import TransformersModel as Remote
    from twinkle.serve.core.checkpoints import CheckpointOps

    run = server.runtime.store.runs.get(Remote(model_id=TEST_MODEL, client=client).model_id)

    def fill(staging):
        shutil.copytree(source, staging, dirs_exist_ok=True)
        return {"lora": {"rank": rank, "train_attn": True, "train_mlp": False, "train_unembed": False}}

    return CheckpointOps(server.runtime).write(run, "training", name, fill).tinker_path


def weights(folder):
    return load_file(str(folder / "adapter_model.safetensors"))


def assert_bit_equal(got: dict, expected: dict):
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k].detach()) for k in got), [
        k for k in got if not torch.equal(got[k], expected[k].detach())
    ][:3]


def tinker_row(tokens):
    """A Tinker SFT datum as the backend feeds MultiLoraModel (serve/backend/multi_lora_backend.py)."""
    return {"input_ids": tokens, "labels": [-100, *tokens[1:]], "weights": [0.0] + [1.0] * (len(tokens) - 1)}


@pytest.fixture(scope="module")
def local_checkpoint(rows, tmp_path_factory):
    """TransformersModel after two steps, saved with its training state; and its own third step."""
    torch.manual_seed(0)
    model = TransformersModel(model_id=TEST_MODEL)
    model.add_adapter_to_model("default", LoraConfig(**LORA))
    configure(model)
    for _ in range(2):
        model.forward_backward(inputs=rows)
        assert model.clip_grad_and_step()["stepped"]
    folder = tmp_path_factory.mktemp("local") / "ckpt"
    model.save(folder, save_training_state=True)
    model.forward_backward(inputs=rows)
    model.clip_grad_and_step()
    model.save(folder.parent / "third")
    return folder, weights(folder.parent / "third")


def test_a_local_checkpoint_resumes_bit_exact_over_the_native_api(server, clients, rows, local_checkpoint):
    from twinkle.client.model import TransformersModel as Remote

    folder, transformers_third = local_checkpoint
    reference = MultiLoraModel(TEST_MODEL)
    reference.load(folder, "default")
    configure(reference)
    reference.resume_from_checkpoint(folder, "default")
    reference.forward_backward(inputs=rows)
    reference.clip_grad_and_step()

    path = give_tenant(server, clients[0], "from-local", folder)
    remote = Remote(model_id=TEST_MODEL, client=clients[0])
    remote.load(path).result()
    configure(remote)
    assert remote.resume_from_checkpoint(path).result()["optimizer_steps"] == 2
    remote.forward_backward(inputs=rows)
    assert remote.clip_grad_and_step().result()["step"] == 3
    got = weights(folder_of(server, remote.save("third").result()))
    assert_bit_equal(got, reference.adapter_state_dict("default"))
    assert max((got[k] - transformers_third[k]).abs().max().item() for k in got) <= CROSS_ENGINE_ATOL


def test_a_local_checkpoint_resumes_bit_exact_through_the_tinker_sdk(server, clients, rows, sft, local_checkpoint):
    from tinker import types

    folder, _ = local_checkpoint
    tokens = [row["input_ids"] for row in rows]
    reference = MultiLoraModel(TEST_MODEL)
    reference.load(folder, "default")
    configure(reference)  # the saved schedule needs a scheduler to land in; Tinker's lr then comes per step
    reference.resume_from_checkpoint(folder, "default")
    state = reference.adapters["default"]
    state.scheduler = None
    state.set_loss("cross_entropy", reduction="sum")
    for group in state.optimizer.param_groups:
        group.update(TINKER_ADAM)
    reference.forward_backward(inputs=[tinker_row(t) for t in tokens])
    reference.clip_grad_and_step(max_grad_norm=None)

    path = give_tenant(server, clients[0], "from-local-tinker", folder)
    training = clients[1].create_training_client_from_state_with_optimizer(path)
    training.forward_backward([sft(t) for t in tokens], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=TINKER_ADAM["lr"])).result()
    got = weights(folder_of(server, training.save_state("third").result().path))
    assert_bit_equal(got, reference.adapter_state_dict("default"))


def check_loads_locally(folder, rows, optimizer_steps, scheduler: bool):
    """TransformersModel resumes the server's folder bit-exact; AutoPeftModel loads it by itself."""
    from peft import AutoPeftModelForCausalLM

    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(resolve_model_path(TEST_MODEL))  # not twinkle://
    assert config["peft_type"] == "LORA" and "peft_version" in config  # written by peft itself
    local = TransformersModel(model_id=TEST_MODEL)
    local.load(folder)
    local.set_optimizer("AdamW", **OPTIMIZER)
    if scheduler:
        local.set_lr_scheduler("CosineWarmupScheduler", **SCHEDULER)
    assert local.resume_from_checkpoint(folder)["optimizer_steps"] == optimizer_steps
    from peft import get_peft_model_state_dict

    saved = weights(folder)
    assert_bit_equal(get_peft_model_state_dict(local.peft_model, adapter_name="default"), saved)
    peft_model = AutoPeftModelForCausalLM.from_pretrained(str(folder)).eval()
    ids = torch.tensor([rows[0]["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(
            peft_model(input_ids=ids).logits, local.peft_model.eval()(input_ids=ids).logits, atol=1e-6
        )


def test_a_native_checkpoint_loads_locally(server, clients, rows):
    from twinkle.client.model import TransformersModel as Remote

    remote = Remote(model_id=TEST_MODEL, client=clients[0])
    remote.add_adapter_to_model("default", LORA)
    configure(remote)
    remote.forward_backward(inputs=rows)
    remote.clip_grad_and_step()
    folder = folder_of(server, remote.save("native-out", save_training_state=True).result())
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "training_state/state.json",
        "training_state/state.safetensors",
        "twinkle_checkpoint.json",
    ]
    check_loads_locally(folder, rows, 1, scheduler=True)


def test_a_tinker_checkpoint_loads_locally(server, clients, rows, sft):
    from tinker import types

    training = clients[1].create_lora_training_client(
        base_model=TEST_MODEL, rank=4, train_mlp=False, train_unembed=False
    )
    training.forward_backward([sft(row["input_ids"]) for row in rows], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    folder = folder_of(server, training.save_state("tinker-out").result().path)
    assert LoraConfig.from_pretrained(str(folder)).lora_alpha == 32  # the Tinker adapter's own config
    check_loads_locally(folder, rows, 1, scheduler=False)


def test_a_hub_model_s_adapters_name_the_hub_id(tmp_path):
    """Served as `hf://org/name` (here from its local folder: no hub is reachable), a checkpoint names
    `org/name`, so AutoPeftModelForCausalLM finds the base wherever the folder goes."""
    from twinkle.serve.backend import LoraSpec
    from twinkle.serve.backend.multi_lora_backend import MultiLoraBackend

    backend = MultiLoraBackend("hf://Qwen/Qwen3-0.6B", str(resolve_model_path(TEST_MODEL)), max_batch_size=1)
    backend.create_adapter("a", LoraSpec(rank=2, seed=1, train_mlp=False, train_unembed=False))
    backend.save_checkpoint("a", tmp_path / "hub", training_state=False)
    assert (
        json.loads((tmp_path / "hub" / "adapter_config.json").read_text())["base_model_name_or_path"]
        == "Qwen/Qwen3-0.6B"
    )
    assert LoraConfig.from_pretrained(str(tmp_path / "hub")).r == 2
