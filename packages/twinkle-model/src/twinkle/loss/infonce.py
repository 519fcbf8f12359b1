"""Contrastive loss over pooled sequence embeddings (twinkle-kit's `InfonceLoss`, task='embedding').

The rows come in groups: an anchor q_g, its positive d_g⁺, then its negatives; a row's `group_start`
(twinkle-kit's one-number `labels`) is 1 on each anchor. With e = the unit embeddings
(`TokenHead.embeddings()`) and τ the temperature, each group's loss is cross-entropy towards its
positive over the similarities s = q_g·d / τ to:

    use_batch=False:  its own documents (positive and negatives);
    use_batch=True:   every group's documents (in-batch negatives), and with
        include_qq:   the other anchors (q_g·q_g' for g' ≠ g),
        include_dd:   d_g⁺·d for every document d other than d_g⁺ itself;

`mask_fake_negative` drops, from the anchor's blocks, every similarity above the positive's
q_g·d_g⁺ + `fake_neg_margin` (a near-duplicate is likelier a mislabelled positive than a negative).
`hard_negatives=k` keeps k negatives a group: the first k, or, when it has fewer, its own repeated in
order (twinkle-kit draws the repeats at random). L = mean over groups ('mean'), or their sum ('sum').

Over several processes (data parallelism) with `use_batch`, each process's rows must be whole groups:
the documents (and anchors) of every process are gathered, each process scores its own anchors against
all of them, and the gradient of a gathered row goes back to the process that computed it, so the
data-parallel step equals one process over the whole batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from twinkle.loss.base import Loss, LossContext, LossOutput, register_loss


def group_bounds(group_start_N: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each group from the anchors' marks; every row must belong to one."""
    starts = (group_start_N != 0).nonzero().flatten().tolist()
    n = group_start_N.numel()
    if not starts or starts[0] != 0:
        raise ValueError("group_start must mark row 0 as an anchor: every row belongs to a group")
    bounds = list(zip(starts, [*starts[1:], n]))
    short = [s for s, e in bounds if e - s < 2]
    if short:
        raise ValueError(f"the groups starting at rows {short} have no positive (an anchor, then its positive)")
    return bounds


@register_loss
class InfonceLoss(Loss):
    """InfoNCE with in-batch negatives; twinkle-kit's keywords and defaults."""

    aliases = ("infonce", "InfoNCELoss")
    required_fields = ("group_start",)
    unit = "sequence"  # a group: `units` counts the anchors

    def __init__(
        self,
        temperature: float = 0.1,
        use_batch: bool = True,
        hard_negatives: int | None = None,
        mask_fake_negative: bool = False,
        fake_neg_margin: float = 0.1,
        include_qq: bool = False,
        include_dd: bool = False,
        process_group: dist.ProcessGroup | None = None,
        reduction: str = "mean",
    ) -> None:
        super().__init__(reduction)
        if not temperature > 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        if mask_fake_negative and not fake_neg_margin > 0:
            raise ValueError(f"fake_neg_margin must be positive with mask_fake_negative, got {fake_neg_margin}")
        if hard_negatives is not None and hard_negatives < 1:
            raise ValueError(f"hard_negatives must be a positive count or None, got {hard_negatives}")
        if process_group is not None:
            raise ValueError("process_group: in-batch negatives are gathered over the default process group")
        if (include_qq or include_dd) and not use_batch:
            raise ValueError("include_qq / include_dd add in-batch blocks: they need use_batch=True")
        self.temperature, self.use_batch, self.hard_negatives = float(temperature), use_batch, hard_negatives
        self.mask_fake_negative, self.fake_neg_margin = mask_fake_negative, float(fake_neg_margin)
        self.include_qq, self.include_dd = include_qq, include_dd

    def units(self, targets_B_T: torch.Tensor, fields: Mapping[str, torch.Tensor]) -> float:  # noqa: ARG002
        return float((fields["group_start"] != 0).sum())

    def _groups(self, emb_N_H: torch.Tensor, group_start_N: torch.Tensor) -> list[torch.Tensor]:
        groups = [emb_N_H[s:e] for s, e in group_bounds(group_start_N)]
        k = self.hard_negatives
        if k is None:
            return groups
        fixed = []
        for g in groups:
            if len(g) < 3:
                raise ValueError("hard_negatives needs at least one negative in every group")
            negatives = g[2:]
            keep = torch.arange(k, device=g.device) % len(negatives)
            fixed.append(torch.cat([g[:2], negatives[keep]]))
        return fixed

    def _mask_fakes(self, sims_K: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
        if not self.mask_fake_negative:
            return sims_K
        return sims_K.masked_fill(sims_K > positive.detach() + self.fake_neg_margin, float("-inf"))

    def compute(self, ctx: LossContext) -> LossOutput:
        emb_N_H, marks_N = ctx.head.embeddings(), ctx.fields["group_start"]
        mine = range(len(group_bounds(marks_N)))  # this process's rows are whole groups
        if self.use_batch and dist.is_initialized() and dist.get_world_size() > 1:
            if ctx.shard is not None:
                raise NotImplementedError("InfonceLoss under context parallelism: a sequence's rows are split")
            emb_N_H, marks_N, first = gather_rows(emb_N_H, marks_N)
            mine = range(first, first + len(mine))
        groups = self._groups(emb_N_H, marks_N)
        anchors_G_H = torch.stack([g[0] for g in groups])
        docs = [g[1:] for g in groups]
        first_doc = torch.tensor([0, *(len(d) for d in docs)]).cumsum(0)[:-1].tolist()  # each positive in the bank
        bank_D_H = torch.cat(docs)
        losses = []
        for i in mine:
            g = groups[i]
            own = docs[i] if not self.use_batch else bank_D_H
            target = 0 if not self.use_batch else first_doc[i]
            qd_K = own @ g[0]
            blocks = [self._mask_fakes(qd_K, qd_K[target])]
            if self.include_qq:
                qq_G = (anchors_G_H @ g[0]).index_fill(0, torch.tensor([i], device=qd_K.device), float("-inf"))
                blocks.append(self._mask_fakes(qq_G, qd_K[target]))
            if self.include_dd:
                dd_D = (bank_D_H @ g[1]).index_fill(0, torch.tensor([target], device=qd_K.device), float("-inf"))
                blocks.append(dd_D)
            logits_K = torch.cat(blocks) / self.temperature
            losses.append(F.cross_entropy(logits_K[None], torch.tensor([target], device=logits_K.device)))
        total = torch.stack(losses).sum()
        return LossOutput(total if self.reduction == "sum" else total / len(mine), _similarities(groups))


class _GatherRows(torch.autograd.Function):
    """all_gather of equal-sized row blocks whose backward hands each process the gradient every
    process's loss sent its rows (an all-reduce of the gathered gradient, then its own block)."""

    @staticmethod
    def forward(ctx: Any, local_M_H: torch.Tensor) -> torch.Tensor:  # ctx: torch's, with our `rows`
        blocks = [torch.empty_like(local_M_H) for _ in range(dist.get_world_size())]
        dist.all_gather(blocks, local_M_H.contiguous())
        ctx.rows = slice(dist.get_rank() * local_M_H.shape[0], (dist.get_rank() + 1) * local_M_H.shape[0])
        return torch.cat(blocks)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> torch.Tensor:
        summed = grads[0].contiguous().clone()
        dist.all_reduce(summed)
        return summed[ctx.rows]


def gather_rows(emb_N_H: torch.Tensor, marks_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Every process's rows in rank order (its embeddings differentiable back to where they were
    computed), their group marks, and the index of this process's first group."""
    world, rank, device = dist.get_world_size(), dist.get_rank(), emb_N_H.device
    counts = [torch.zeros(2, dtype=torch.long, device=device) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([emb_N_H.shape[0], int((marks_N != 0).sum())], device=device))
    rows = [int(c[0]) for c in counts]
    width = max(rows)
    pad = width - emb_N_H.shape[0]
    padded_M_H = torch.cat([emb_N_H, emb_N_H.new_zeros(pad, emb_N_H.shape[1])])
    every_W_M_H = _GatherRows.apply(padded_M_H).view(world, width, -1)
    marks = [torch.empty(width, dtype=torch.long, device=device) for _ in range(world)]
    dist.all_gather(
        marks, torch.cat([marks_N.long(), torch.zeros(pad, dtype=torch.long, device=marks_N.device)]).to(device)
    )
    emb_all = torch.cat([every_W_M_H[r, : rows[r]] for r in range(world)])
    marks_all = torch.cat([marks[r][: rows[r]] for r in range(world)])
    return emb_all, marks_all, sum(int(c[1]) for c in counts[:rank])


def _similarities(groups: list[torch.Tensor]) -> dict[str, float]:
    """EmbeddingMetric's numbers: anchor-positive cosine (mean, min, max), and an anchor against the
    other groups' positives (mean)."""
    with torch.no_grad():
        anchors_G_H, positives_G_H = torch.stack([g[0] for g in groups]), torch.stack([g[1] for g in groups])
        pos_G = (anchors_G_H * positives_G_H).sum(-1)
        out = {"pos_sim": float(pos_G.mean()), "pos_sim_min": float(pos_G.min()), "pos_sim_max": float(pos_G.max())}
        if len(groups) > 1:
            cross_G_G = anchors_G_H @ positives_G_H.T
            out["neg_sim"] = float(cross_G_G[~torch.eye(len(groups), dtype=torch.bool)].mean())
        return out
