"""PNG plots for the workloads where a picture says more than the table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def new_figure(columns: int = 1, size: tuple[float, float] = (6.4, 4.0)) -> tuple[Any, Any]:
    """A figure and its ``columns`` axes, drawn by matplotlib's headless backend (no display on a server)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, columns, figsize=size, dpi=100)


def save_figure(figure: Any, path: Path) -> Path:
    """Write ``figure`` to ``path`` (its folder made if need be) and release it."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path


def line_plot(
    path: Path,
    title: str,
    x_label: str,
    y_label: str,
    x: Sequence[float],
    series: Mapping[str, Sequence[float]],
) -> Path:
    """One line per series over shared ``x``."""
    figure, axes = new_figure()
    for name, values in series.items():
        axes.plot(list(x), list(values), marker="o", label=name)
    axes.set_title(title)
    axes.set_xlabel(x_label)
    axes.set_ylabel(y_label)
    axes.grid(True, alpha=0.3)
    axes.legend()
    return save_figure(figure, path)


def bar_plot(path: Path, title: str, y_label: str, bars: Mapping[str, float]) -> Path:
    """One bar per contender."""
    figure, axes = new_figure()
    axes.bar(list(bars), list(bars.values()))
    axes.set_title(title)
    axes.set_ylabel(y_label)
    axes.grid(True, axis="y", alpha=0.3)
    return save_figure(figure, path)
