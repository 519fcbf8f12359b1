# LoRA SFT against a running server through twinkle-kit's client, in the shape of its cookbook
# client/twinkle/self_cognition.py (written for this suite): list the server's models and runs, train,
# save with the data position, read the training configs.
import dotenv

dotenv.load_dotenv(".env")

import os

from peft import LoraConfig

from twinkle import get_logger, init_twinkle_client
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle_client.model import MultiLoraTransformersModel

logger = get_logger()
base_model = os.environ.get("TWINKLE_MODEL_ID", "Qwen/Qwen3.5-4B")
client = init_twinkle_client(
    base_url=os.environ.get("TWINKLE_SERVER_URL", "http://localhost:8000"),
    api_key=os.environ.get("TWINKLE_SERVER_TOKEN", "EMPTY_TOKEN"),
)
for item in client.get_server_capabilities().supported_models:
    print("- " + item.model_name)
for run in client.list_training_runs():
    logger.info(run.model_dump_json(indent=2))
    for checkpoint in client.list_checkpoints(run.training_run_id):
        logger.info(checkpoint.model_dump_json(indent=2))


def train():
    dataset = Dataset(dataset_meta=DatasetMeta("ms://swift/self-cognition", data_slice=range(500)))
    dataset.set_template("Qwen3_5Template", model_id=f"ms://{base_model}", max_length=512)
    dataset.map("SelfCognitionProcessor", init_args={"model_name": "twinkle模型", "model_author": "ModelScope社区"})
    dataset.encode(batched=True)
    dataloader = DataLoader(dataset=dataset, batch_size=4)
    model = MultiLoraTransformersModel(model_id=f"ms://{base_model}")
    model.add_adapter_to_model("default", LoraConfig(target_modules="all-linear"), gradient_accumulation_steps=2)
    model.set_template("Qwen3_5Template")
    model.set_processor("InputProcessor", padding_side="right")
    model.set_loss("CrossEntropyLoss")
    model.set_optimizer("Adam", lr=1e-4)
    logger.info(model.get_train_configs().model_dump())
    max_steps, global_step = 10, 0
    for epoch in range(3):
        for cur_step, batch in enumerate(dataloader, start=1):
            model.forward_backward(inputs=batch)
            model.clip_grad_and_step()
            global_step += 1
            if cur_step % 2 == 0:
                logger.info(
                    f"step {cur_step} of {len(dataloader)}, metric: {model.calculate_metric(is_training=True).result}"
                )
            if global_step >= max_steps:
                break
        if global_step >= max_steps:
            break
        twinkle_path = model.save(
            name=f"twinkle-epoch-{epoch}",
            save_optimizer=True,
            consumed_train_samples=dataloader.get_state()["consumed_train_samples"],
        )
        logger.info(f"Saved checkpoint: {twinkle_path}")


if __name__ == "__main__":
    train()
