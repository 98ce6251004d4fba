"""Small helpers the figure modules share: which recorded rows to draw, and the note drawn
in place of a figure while there are none (GPU rows arrive later than the notebooks)."""
from __future__ import annotations

from dsv4lab import results


def latest(rows, keys, *, smoke: bool = False) -> list[dict]:
    """Newest row per configuration (``keys``); GPU rows only unless ``smoke``."""
    return results.latest([r for r in rows if bool(r.get("smoke")) == smoke], keys)


def note(ax, text):
    """``text`` in the middle of ``ax``, no ticks: what a plot shows when it has no rows."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])
