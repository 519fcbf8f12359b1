# A LoRA SFT loop in one process, in the shape of twinkle-kit's Quick-Start "Single GPU" section
# (written for this suite, not copied): dataset -> template -> dataloader -> model -> loop -> save.
from peft import LoraConfig

from twinkle import get_device_placement, get_logger
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.model import TransformersModel
from twinkle.preprocessor import SelfCognitionProcessor

logger = get_logger()


def train():
    # a slice longer than the data: twinkle-kit wraps around
    dataset = Dataset(dataset_meta=DatasetMeta("ms://swift/self-cognition", data_slice=range(1000)))
    dataset.set_template("Qwen3_5Template", model_id="ms://Qwen/Qwen3.5-4B")
    dataset.map(SelfCognitionProcessor("twinkle LLM", "ModelScope Community"))
    dataset.encode()
    dataloader = DataLoader(dataset=dataset, batch_size=8)
    model = TransformersModel(model_id="ms://Qwen/Qwen3.5-4B")
    lora_config = LoraConfig(r=8, lora_alpha=32, target_modules="all-linear")
    model.add_adapter_to_model("default", lora_config, gradient_accumulation_steps=2)
    model.set_optimizer(optimizer_cls="AdamW", lr=1e-4)
    model.set_lr_scheduler(
        scheduler_cls="CosineWarmupScheduler", num_warmup_steps=5, num_training_steps=len(dataloader)
    )
    logger.info(get_device_placement())
    logger.info(model.get_train_configs())
    logger.info(f"Total steps: {len(dataloader)}")
    for step, batch in enumerate(dataloader):
        model.forward_backward(inputs=batch)
        model.clip_grad_and_step()
        if step % 20 == 0:
            metric = model.calculate_metric(is_training=True)
            logger.info(f"Current is step {step} of {len(dataloader)}, metric: {metric}")
    model.save(f"last-checkpoint")


if __name__ == "__main__":
    train()
