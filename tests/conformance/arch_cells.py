"""The architecture matrix's pieces: the batch, the targets Tinker's flags name, the engines built
on one family's tiny model, and the markdown. test_architecture_matrix.py runs the cells."""

from __future__ import annotations

import contextlib
import copy

import torch
from peft import LoraConfig

COLUMNS = {
    "peft": "train + save + peft loads it",
    "loss": "loss = transformers + peft",
    "fused": "fused multi-tenant = each alone",
    "sampler": "sampler = trainer log-probs",
    "tp2": "tp=2 = one process",
    "compile": "compile=True = eager",
    "tinker": "Tinker SDK fb + step + sample",
    "coverage": "LoRA coverage of the flags",
}
ARCH: dict[str, dict[str, str]] = {}  # family -> column -> cell
PROMPTS = [[5, 17, 33, 90, 4], [7, 7, 120, 61]]


class Cell(dict):
    def within(self, difference: float, tolerance: float) -> None:
        """Assert a relative difference within tolerance; the cell shows the worst one."""
        assert difference < tolerance, f"relative difference {difference:.2e} > {tolerance:g}"
        self["worst"] = max(self.get("worst", 0.0), difference)


@contextlib.contextmanager
def cell(family: str, column: str):
    """Marks the cell failed until the block finishes; the block may set a refusal or a value."""
    row = ARCH.setdefault(family, {})
    row[column] = "✗ failed"
    result = Cell(cell="✓")
    yield result
    worst = ""
    if "worst" in result and result["cell"].startswith("✓"):
        worst = " (exact)" if result["worst"] == 0 else f" ({result['worst']:.0e})"
    row[column] = result["cell"].replace("✓", "✓" + worst, 1)


def rows(seed: int, n: int = 3, length: int = 11) -> list[dict]:
    """Equal lengths (no padding to reason about); the first two labels masked like a prompt."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (n, length), generator=g).tolist()
    return [{"input_ids": r, "labels": [-100, -100, *r[2:]]} for r in ids]


def lora_config(model, rank: int = 4, alpha: int = 8) -> LoraConfig:
    """What the server builds from a Tinker LoraConfig with train_attn, train_mlp, train_unembed on."""
    from twinkle.serve.backend import LoraSpec

    spec = LoraSpec(rank=rank)
    return LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=spec.target_modules(model),
        target_parameters=spec.target_parameters(model) or None,
    )


def perturb(params, seed: int, std: float = 0.1) -> None:
    """B starts at zero, so an untrained adapter is the base model: give every factor a value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * std)


def handwritten_loss(peft_model, batch) -> float:
    """Mean next-token cross-entropy over the unmasked labels, straight from the logits."""
    ids = torch.tensor([r["input_ids"] for r in batch])
    labels = torch.tensor([r["labels"] for r in batch])
    with torch.no_grad():
        logits = peft_model(input_ids=ids).logits[:, :-1].float()
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100))


def token_logprobs(logits_B_T_V, ids_B_T) -> list[list[float]]:
    """Aligned like forward_only: 0 at position 0, then log p(x_t | x_<t)."""
    lp = torch.log_softmax(logits_B_T_V[:, :-1].float(), -1).gather(-1, ids_B_T[:, 1:, None]).squeeze(-1)
    return [[0.0, *row] for row in lp.tolist()]


def max_rel(got, want) -> float:
    """max |got - want| over the scale of want (fp32 sums differ by ~1e-7 per op relative)."""
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


def named_by_flags(model) -> dict[str, int]:
    """{parameter: numel} that train_attn / train_mlp / train_unembed name, decided without
    twinkle.model.structure: matrices under a layer's self_attn or mlp (the router excepted: Tinker
    trains it only when asked), and the output head."""
    routers = {n for n, m in model.named_modules() if "router" in type(m).__name__.lower()}
    routers |= {n for n, m in model.named_modules() if n.endswith(".mlp.gate") and hasattr(m, "weight")}
    named = {"lm_head.weight": model.get_output_embeddings().weight.numel()}
    for n, p in model.named_parameters(remove_duplicate=False):
        owner = n.rsplit(".", 1)[0]
        in_layer = ".self_attn." in n or ".mlp." in n
        if in_layer and p.dim() >= 2 and not n.endswith("bias") and owner not in routers:
            named[n] = p.numel()
    return named


def multi_lora(base, configs: dict[str, LoraConfig]):
    from twinkle.model.multi_lora import MultiLoraModel

    model = MultiLoraModel(model=copy.deepcopy(base))
    for i, (name, config) in enumerate(configs.items()):
        model.add_adapter_to_model(name, config)
        perturb(model.adapters[name].params, seed=100 + i)
    return model


COMMAND = "CONFORMANCE_ARCH_MATRIX=docs/architecture-matrix.md uv run --all-packages --all-groups pytest tests/conformance/test_architecture_matrix.py"


def markdown() -> str:
    import time

    from twinkle.model.families import FAMILIES

    header = (
        f"Architecture conformance matrix, {time.strftime('%Y-%m-%d', time.gmtime())}; regenerate with "
        f"`{COMMAND}`.\n\nTiny random fp32 models (hidden 64, 2 layers) built offline from transformers' config "
        "classes (twinkle.model.families); LoRA on what Tinker's train_attn + train_mlp + train_unembed name "
        "(the server's mapping). ✓ (worst relative difference): equal within 1e-5 relative (1e-4 for gradients); refused: a refusal at "
        "construction naming the module and what to use instead."
    )
    head = ["family", *COLUMNS.values()]
    lines = [header, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for family in sorted(ARCH, key=FAMILIES.index):
        row = ARCH[family]
        cells = [row.get(c, "—").replace("|", "\\|").replace("\n", " ") for c in COLUMNS]
        lines.append("| " + " | ".join([family, *cells]) + " |")
    return "\n".join(lines) + "\n"
