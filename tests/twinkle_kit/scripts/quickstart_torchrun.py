# The Quick-Start loop under torchrun (twinkle-kit's "torchrun" section, written for this suite): a
# DeviceMesh of FSDP x DP ranks declared up front, then the same loop as in one process.
from peft import LoraConfig

import twinkle
from twinkle import DeviceMesh, get_device_placement, get_logger
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.model import TransformersModel
from twinkle.preprocessor import SelfCognitionProcessor

device_mesh = DeviceMesh.from_sizes(fsdp_size=4, dp_size=2)
twinkle.initialize(mode="local", global_device_mesh=device_mesh)
logger = get_logger()


def train():
    dataset = Dataset(dataset_meta=DatasetMeta("ms://swift/self-cognition", data_slice=range(1000)))
    dataset.set_template("Qwen3_5Template", model_id="ms://Qwen/Qwen3.5-4B")
    dataset.map(SelfCognitionProcessor("twinkle LLM", "ModelScope Community"))
    dataset.encode()
    dataloader = DataLoader(dataset=dataset, batch_size=8)
    model = TransformersModel(model_id="ms://Qwen/Qwen3.5-4B")
    model.add_adapter_to_model(
        "default", LoraConfig(r=8, lora_alpha=32, target_modules="all-linear"), gradient_accumulation_steps=2
    )
    model.set_optimizer(optimizer_cls="AdamW", lr=1e-4)
    model.set_lr_scheduler(
        scheduler_cls="CosineWarmupScheduler", num_warmup_steps=5, num_training_steps=len(dataloader)
    )
    logger.info(get_device_placement())
    logger.info(model.get_train_configs())
    for step, batch in enumerate(dataloader):
        model.forward_backward(inputs=batch)
        model.clip_grad_and_step()
        if step % 20 == 0:
            logger.info(f"step {step} of {len(dataloader)}, metric: {model.calculate_metric(is_training=True)}")
    model.save(f"last-checkpoint")


if __name__ == "__main__":
    train()
