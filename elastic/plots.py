"""PNG plots of a run for `elastic report`: loss, world size over time, where the time went.

matplotlib is imported here only, inside the functions, so the CLI and the
workers never pay its import time. The figures use matplotlib's
object-oriented API with the Agg canvas (no pyplot): no display is needed and
no global backend state is touched, so plotting works on headless nodes and
inside a process that already imported pyplot with another backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from elastic.commands.report import RunTimeline

SIZE_IN = (8.0, 4.5)
DPI = 120
"""960 x 540 pixels: readable in a browser and in a Markdown page."""

COLORS = {"training": "#4c72b0", "eval": "#da8bc3", "checkpoint stall": "#8172b2", "detection": "#c44e52", "recovery": "#dd8452",
          "lost work": "#937860", "other": "#bbbbbb"}


def _figure():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=SIZE_IN, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _save(fig, path: Path) -> Path:
    fig.savefig(path, format="png")
    return path


def plot_loss(report: dict, tl: RunTimeline, path: Path) -> Path:
    """Loss per kept step and held-out loss per evaluation; rolled-back runs of a step in grey; failures (red) and resizes (green) as vertical lines."""
    fig, ax = _figure()
    ax.plot(tl.kept_steps, tl.kept_losses, color=COLORS["training"], linewidth=1.2, label="loss (kept steps)")
    if tl.eval_steps:
        # An evaluation after k steps sees the weights that step k+1's training loss is computed with (before its update).
        ax.plot(tl.eval_steps, tl.eval_losses, color=COLORS["eval"], marker="o", markersize=4, linewidth=1.2,
                label="held-out loss")
    if tl.rolled_back:
        steps, losses = zip(*tl.rolled_back)
        ax.scatter(steps, losses, s=6, color="#999999", zorder=3, label="rolled back by a recovery")
    for i, m in enumerate(f for f in tl.failures if f.step is not None):
        ax.axvline(m.step, color="#c44e52", linestyle="--", linewidth=1, label="failure" if i == 0 else None)
        ax.annotate(m.label, (m.step, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -12), textcoords="offset points",
                    color="#c44e52", fontsize=8, rotation=90, va="top")
    for i, m in enumerate(r for r in tl.resizes if r.step is not None):
        ax.axvline(m.step, color="#55a868", linestyle=":", linewidth=1.5, label="resize" if i == 0 else None)
        ax.annotate(m.label, (m.step, 0.0), xycoords=("data", "axes fraction"), xytext=(3, 12), textcoords="offset points",
                    color="#55a868", fontsize=8, rotation=90, va="bottom")
    ax.set(xlabel="step", ylabel="loss", title=f"{report['name']}: loss ({report['state']})")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    return _save(fig, path)


def plot_world_size(report: dict, tl: RunTimeline, path: Path) -> Path:
    """Workers training over time: a step function that drops to 0 from a failure's detection to the next generation."""
    fig, ax = _figure()
    if tl.world:
        times = [t for t, _ in tl.world] + [tl.end_t]
        sizes = [w for _, w in tl.world] + [tl.world[-1][1]]
        ax.step(times, sizes, where="post", color=COLORS["training"], linewidth=1.5, label="workers training")
        ax.set_ylim(0, max(sizes) * 1.2)
    for i, m in enumerate(tl.failures):
        ax.axvline(m.t, color="#c44e52", linestyle="--", linewidth=1, label="failure detected" if i == 0 else None)
    ax.set(xlabel="seconds since job start", ylabel="world size", title=f"{report['name']}: world size over time")
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    return _save(fig, path)


def plot_time_breakdown(report: dict, tl: RunTimeline, path: Path) -> Path:
    """One bar per part of the wall time, labelled with seconds and share."""
    fig, ax = _figure()
    names = list(tl.breakdown)
    values = [tl.breakdown[n] for n in names]
    bars = ax.barh(names, values, color=[COLORS.get(n, "#888888") for n in names])
    wall = tl.wall_s or 1.0
    ax.bar_label(bars, labels=[f"{v:.1f} s ({v / wall:.0%})" for v in values], padding=3, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(values + [1e-9]) * 1.25)
    ax.set(xlabel="seconds", title=f"{report['name']}: where the {tl.wall_s:.1f} s went (goodput {report['goodput']:.1%})")
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def write_plots(report: dict, tl: RunTimeline, run_dir: Path) -> list[Path]:
    """Write loss.png, world_size.png and time_breakdown.png into the run directory; return their paths."""
    return [
        plot_loss(report, tl, run_dir / "loss.png"),
        plot_world_size(report, tl, run_dir / "world_size.png"),
        plot_time_breakdown(report, tl, run_dir / "time_breakdown.png"),
    ]
