"""The examples' loss curve: per-step losses and their running mean, saved as a PNG (matplotlib, Agg)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np


def save_curve(losses: list[float], plot: Path, ylabel: str, title: str, color: str,
               losses_json: Optional[Path] = None) -> None:
    """Write the plot (and, when asked, the losses as json)."""
    if losses_json:
        losses_json.write_text(json.dumps(losses))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=110)
    ax.plot(losses, lw=0.8, color="#999", label="per step")
    w = max(1, len(losses) // 30)
    ax.plot(np.arange(w - 1, len(losses)), np.convolve(losses, np.ones(w) / w, "valid"), color=color,
            label=f"mean of {w}")
    ax.set(xlabel="step", ylabel=ylabel, title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(plot)
    print(f"wrote {plot}")
