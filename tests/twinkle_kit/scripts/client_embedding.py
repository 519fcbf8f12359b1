# Contrastive (InfoNCE) embedding training against a running server through twinkle-kit's client, in the
# shape of its cookbook client/twinkle/embedding.py (written for this suite): rows come in
# [anchor, positive] order, an anchor's one-number label is 1 and its positive's 0, and every
# forward_backward asks the server for task='embedding' (pooled last-token states, no vocabulary).
import dotenv

dotenv.load_dotenv(".env")

import os
from typing import Any, Dict, List

from peft import LoraConfig

from twinkle import get_logger, init_twinkle_client
from twinkle.template import Qwen3_5Template
from twinkle_client.model import MultiLoraTransformersModel

logger = get_logger()

BASE_MODEL = os.environ.get("TWINKLE_MODEL_ID", "Qwen/Qwen3.5-4B")
MODEL_ID = f"ms://{BASE_MODEL}"
TEMPERATURE = 0.07
MAX_STEPS = 10

# each query with a passage that answers it: the contrast InfoNCE learns
PAIRS: List[tuple] = [
    ("Which planet is closest to the sun?", "Mercury orbits nearest to the sun."),
    ("How many legs does a spider have?", "Spiders walk on eight legs."),
    ("What gas do plants take in?", "Leaves absorb carbon dioxide from the air."),
    ("Where is the Great Barrier Reef?", "The reef lies off the coast of Queensland, Australia."),
    ("What does a thermometer measure?", "A thermometer reads temperature."),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci painted the Mona Lisa."),
]


def encode_pairs(tokenizer) -> List[Dict[str, Any]]:
    rows = []
    for query, passage in PAIRS:
        for text, label in ((query, 1), (passage, 0)):
            ids = tokenizer.encode(text, add_special_tokens=True)
            rows.append(
                {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": [label], "position_ids": list(range(len(ids)))}
            )
    return rows


def train():
    init_twinkle_client(
        base_url=os.environ.get("TWINKLE_SERVER_URL", "http://localhost:8000"),
        api_key=os.environ.get("TWINKLE_SERVER_TOKEN", "EMPTY_TOKEN"),
    )
    model = MultiLoraTransformersModel(model_id=MODEL_ID)
    model.add_adapter_to_model("emb_adapter", LoraConfig(target_modules="all-linear"))
    model.set_template("Qwen3_5Template", model_id=MODEL_ID)
    model.set_processor("InputProcessor")
    model.set_loss("InfonceLoss", temperature=TEMPERATURE, use_batch=True, hard_negatives=None)
    model.set_optimizer("Adam", lr=1e-4)
    model.add_metric("EmbeddingMetric", is_training=True)

    template = Qwen3_5Template(model_id=MODEL_ID, max_length=512, enable_thinking=False)
    batch = encode_pairs(template.tokenizer)
    logger.info(f"{len(batch)} rows, {len(PAIRS)} groups")
    for step in range(MAX_STEPS):
        model.forward_backward(inputs=batch, task="embedding")
        model.clip_grad_and_step(max_grad_norm=1.0)
        metric = model.calculate_metric(is_training=True)
        logger.info(f"Step {step}: {getattr(metric, 'result', metric)}")


if __name__ == "__main__":
    train()
