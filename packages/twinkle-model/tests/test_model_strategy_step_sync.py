"""The data-parallel path an engine takes when its parameter set changes between steps (the server's
multi-LoRA shards): each rank scales its mean loss by its share of the batch
(`data_parallel_weights`) and the gradients are summed at step time (`sum_gradients`). Two real
processes over a gloo group must get the one-process gradient of the whole batch."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from twinkle.model.strategy import data_parallel_weights, sum_gradients

ROWS = torch.arange(12, dtype=torch.float32).reshape(4, 3) / 7.0
TARGETS = torch.tensor([0.5, -1.0, 2.0, 0.25])
SPLIT = {0: slice(0, 3), 1: slice(3, 4)}  # uneven: 3 rows and 1


def _model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def _mean_loss(model, rows, targets):
    return ((model(rows).squeeze(-1) - targets) ** 2).mean()


def _rank(rank: int, init_file: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        model = _model()
        rows, targets = ROWS[SPLIT[rank]], TARGETS[SPLIT[rank]]
        (weight,) = data_parallel_weights([len(rows)])
        (_mean_loss(model, rows, targets) * weight).backward()
        sum_gradients(list(model.parameters()))
        # a parameter only one rank touched: the other joins with zeros
        lonely = torch.nn.Parameter(torch.zeros(2))
        if rank == 0:
            lonely.grad = torch.tensor([1.0, 2.0])
        sum_gradients([lonely])
        out[rank] = {
            "weight": weight,
            "grads": [p.grad.clone() for p in model.parameters()],
            "lonely": lonely.grad.clone(),
            "empty": data_parallel_weights([]),
        }
    finally:
        dist.destroy_process_group()


def test_rank_shares_and_summed_gradients_equal_one_process(tmp_path):
    reference = _model()
    _mean_loss(reference, ROWS, TARGETS).backward()
    with mp.Manager() as manager:
        out = manager.dict()
        # forked: the test module is not importable by name in a spawned child
        mp.start_processes(_rank, args=(str(tmp_path / "init"), out), nprocs=2, join=True, start_method="fork")
        results = dict(out)
    assert [results[r]["weight"] for r in (0, 1)] == [0.75, 0.25]
    assert results[0]["empty"] == []
    for rank in (0, 1):
        for got, want in zip(results[rank]["grads"], (p.grad for p in reference.parameters())):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        assert results[rank]["lonely"].tolist() == [1.0, 2.0]


def test_one_process_needs_no_group():
    assert data_parallel_weights([5, 0]) == [1.0, 1.0]
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([3.0, 4.0])
    sum_gradients([p])
    assert p.grad.tolist() == [3.0, 4.0]
