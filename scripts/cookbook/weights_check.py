"""The cookbook's weights/ against this server's checkpoints (`python weights_check.py LOG_DIR`, run by
cookbook_recipes.py in a recipe folder, where ./Qwen/Qwen3-8B is the served model's folder).

A LoRA trained a few steps through the SDK is exported two ways: `weights.download` of its training
checkpoint (which the cookbook exports encrypted to a fresh age key) and of external weights saved with
`save_weights_external`; the download is turned into a PEFT adapter by `weights.build_lora_adapter` and
into a merged model by `weights.build_hf_model`, each loaded with transformers (+ peft) and scored on a
sequence: their log-probs against the server's for the same weights (and the base model's, which must
differ). Twice: with Tinker's default LoRA (unembedding included) and with train_unembed=False, since the
demo model ties its embeddings and the cookbook merges an unembedding LoRA into the tied matrix (which
then moves the input embeddings too). Writes LOG_DIR/result.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import tinker
import torch
from tinker import types
from tinker_cookbook import weights

BASE = "Qwen/Qwen3-8B"  # a hub id the server serves as an alias of its demo model


def local_logprobs(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits_T_V = model(torch.tensor([tokens])).logits[0, :-1].float()
    return torch.log_softmax(logits_T_V, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]


def trained(train_unembed: bool) -> tuple[tinker.TrainingClient, list[int], torch.Tensor]:
    """A LoRA after 3 SFT steps, a sequence, and the server's log-probs of it under that LoRA."""
    tc = tinker.ServiceClient().create_lora_training_client(
        base_model=BASE, rank=8, seed=0, train_unembed=train_unembed
    )
    tokens = tc.get_tokenizer().encode("The quick brown fox jumps over the lazy dog. " * 3)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    for _ in range(3):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    served = tc.save_weights_and_get_sampling_client().compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    return tc, tokens, torch.tensor(served[1:])


def exported_diffs(tc, tokens: list[int], served_T: torch.Tensor, out: Path) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = weights.download(
        tinker_path=tc.save_weights_external("final").result().path, output_dir=str(out / "adapter")
    )
    weights.build_lora_adapter(base_model=BASE, adapter_path=adapter, output_path=str(out / "peft"))
    weights.build_hf_model(
        base_model=BASE, adapter_path=adapter, output_path=str(out / "merged"), dtype="float32", merge_strategy="full"
    )
    base = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32)
    base_T = local_logprobs(base, tokens)
    peft_T = local_logprobs(PeftModel.from_pretrained(base, str(out / "peft")), tokens)
    merged_T = local_logprobs(AutoModelForCausalLM.from_pretrained(str(out / "merged"), dtype=torch.float32), tokens)
    return {
        "files": sorted(p.name for p in Path(adapter).iterdir()),
        "max_abs_logprob_diff_peft": float((peft_T - served_T).abs().max()),
        "max_abs_logprob_diff_merged": float((merged_T - served_T).abs().max()),
        "max_abs_logprob_diff_base": float((base_T - served_T).abs().max()),
    }


def main(log: Path) -> None:
    log.mkdir(parents=True, exist_ok=True)
    tc, tokens, served_T = trained(train_unembed=True)
    result: dict = {}
    try:
        weights.download(tinker_path=tc.save_state("state").result().path, output_dir=str(log / "from_state"))
        result["download_training_checkpoint"] = "works"
    except Exception as e:
        result["download_training_checkpoint"] = f"{type(e).__name__}: {e}"[:300]
    result["default_lora"] = exported_diffs(tc, tokens, served_T, log / "default")
    result["no_unembed_lora"] = exported_diffs(*trained(train_unembed=False), log / "no_unembed")
    (log / "result.json").write_text(json.dumps(result))
    print(json.dumps(result))
    for lora in ("default_lora", "no_unembed_lora"):  # the export is the server's LoRA; the base is not
        assert result[lora]["max_abs_logprob_diff_peft"] < 1e-4 < result[lora]["max_abs_logprob_diff_base"], result
    assert result["no_unembed_lora"]["max_abs_logprob_diff_merged"] < 1e-4, result


if __name__ == "__main__":
    main(Path(sys.argv[1]))
