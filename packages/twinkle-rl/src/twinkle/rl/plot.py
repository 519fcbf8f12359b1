"""Learning curves as PNG (matplotlib is the optional `twinkle-rl[plot]` extra)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def save_curves(
    path,
    curves: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    title: str = "",
    xlabel: str = "step",
    ylabel: str = "",
) -> Path | None:
    """Plot named (xs, ys) curves into `path`; returns the path, or None when matplotlib is missing
    (the curve is printed by the caller anyway)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    for name, (xs, ys) in curves.items():
        ax.plot(list(xs), list(ys), marker="o", markersize=3, label=name)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
