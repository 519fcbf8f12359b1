# GRPO against a running server through twinkle-kit's client, in the shape of its cookbook
# client/twinkle/short_math_grpo.py (written for this suite): save the adapter for the sampler, sample
# a group per prompt, score, advantages, a policy step on the sampled rows.
import dotenv

dotenv.load_dotenv(".env")

import os
import re
from typing import Any, Dict, List

from peft import LoraConfig

from twinkle import get_logger, init_twinkle_client
from twinkle.advantage import GRPOAdvantage
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.metric import CompletionRewardMetric
from twinkle.preprocessor.llm import GSM8KProcessor
from twinkle.reward import GSM8KAccuracyReward
from twinkle.reward.base import Reward
from twinkle_client.model import MultiLoraTransformersModel
from twinkle_client.sampler import vLLMSampler

logger = get_logger()
BASE_MODEL = os.environ.get("TWINKLE_MODEL_ID", "Qwen/Qwen3.5-4B")
MODEL_ID = f"ms://{BASE_MODEL}"
NUM_GENERATIONS, MAX_NEW_TOKENS, MAX_STEPS, BATCH_SIZE = 4, 1024, 100, 2


class ShortAnswerReward(Reward):
    """1 for a completion with a boxed or #### answer, less the longer it is; 0 without one."""

    def __call__(self, trajectories: List[Dict[str, Any]], **kwargs) -> List[float]:
        out = []
        for trajectory in trajectories:
            text = next(
                (
                    m.get("content", "")
                    for m in reversed(trajectory.get("messages", []))
                    if m.get("role") == "assistant"
                ),
                "",
            )
            found = re.search(r"\\boxed\{[^}]+\}", text) or re.search(r"####\s*[\-\d,\.]+", text)
            out.append(0.0 if not found else max(0.0, 1.0 - max(0, len(text) - 200) / 3000))
        return out


def create_gsm8k_dataset():
    dataset = Dataset(DatasetMeta("ms://modelscope/gsm8k", subset_name="main", split="train", data_slice=range(2000)))
    dataset.set_template("Qwen3_5Template", model_id=MODEL_ID, max_length=2048, enable_thinking=False)
    dataset.map(GSM8KProcessor(system="Solve the problem and put the final answer within \\boxed{}."))
    dataset.encode(add_generation_prompt=True)
    return dataset


def train():
    init_twinkle_client(
        base_url=os.environ.get("TWINKLE_SERVER_URL", "http://localhost:8000"),
        api_key=os.environ.get("TWINKLE_SERVER_TOKEN", "EMPTY_TOKEN"),
    )
    dataloader = DataLoader(dataset=create_gsm8k_dataset(), batch_size=BATCH_SIZE, num_workers=0)
    model = MultiLoraTransformersModel(model_id=MODEL_ID)
    model.add_adapter_to_model(
        "default", LoraConfig(target_modules="all-linear", r=8, lora_alpha=32), gradient_accumulation_steps=1
    )
    model.set_loss("GRPOLoss", epsilon=0.2, beta=0.0)
    model.set_optimizer("Adam", lr=2e-5)
    model.set_processor("InputProcessor")
    model.set_template("Qwen3_5Template", model_id=MODEL_ID)
    sampler = vLLMSampler(model_id=MODEL_ID)
    sampler.set_template("Qwen3_5Template", model_id=MODEL_ID)
    advantage_fn, metrics = GRPOAdvantage(), CompletionRewardMetric()
    sampling_params = {
        "max_tokens": MAX_NEW_TOKENS,
        "temperature": 1.0,
        "top_p": 0.95,
        "num_samples": NUM_GENERATIONS,
        "logprobs": 1,
    }
    for step, batch in enumerate(dataloader):
        if step >= MAX_STEPS:
            break
        metrics.reset()
        adapter_uri = model.save(name="grpo-sampler-weights", save_optimizer=False, is_sampler=True).twinkle_path
        responses = sampler.sample(inputs=batch, sampling_params=sampling_params, adapter_uri=adapter_uri)
        inputs, old_logps, lengths = [], [], []
        for response in responses:
            for sequence in response.sequences:
                inputs.append(sequence.new_input_feature)
                old_logps.append([logprob[0][1] for logprob in sequence.logprobs])
                lengths.append(len(sequence.tokens))
        accuracy = GSM8KAccuracyReward()(inputs)
        brevity = ShortAnswerReward()(inputs)
        total = [a + b for a, b in zip(accuracy, brevity)]
        metrics.accumulate(
            completion_lengths=lengths, rewards={"total": total, "accuracy": accuracy, "brevity": brevity}
        )
        advantages = advantage_fn(total, num_generations=NUM_GENERATIONS, scale="group").tolist()
        model.forward_backward(inputs=inputs, advantages=advantages, old_logps=old_logps)
        model.clip_grad_and_step()
        log_dict = metrics.calculate()
        log_dict.update(model.calculate_metric(is_training=True).result)
        logger.info(f"Step {step}: {log_dict}")
    logger.info(f"Saved final checkpoint: {model.save(name='grpo-final', save_optimizer=True)}")


if __name__ == "__main__":
    train()
