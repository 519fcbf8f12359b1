# twinkle-kit's Usage Guide "Embedding Training" recipe, in its shape (written for this suite): the model on
# a Ray group of data-parallel ranks with ddp_config, InfoNCE with every rank's rows as in-batch negatives,
# clip_grad_and_step(gradient_accumulation_steps=) per call. The guide leaves its data and step count
# undefined; here a small list of [anchor, positive] features, repeated, is the dataloader.
import twinkle
from twinkle import DeviceGroup, DeviceMesh, get_logger
from twinkle.dataloader import DataLoader
from twinkle.loss import InfonceLoss
from twinkle.metric import EmbeddingMetric
from twinkle.model import TransformersModel
from twinkle.processor import InputProcessor
from twinkle.template import Qwen3_5Template

logger = get_logger()

MODEL_ID = "ms://Qwen/Qwen3.5-4B"
MODEL_GPUS = 4
BATCH_SIZE = 32
LEARNING_RATE = 1e-5
TEMPERATURE = 0.07
EMB_MAX_LENGTH = 8192
REPEATS = 6

PAIRS = [
    ("capital of Japan", "Tokyo is the capital of Japan."),
    ("boiling point of water", "Water boils at 100 degrees Celsius."),
    ("largest ocean", "The Pacific is the largest ocean."),
    ("author of Don Quixote", "Cervantes wrote Don Quixote."),
    ("speed of sound", "Sound travels about 343 metres a second in air."),
    ("tallest mountain", "Mount Everest is the highest mountain."),
    ("chemical symbol of gold", "Gold has the symbol Au."),
    ("number of continents", "There are seven continents."),
]

device_groups = [
    DeviceGroup(name="model", ranks=list(range(MODEL_GPUS)), device_type="GPU"),
]
model_mesh = DeviceMesh.from_sizes(world_size=MODEL_GPUS, dp_size=MODEL_GPUS)
twinkle.initialize(mode="ray", nproc_per_node=MODEL_GPUS, groups=device_groups)


def pair_features(template):
    features = []
    for anchor, positive in PAIRS:
        for text, label in ((anchor, 1), (positive, 0)):
            ids = template.tokenizer.encode(text)[:EMB_MAX_LENGTH]
            features.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": [label]})
    return features * REPEATS


def train():
    template = Qwen3_5Template(model_id=MODEL_ID, max_length=EMB_MAX_LENGTH, enable_thinking=False)
    # in order: each anchor beside its positive, each rank's slice whole groups
    dataloader = DataLoader(dataset=pair_features(template), batch_size=BATCH_SIZE, shuffle=False)
    total_steps = len(dataloader)

    model = TransformersModel(
        model_id=MODEL_ID,
        device_mesh=model_mesh,
        remote_group="model",
        ddp_config={"find_unused_parameters": True},
    )
    model.set_processor(InputProcessor)
    model.set_loss(InfonceLoss, temperature=TEMPERATURE, use_batch=True)
    model.set_optimizer(optimizer_cls="AdamW", lr=LEARNING_RATE)
    model.set_lr_scheduler(
        scheduler_cls="CosineWarmupScheduler",
        num_warmup_steps=200,
        num_training_steps=total_steps,
    )
    model.add_metric(EmbeddingMetric, is_training=True)

    for step, batch in enumerate(dataloader):
        model.forward_backward(inputs=batch, task="embedding")
        model.clip_grad_and_step(gradient_accumulation_steps=1)
        if step % 10 == 0:
            metric = model.calculate_metric(is_training=True)
            logger.info(f"Step {step}: {metric}")


if __name__ == "__main__":
    train()
