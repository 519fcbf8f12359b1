# Sampling from a running server through twinkle-kit's client, in the shape of its cookbook
# client/twinkle/sample.py (written for this suite): chats in, completions decoded with the tokenizer.
import dotenv

dotenv.load_dotenv(".env")

import os

from transformers import AutoTokenizer

from twinkle import get_logger
from twinkle_client import init_twinkle_client
from twinkle_client.sampler import vLLMSampler

logger = get_logger()
MODEL_ID = os.environ.get("TWINKLE_MODEL_ID", "Qwen/Qwen3.5-4B")
ADAPTER_URI = None  # or a twinkle path from a training run's save()


def sample():
    init_twinkle_client(
        base_url=os.environ.get("TWINKLE_SERVER_URL", "http://localhost:8000"),
        api_key=os.environ.get("TWINKLE_SERVER_TOKEN", "EMPTY_TOKEN"),
    )
    sampler = vLLMSampler(model_id=MODEL_ID)
    sampler.set_template("Qwen3_5Template", model_id=MODEL_ID)
    trajectory = {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Who are you?"},
        ]
    }
    num_prompts, num_samples = 4, 2
    responses = sampler.sample(
        inputs=[trajectory] * num_prompts,
        sampling_params={"max_tokens": 128, "temperature": 1.0, "num_samples": num_samples},
        adapter_uri=ADAPTER_URI,
    )
    tokenizer = AutoTokenizer.from_pretrained(MODEL_ID, trust_remote_code=True)
    for response in responses:
        logger.info(f"Generated {len(response.sequences)} sequences")
        for i, seq in enumerate(response.sequences):
            logger.info(f"Sequence {i}:\n  {tokenizer.decode(seq.tokens, skip_special_tokens=True)}\n")


if __name__ == "__main__":
    sample()
