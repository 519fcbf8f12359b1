"""Supervised fine-tuning with a LoRA: the seed's SFT loop, run on the embedded default model.

    uv run python examples/sft.py                      # one process
    uv run torchrun --nproc_per_node=2 examples/sft.py # data parallel over two ranks

On a GPU machine with hub access, set BASE to a hub id (e.g. 'ms://Qwen/Qwen3.5-4B').
"""

import logging
import os

from peft import LoraConfig

import twinkle
from twinkle import DeviceGroup, DeviceMesh
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.hub import DEFAULT_MODEL
from twinkle.model import TransformersModel, num_training_steps
from twinkle.preprocessor import SelfCognitionProcessor

BASE = os.environ.get("TWINKLE_SFT_MODEL", DEFAULT_MODEL)
OUTPUT = os.environ.get("TWINKLE_SFT_OUTPUT", "last-checkpoint")

groups = [DeviceGroup(name="default", ranks=1, device_type="cpu")]
mesh = DeviceMesh.from_sizes(dp_size=int(os.environ.get("WORLD_SIZE", "1")))
twinkle.initialize(mode="local", global_device_mesh=mesh)  # or mode='ray', groups=groups


def train():
    # a slice of the bundled self-cognition dataset: 'data_slice' picks rows
    dataset = Dataset(dataset_meta=DatasetMeta("twinkle://self-cognition", data_slice=range(200)))
    dataset.set_template("Template", model_id=BASE, max_length=256)
    dataset.map(SelfCognitionProcessor("Glimmer", "Lantern Labs"))  # fills the name/author placeholders
    dataset.encode()

    dataloader = DataLoader(dataset=dataset, batch_size=8, min_batch_size=8)
    model = TransformersModel(model_id=BASE)  # remote_group='default' in ray mode

    model.add_adapter_to_model(
        "default", LoraConfig(r=8, lora_alpha=32, target_modules="all-linear"), gradient_accumulation_steps=2
    )
    model.set_optimizer(optimizer_cls="AdamW", lr=1e-4)
    model.set_lr_scheduler(
        scheduler_cls="CosineWarmupScheduler",
        num_warmup_steps=5,
        num_training_steps=num_training_steps(len(dataloader), gradient_accumulation_steps=2),
    )

    for step, batch in enumerate(dataloader):
        model.forward_backward(inputs=batch)
        model.clip_grad_and_step()  # steps only on accumulation boundaries
        if step % 20 == 0:
            print(step, model.calculate_metric(is_training=True))
    model.save(OUTPUT)  # a PEFT folder for a LoRA


if __name__ == "__main__":
    logging.basicConfig(level=os.environ.get("TWINKLE_LOG_LEVEL", "WARNING"))
    train()
