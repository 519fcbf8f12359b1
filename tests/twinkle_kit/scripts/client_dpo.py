# LoRA DPO against a running server through twinkle-kit's client, in the shape of its cookbook
# client/twinkle/dpo.py (written for this suite): preference pairs interleaved chosen/rejected, the base
# model (adapter off) as the reference, DPO loss plus an SFT term on the chosen side.
import dotenv

dotenv.load_dotenv(".env")

import os
from typing import Any, Dict, List

from peft import LoraConfig

from twinkle import get_logger
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.preprocessor import EmojiDPOProcessor
from twinkle_client import init_twinkle_client
from twinkle_client.model import MultiLoraTransformersModel

logger = get_logger()
base_model = os.environ.get("TWINKLE_MODEL_ID", "Qwen/Qwen3.5-4B")
client = init_twinkle_client(
    base_url=os.environ.get("TWINKLE_SERVER_URL", "http://localhost:8000"),
    api_key=os.environ.get("TWINKLE_SERVER_TOKEN", "EMPTY_TOKEN"),
)


def create_dpo_dataset():
    dataset = Dataset(DatasetMeta("ms://hjh0119/shareAI-Llama3-DPO-zh-en-emoji", data_slice=range(100)))
    dataset.set_template("Qwen3_5Template", model_id=f"ms://{base_model}", max_length=2048)
    dataset.map(EmojiDPOProcessor, init_args={"system": "You are a helpful assistant."})
    dataset.encode()
    return dataset


def interleave(batch: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    pairs = []
    for row in batch:
        shared = {k: v for k, v in row.items() if k not in ("positive", "negative")}
        pairs += [{**shared, **row["positive"]}, {**shared, **row["negative"]}]
    return pairs


def train():
    dataloader = DataLoader(dataset=create_dpo_dataset(), batch_size=4)
    model = MultiLoraTransformersModel(model_id=f"ms://{base_model}")
    model.add_adapter_to_model(
        "default", LoraConfig(target_modules="all-linear", r=8, lora_alpha=32), gradient_accumulation_steps=2
    )
    model.set_template("Qwen3_5Template")
    model.set_processor("InputProcessor", padding_side="right")
    model.set_loss("DPOLoss", beta=0.1, loss_type="sigmoid", reference_free=False, sft_weight=1.0)
    model.add_metric("DPOMetric", beta=0.1)
    model.set_optimizer("Adam", lr=1e-4)
    logger.info(model.get_train_configs().model_dump())
    for optim_step, batch in enumerate(dataloader, start=1):
        pairs = interleave(batch)
        ref_outputs = model.forward_only(inputs=pairs, disable_lora=True)
        model.forward_backward(inputs=pairs, ref_outputs=ref_outputs.result)
        model.clip_grad_and_step()
        if optim_step % 2 == 0:
            logger.info(f"[Step {optim_step // 2}] {model.calculate_metric(is_training=True)}")
    logger.info(f"Saved checkpoint: {model.save(name='dpo-lora-final', save_optimizer=True)}")


if __name__ == "__main__":
    train()
