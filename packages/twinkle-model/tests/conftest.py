"""Fixtures shared by twinkle-model's tests."""

import random

import pytest
import torch

torch.set_num_threads(2)


def make_rows(n=4, seed=0, vocab=800, length=(6, 14)):
    """Encoded rows with a prompt part masked out of the loss, varied lengths."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        T = rng.randint(*length)
        ids = [rng.randrange(1, vocab) for _ in range(T)]
        prompt = rng.randint(1, T // 2)
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return rows


@pytest.fixture
def rows():
    return make_rows()


@pytest.fixture(scope="session")
def tiny_path():
    from twinkle.hub import TEST_MODEL, resolve_model_path

    return resolve_model_path(TEST_MODEL)
