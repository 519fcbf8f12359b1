# LoRA DPO with the unmodified Tinker SDK against a Twinkle server, in the shape of twinkle-kit's cookbook
# client/tinker/dpo.py (written for this suite; without its optional SwanLab logging): preference pairs
# interleaved chosen / rejected, turned into Datums; per step a `forward` with the adapter off for the
# reference log-probs, sent back as `ref_logps` to a forward_backward that the server runs as DPO
# (twinkle-kit's conventions on top of Tinker's: twinkle/serve/tinker/kit_dpo.py), then an optimizer step.
import os
from typing import Any, Dict, List

import numpy as np
import torch
from tinker import types
from tqdm import tqdm

from twinkle import get_logger, init_tinker_client
from twinkle.dataloader import DataLoader
from twinkle.dataset import DatasetMeta, LazyDataset
from twinkle.preprocessor import EmojiDPOProcessor
from twinkle.server.common import input_feature_to_datum

logger = get_logger()

init_tinker_client()

from tinker import ServiceClient  # noqa: E402

base_model = os.environ.get("TWINKLE_MODEL_ID", "Qwen/Qwen3.5-4B")
base_url = os.environ.get("TWINKLE_SERVER_URL", "http://localhost:8000")
api_key = os.environ.get("TWINKLE_SERVER_TOKEN", "EMPTY_TOKEN")
dataset_id = "ms://hjh0119/shareAI-Llama3-DPO-zh-en-emoji"

batch_size = 4
learning_rate = 1e-4
dpo_beta = 0.1
sft_weight = 1.0
max_length = 2048
lora_rank = 8
system_prompt = "You are a helpful assistant."


def create_dpo_dataset():
    dataset = LazyDataset(DatasetMeta(dataset_id, data_slice=range(5000)))
    dataset.set_template("Qwen3_5Template", model_id=f"ms://{base_model}", max_length=max_length)
    dataset.map(EmojiDPOProcessor, init_args={"system": system_prompt})
    dataset.encode()
    return dataset


def interleave(batch: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """[chosen_1, rejected_1, chosen_2, ...]: each pair stays together however the rows are split."""
    rows = []
    for row in batch:
        shared = {k: v for k, v in row.items() if k not in ("positive", "negative")}
        rows += [{**shared, **row["positive"]}, {**shared, **row["negative"]}]
    return rows


def as_lists(row: Dict[str, Any]) -> Dict[str, Any]:
    for key, value in list(row.items()):
        if isinstance(value, np.ndarray):
            row[key] = value.tolist()
        elif isinstance(value, torch.Tensor):
            row[key] = value.cpu().numpy().tolist()
    return row


def train():
    dataloader = DataLoader(dataset=create_dpo_dataset(), batch_size=batch_size)
    logger.info(f"Dataset ready: {len(dataloader)} steps per epoch")
    service_client = ServiceClient(base_url=base_url, api_key=api_key)
    training_client = service_client.create_lora_training_client(base_model=base_model, rank=lora_rank)
    logger.info(f"DPO: beta={dpo_beta}, sft_weight={sft_weight}, lr={learning_rate}, rank={lora_rank}")

    for step, batch in tqdm(enumerate(dataloader), total=len(dataloader)):
        datums = [input_feature_to_datum(row) for row in interleave([as_lists(row) for row in batch])]
        # the reference: the same datums through the base model (adapter off), no gradient
        reference = training_client.forward(datums, "cross_entropy", loss_fn_config={"disable_lora": True}).result()
        for datum, out in zip(datums, reference.loss_fn_outputs):
            ref_logps = np.array(out["logprobs"].tolist(), dtype=np.float32)
            datum.loss_fn_inputs["ref_logps"] = types.TensorData.from_numpy(ref_logps)
        fwdbwd = training_client.forward_backward(
            datums, "importance_sampling", loss_fn_config={"dpo_beta": dpo_beta, "dpo_sft_weight": sft_weight}
        ).result()
        optim = training_client.optim_step(types.AdamParams(learning_rate=learning_rate)).result()
        logger.info(f"[Step {step}] loss={fwdbwd.metrics['loss:sum']:.4f} metrics={fwdbwd.metrics} {optim.metrics}")

    save_result = training_client.save_state("dpo-lora-final").result()
    logger.info(f"Saved checkpoint: {save_result.path}")


if __name__ == "__main__":
    train()
