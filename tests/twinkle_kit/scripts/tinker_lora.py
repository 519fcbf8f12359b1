# Pig-latin LoRA with the unmodified Tinker SDK against a Twinkle server, in the shape of twinkle-kit's
# cookbook client/tinker/lora.py (written for this suite): capabilities, runs and checkpoints through
# the REST client, Datums built from a tokenizer, two epochs of steps, a checkpoint per epoch, publish.
import dotenv

dotenv.load_dotenv(".env")

import os

import numpy as np

from twinkle import init_tinker_client

init_tinker_client()

from tinker import ServiceClient, types  # noqa: E402

service_client = ServiceClient(
    base_url=os.environ.get("TWINKLE_SERVER_URL", "http://localhost:8000"),
    api_key=os.environ.get("TWINKLE_SERVER_TOKEN", "EMPTY_TOKEN"),
)
for item in service_client.get_server_capabilities().supported_models:
    print("- " + item.model_name)
rest_client = service_client.create_rest_client()
for run in rest_client.list_training_runs(limit=50).result().training_runs:
    for checkpoint in rest_client.list_checkpoints(run.training_run_id).result().checkpoints:
        print("  " + checkpoint.model_dump_json(indent=2))

base_model = os.environ.get("TWINKLE_MODEL_ID", "Qwen/Qwen3.5-4B")
training_client = service_client.create_lora_training_client(base_model=base_model)
examples = [
    {"input": "banana split", "output": "anana-bay plit-say"},
    {"input": "donut shop", "output": "onut-day op-shay"},
    {"input": "pickle jar", "output": "ickle-pay ar-jay"},
]

from modelscope import AutoTokenizer  # noqa: E402

tokenizer = AutoTokenizer.from_pretrained(base_model, trust_remote_code=True)


def to_datum(example: dict) -> types.Datum:
    prompt = tokenizer.encode(f"English: {example['input']}\nPig Latin:", add_special_tokens=True)
    completion = tokenizer.encode(f" {example['output']}\n\n", add_special_tokens=False)
    tokens, weights = prompt + completion, [0] * len(prompt) + [1] * len(completion)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens=tokens[:-1]),
        loss_fn_inputs=dict(weights=weights[1:], target_tokens=tokens[1:]),
    )


data = [to_datum(ex) for ex in examples]
for epoch in range(2):
    for batch in range(5):
        fwdbwd_future = training_client.forward_backward(data, "cross_entropy")
        optim_future = training_client.optim_step(types.AdamParams(learning_rate=1e-4))
        logprobs = np.concatenate([out["logprobs"].tolist() for out in fwdbwd_future.result().loss_fn_outputs])
        weights = np.concatenate([d.loss_fn_inputs["weights"].tolist() for d in data])
        optim_future.result()
        print(f"Epoch {epoch}, Batch {batch}: Loss per token: {-np.dot(logprobs, weights) / weights.sum():.4f}")
    save_result = training_client.save_state(f"pig-latin-lora-epoch-{epoch}").result()
    print(f"Saved checkpoint for epoch {epoch} to {save_result.path}")
rest_client.publish_checkpoint_from_tinker_path(save_result.path).result()
print("Published checkpoint")
