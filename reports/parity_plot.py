"""`verify parity --plot FILE`: each layer's error and noise (to float64) for K, V and the hidden state, as a PNG.

Takes plain data (the parity report's `series()`), so it needs neither torch nor the exporters; matplotlib
is the optional extra `plot`, imported only here and only when a plot is asked for.

    series = {"layers": [0, 1, ...], "first_bad_layer": 3 | None, "title": "...",
              "key": {"error": [...], "noise": [...], "bound": [...]}, "value": {...}, "hidden": {...}}

One panel per tensor (hidden state, K, V; those present), log-scale y: the graph's RMS error to float64,
PyTorch's own rounding noise in the graph's dtype, and the budget's bound; a vertical line marks the first
layer out of budget.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llama_tools.outputs import files, paths

EXTRA = "plot"
PANELS = (("hidden", "hidden state $Z^{j+1}$\n(channels in RMS units)"), ("key", "present K"), ("value", "present V"))
SUFFIXES = (".png",)


def check_plot_path(path: str | Path) -> Path:
    """Cheap checks before any work: a .png we could write, and matplotlib installed (one line naming the extra)."""
    p = Path(path)
    if p.suffix.lower() not in SUFFIXES:
        raise ValueError(f"--plot {path}: write a .png file (the name decides the format)")
    paths.check_output_path(p)
    matplotlib()
    return p


def matplotlib() -> Any:
    """The matplotlib module with a non-interactive backend, or one line saying which extra installs it."""
    try:
        import matplotlib as mpl
    except ImportError:
        raise ValueError(f"--plot needs matplotlib: pip install 'llama-tools[{EXTRA}]'") from None
    mpl.use("Agg")  # files only: no display, no GUI toolkit
    return mpl


def plot_layers(series: dict[str, Any], path: str | Path, *, dpi: int = 110) -> Path:
    """Draw the per-layer figures of `series` into the PNG `path` (written atomically); returns the path."""
    matplotlib()
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    layers = list(series["layers"])
    assert layers, "a plot needs at least one layer"
    panels = [(k, label) for k, label in PANELS if k in series]
    fig, axes = plt.subplots(len(panels), 1, figsize=(7.5, 2.3 * len(panels) + 0.6), sharex=True, squeeze=False)
    bad = series.get("first_bad_layer")
    tiny = 1e-30  # log scale: an exact zero is drawn at the bottom of the panel, not dropped
    for ax, (key, label) in zip(axes[:, 0], panels):
        s = series[key]
        ax.semilogy(layers, [max(e, tiny) for e in s["error"]], "o-", ms=3, color="#c0392b", label="graph error")
        ax.semilogy(layers, [max(n, tiny) for n in s["noise"]], "s-", ms=3, color="#2c7fb8",
                    label="PyTorch noise (graph dtype)")
        ax.semilogy(layers, s["bound"], "--", color="#555555", lw=1, label="bound")
        positive = [v for v in (*s["error"], *s["noise"], *s["bound"]) if v > 0]
        if positive:
            ax.set_ylim(min(positive) / 3, max(positive) * 3)
        if bad is not None:
            ax.axvline(bad, color="#e67e22", lw=1.5, ls=":", label=f"first layer out of budget ({bad})")
        ax.set_ylabel(f"{label}\nRMS to float64", fontsize=8)
        ax.grid(True, which="major", alpha=0.3)
        ax.tick_params(labelsize=8)
    axes[0, 0].legend(fontsize=7, loc="upper left", ncol=2)
    axes[-1, 0].set_xlabel("decoder layer j", fontsize=8)
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(series.get("title", "verify parity"), fontsize=9)
    fig.tight_layout()
    with files.atomic_file(path) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi)
    plt.close(fig)
    return Path(path)
