"""Compress-then-embed check, in the shape of twinkle-kit's cookbook sample/emb_sample.py (written for this
suite): a vLLM condenser in one Ray group rewrites each (query, passage) side, an embedding model in a
second group embeds both the rewritten and the raw texts through forward_only(task='embedding'), and the
matched pairs' cosine similarities are reported beside the mismatched ones.
"""

import re

import torch.nn.functional as F

import twinkle
from twinkle import DeviceGroup, DeviceMesh, get_device_placement, get_logger
from twinkle.cli import CLI
from twinkle.data_format import SamplingParams
from twinkle.loss import InfonceLoss
from twinkle.model import TransformersModel
from twinkle.processor import InputProcessor
from twinkle.sampler import vLLMSampler
from twinkle.template import Template

logger = get_logger()
args = CLI.from_args()

CONDENSE_MODEL_ID = args.extra.get("condense_model_id", "ms://twinkle-kit/Qwen3.5-4B-CM-v2")
EMB_MODEL_ID = args.extra.get("emb_model_id", "ms://twinkle-kit/Qwen3.5-4B-QA-emb")
SAMPLER_GPUS = args.infra.sampler_gpus or 1
EMB_GPUS = int(args.extra.get("emb_gpus", 1))
EMB_MAX_LENGTH = 8192

CONDENSE_SYSTEM = "Rewrite the passage as a short, dense summary that keeps every fact the question needs."
CONDENSE_USER = "Question: {hint}\n\nPassage:\n{text}"
HINT_QUERY = "What need does this question express?"
HINT_PASSAGE = "What reusable method does this passage teach?"

PAIRS = [
    {
        "topic": "sums",
        "query": "How do I add the numbers 1 to 100 quickly?",
        "passage": "Pair the ends: 50 pairs of 101 make 5050.",
    },
    {
        "topic": "palindromes",
        "query": "How can I tell if a word reads the same backwards?",
        "passage": "Compare s with s[::-1].",
    },
    {
        "topic": "bees",
        "query": "How does a hive replace an old queen?",
        "passage": "Workers raise a larva on royal jelly.",
    },
]


def condense(sampler, texts, hint):
    prompts = [
        {
            "messages": [
                {"role": "system", "content": CONDENSE_SYSTEM},
                {"role": "user", "content": CONDENSE_USER.format(hint=hint, text=t)},
            ]
        }
        for t in texts
    ]
    responses = sampler.sample(prompts, SamplingParams(max_tokens=512, temperature=0.2, top_p=0.5, num_samples=1))
    out = []
    for response in responses:
        seq = response.sequences[0] if response.sequences else None
        out.append(re.sub(r"<\|[^|]+\|>", "", seq.decoded).strip() if seq and seq.decoded else "")
    return out


def embed(model, template, texts, role):
    rows = []
    for text in texts:
        if role == "anchor":
            row = template.encode(
                {
                    "messages": [
                        {"role": "user", "content": text or "-"},
                        {"role": "assistant", "content": "Find the match."},
                    ]
                }
            )
            row["labels"] = [1]
        else:
            row = template.encode(
                {
                    "messages": [
                        {"role": "user", "content": "Find the match."},
                        {"role": "assistant", "content": text or "-"},
                    ]
                }
            )
            row["labels"] = [0]
        rows.append(row)
    return model.forward_only(inputs=rows, task="embedding", return_logits=True)["embeddings"]


def main():
    groups = [
        DeviceGroup(name="sampler", ranks=list(range(SAMPLER_GPUS)), device_type="GPU", gpus_per_worker=SAMPLER_GPUS),
        DeviceGroup(name="emb_model", ranks=list(range(SAMPLER_GPUS, SAMPLER_GPUS + EMB_GPUS)), device_type="GPU"),
    ]
    sampler_mesh = DeviceMesh.from_sizes(world_size=SAMPLER_GPUS, tp_size=SAMPLER_GPUS)
    emb_mesh = DeviceMesh.from_sizes(world_size=EMB_GPUS, dp_size=EMB_GPUS)
    twinkle.initialize(mode="ray", nproc_per_node=SAMPLER_GPUS + EMB_GPUS, groups=groups, lazy_collect=False)

    sampler = vLLMSampler(
        model_id=CONDENSE_MODEL_ID,
        engine_args={"gpu_memory_utilization": 0.8, "max_model_len": 32768},
        device_mesh=sampler_mesh,
        remote_group="sampler",
    )
    sampler.set_template("Qwen3_5Template", model_id=CONDENSE_MODEL_ID, enable_thinking=False, max_length=32768)

    model = TransformersModel(model_id=EMB_MODEL_ID, device_mesh=emb_mesh, remote_group="emb_model")
    model.set_processor(InputProcessor)
    model.set_loss(InfonceLoss, temperature=0.03, use_batch=True)
    template = Template(model_id=EMB_MODEL_ID, max_length=EMB_MAX_LENGTH, enable_thinking=False)
    logger.info(get_device_placement())

    queries, passages = [p["query"] for p in PAIRS], [p["passage"] for p in PAIRS]
    short_queries, short_passages = condense(sampler, queries, HINT_QUERY), condense(sampler, passages, HINT_PASSAGE)
    for pair, q, c in zip(PAIRS, short_queries, short_passages):
        logger.info(
            f"[{pair['topic']}] query {len(pair['query'])}->{len(q)} chars, passage {len(pair['passage'])}->{len(c)} chars"
        )

    q, c = embed(model, template, short_queries, "anchor"), embed(model, template, short_passages, "positive")
    raw_q, raw_c = embed(model, template, queries, "anchor"), embed(model, template, passages, "positive")
    for i, pair in enumerate(PAIRS):
        sim = F.cosine_similarity(q[i : i + 1], c[i : i + 1]).item()
        raw = F.cosine_similarity(raw_q[i : i + 1], raw_c[i : i + 1]).item()
        logger.info(f"{pair['topic']:<12} condensed {sim:.4f} raw {raw:.4f} delta {sim - raw:+.4f}")
    cross = F.cosine_similarity(raw_q.unsqueeze(1), raw_c.unsqueeze(0), dim=2)
    matched, mismatched = (
        cross.diagonal().mean().item(),
        (cross.sum() - cross.diagonal().sum()).item() / (len(PAIRS) ** 2 - len(PAIRS)),
    )
    logger.info(f"raw matched {matched:.4f} mismatched {mismatched:.4f} margin {matched - mismatched:+.4f}")
    logger.info("Done.")


if __name__ == "__main__":
    main()
