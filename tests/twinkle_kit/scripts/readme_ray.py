# twinkle-kit's README "Train with Ray", in its shape (written for this suite): a DeviceGroup of
# actors, the model built on it with remote_group=, the loop unchanged.
from peft import LoraConfig

import twinkle
from twinkle import DeviceGroup, DeviceMesh
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.model import TransformersModel
from twinkle.preprocessor import SelfCognitionProcessor

device_group = [DeviceGroup(name="default", ranks=8, device_type="cuda")]
device_mesh = DeviceMesh.from_sizes(fsdp_size=4, dp_size=2)
twinkle.initialize(mode="ray", groups=device_group, global_device_mesh=device_mesh)


def train():
    base_model = "ms://Qwen/Qwen3.6-27B"
    dataset = Dataset(dataset_meta=DatasetMeta("ms://swift/self-cognition", data_slice=range(1000)))
    dataset.set_template("Qwen3_5Template", model_id=base_model)
    dataset.map(SelfCognitionProcessor("twinkle LLM", "ModelScope Community"))
    dataset.encode()
    dataloader = DataLoader(dataset=dataset, batch_size=8, min_batch_size=8)
    model = TransformersModel(model_id=base_model, remote_group="default")
    model.add_adapter_to_model(
        "default", LoraConfig(r=8, lora_alpha=32, target_modules="all-linear"), gradient_accumulation_steps=2
    )
    model.set_optimizer(optimizer_cls="AdamW", lr=1e-4)
    model.set_lr_scheduler(
        scheduler_cls="CosineWarmupScheduler", num_warmup_steps=5, num_training_steps=len(dataloader)
    )
    for step, batch in enumerate(dataloader):
        model.forward_backward(inputs=batch)
        model.clip_grad_and_step()
        if step % 20 == 0:
            print(f"Current is step {step} of {len(dataloader)}, metric: {model.calculate_metric(is_training=True)}")
    model.save(f"last-checkpoint")


if __name__ == "__main__":
    train()
