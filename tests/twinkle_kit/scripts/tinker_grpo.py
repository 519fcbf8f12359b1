# GSM8K GRPO with the unmodified Tinker SDK against a Twinkle server, in the shape of twinkle-kit's
# cookbook client/tinker/short_math_grpo.py (written for this suite): twinkle's dataset, template, rewards,
# advantages and metric on the client; per step the adapter saved for a sampling client, a group sampled
# per prompt, scored, and trained on with 'importance_sampling' (the sampler's log-probs as the behaviour
# policy); a final save_state. A step whose groups all score alike still trains (a zero-gradient step), so
# the Datum path runs even where the untrained model earns no reward.
import gc
import os
import re
from typing import Any, Dict, List

import numpy as np
from tinker import types

from twinkle import get_logger, init_tinker_client
from twinkle.advantage import GRPOAdvantage
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.metric import CompletionRewardMetric
from twinkle.preprocessor.llm import GSM8KProcessor
from twinkle.reward import GSM8KAccuracyReward
from twinkle.reward.base import Reward
from twinkle.template import Qwen3_5Template

logger = get_logger()

BASE_MODEL = os.environ.get("TWINKLE_MODEL_ID", "Qwen/Qwen3.5-4B")
NUM_GENERATIONS = 4
MAX_NEW_TOKENS = 4096
LEARNING_RATE = 2e-5
MAX_STEPS = 1000
BATCH_SIZE = 2
LORA_RANK = 16
DATA_NUM = 2000
SYSTEM_PROMPT = "You are a helpful math assistant. Reason briefly and put the final answer within \\boxed{}."


class BrevityReward(Reward):
    """0 without a boxed or #### answer; with one, 1 up to 200 characters, then less the longer it runs."""

    def __call__(self, trajectories: List[Dict[str, Any]], **kwargs) -> List[float]:
        scores = []
        for trajectory in trajectories:
            replies = [m.get("content", "") for m in trajectory.get("messages", []) if m.get("role") == "assistant"]
            text = replies[-1] if replies else ""
            answered = re.search(r"\\boxed\{[^}]+\}", text) or re.search(r"####\s*[\-\d,\.]+", text)
            scores.append(max(0.0, 1.0 - max(0, len(text) - 200) / 3000) if answered else 0.0)
        return scores


def gsm8k():
    dataset = Dataset(
        DatasetMeta("ms://modelscope/gsm8k", subset_name="main", split="train", data_slice=range(DATA_NUM))
    )
    dataset.set_template(
        "Qwen3_5Template",
        model_id=f"ms://{BASE_MODEL}",
        max_length=4096,
        truncation_strategy="delete",
        enable_thinking=True,
    )
    dataset.map(GSM8KProcessor(system=SYSTEM_PROMPT))
    dataset.encode(add_generation_prompt=True)
    return dataset


def as_ints(ids) -> List[int]:
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)


def main():
    dataloader = DataLoader(dataset=gsm8k(), batch_size=BATCH_SIZE, num_workers=0)
    template = Qwen3_5Template(model_id=f"ms://{BASE_MODEL}")

    init_tinker_client()
    from tinker import ServiceClient

    service_client = ServiceClient(
        base_url=os.environ.get("TWINKLE_SERVER_URL", "http://localhost:8000"),
        api_key=os.environ.get("TWINKLE_SERVER_TOKEN", "EMPTY_TOKEN"),
    )
    training_client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=LORA_RANK)
    advantage_fn, metrics = GRPOAdvantage(), CompletionRewardMetric()
    sampling_params = types.SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=1.0, top_p=0.95)

    for step, prompts in enumerate(dataloader):
        if step >= MAX_STEPS:
            break
        metrics.reset()
        sampling_client = training_client.save_weights_and_get_sampling_client()
        futures = [
            sampling_client.sample(
                prompt=types.ModelInput.from_ints(as_ints(p["input_ids"])),
                sampling_params=sampling_params,
                num_samples=NUM_GENERATIONS,
            )
            for p in prompts
        ]
        groups = [(p, seq) for p, future in zip(prompts, futures) for seq in future.result().sequences]

        trajectories = [
            {
                "messages": [
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": "Math problem"},
                    {"role": "assistant", "content": template.decode(seq.tokens, skip_special_tokens=True)},
                ],
                "user_data": p.get("user_data", []),
            }
            for p, seq in groups
        ]
        accuracy = GSM8KAccuracyReward()(trajectories)
        brevity = BrevityReward()(trajectories)
        total = [a + b for a, b in zip(accuracy, brevity)]
        metrics.accumulate(
            completion_lengths=[len(seq.tokens) for _, seq in groups],
            rewards={"total": total, "brevity": brevity, "accuracy": accuracy},
        )
        advantages = advantage_fn(total, num_generations=NUM_GENERATIONS, scale="group").tolist()

        training_data = []
        for (p, seq), advantage in zip(groups, advantages):
            prompt_ids, sampled = as_ints(p["input_ids"]), list(seq.tokens)
            observed = len(prompt_ids) - 1  # prompt positions: no target of the policy's
            logprobs = list(seq.logprobs) if seq.logprobs else [0.0] * len(sampled)
            training_data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(prompt_ids + sampled[:-1]),
                    loss_fn_inputs={
                        "target_tokens": [0] * observed + sampled,
                        "weights": [0] * observed + [1] * len(sampled),
                        "logprobs": types.TensorData.from_numpy(
                            np.array([0.0] * observed + logprobs, dtype=np.float32)
                        ),
                        "advantages": types.TensorData.from_numpy(
                            np.array([0.0] * observed + [float(advantage)] * len(sampled), dtype=np.float32)
                        ),
                    },
                )
            )
        fwdbwd = training_client.forward_backward(training_data, "importance_sampling").result()
        optim = training_client.optim_step(types.AdamParams(learning_rate=LEARNING_RATE)).result()
        gc.collect()

        log = metrics.calculate()
        log.update(optim.metrics or {})
        log.update(fwdbwd.metrics)
        log["train/frac_reward_zero_std"] = float(all(abs(a) < 1e-8 for a in advantages))
        log["train/num_training_samples"] = len(training_data)
        logger.info(f"Step {step}: {log}")

    save_result = training_client.save_state("gsm8k-grpo-final").result()
    logger.info(f"Saved final checkpoint to {save_result.path}")


if __name__ == "__main__":
    main()
