"""The Tinker SDK cell: one real server (loopback HTTP) serving every family's tiny model, each saved
as a local folder with the embedded tokenizer, and the unmodified tinker SDK driving it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

os.environ.setdefault("TINKER_TELEMETRY", "0")  # before the SDK is imported: no calls off loopback
SEQ = [5 + (7 * i) % 60 for i in range(16)]


def model_name(family: str) -> str:
    return f"arch/{family}"


def start_server(folder: Path, families):
    """Saves each family's tiny model (the embedded tokenizer's vocab) and serves them all."""
    import twinkle.serve as ts
    from twinkle.hub import TEST_MODEL, resolve_model_path
    from twinkle.model.families import tiny_model

    tokenizer = Path(resolve_model_path(TEST_MODEL))
    models = []
    for family in families:
        path = folder / family
        tiny_model(family, vocab_size=850).save_pretrained(path)  # 850: the embedded tokenizer's vocab
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(tokenizer / name, path / name)
        models.append({"name": model_name(family), "path": str(path)})
    config = {"models": models, "limits": {"max_models": len(models)}}
    return ts.initialize(
        mode="http", port=0, data_dir=folder / "data", config=config, block=False, log_level="warning"
    ).wait_ready()


def datum(tokens):
    from tinker import types

    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def run(server, family: str) -> dict:
    """forward_backward + optim_step twice, then the sampler of the saved weights: its log-probs of
    the sequence against the trainer's forward, and a sample."""
    import tinker
    from tinker import types

    client = tinker.ServiceClient(base_url=server.url, api_key=server.create_key(f"arch-{family}"))
    tc = client.create_lora_training_client(base_model=model_name(family), rank=4, seed=1).result()

    def forward():
        out = tc.forward([datum(SEQ)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        return np.asarray(out, dtype=np.float64)

    untrained, losses = forward(), []
    for _ in range(2):
        fb = tc.forward_backward([datum(SEQ)], "cross_entropy")
        # small: Adam's first steps are sign descent, so each lowers the loss to first order
        tc.optim_step(types.AdamParams(learning_rate=2e-3)).result()
        losses.append(fb.result().metrics["loss:sum"])
    sampler = tc.save_weights_and_get_sampling_client().result()
    served = np.array(sampler.compute_logprobs(types.ModelInput.from_ints(SEQ)).result()[1:], dtype=np.float64)
    sample = sampler.sample(types.ModelInput.from_ints(SEQ[:5]), 1, types.SamplingParams(max_tokens=3)).result()
    return {
        "arch": tc.get_info().model_data.arch,
        "losses": losses,
        "served": served,
        "trained": forward(),
        "untrained": untrained,
        "sampled": list(sample.sequences[0].tokens),
    }
