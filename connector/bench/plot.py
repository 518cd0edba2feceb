"""PNG plots for the workloads where a picture says more than the table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def line_plot(
    path: Path,
    title: str,
    x_label: str,
    y_label: str,
    x: Sequence[float],
    series: Mapping[str, Sequence[float]],
) -> Path:
    """One line per series over shared ``x``; written with matplotlib's headless backend."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for name, values in series.items():
        axes.plot(list(x), list(values), marker="o", label=name)
    axes.set_title(title)
    axes.set_xlabel(x_label)
    axes.set_ylabel(y_label)
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path


def bar_plot(path: Path, title: str, y_label: str, bars: Mapping[str, float]) -> Path:
    """One bar per contender."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    axes.bar(list(bars), list(bars.values()))
    axes.set_title(title)
    axes.set_ylabel(y_label)
    axes.grid(True, axis="y", alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path
