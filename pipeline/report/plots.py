"""PNG plots per metric group for `pipeline report --plots` (matplotlib, imported when plotting:
optional and slow to import)."""

from __future__ import annotations

from pathlib import Path

from pipeline.report.logs import GROUPS, Run


def plot(runs: list[Run], out_dir: Path, size: int) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for group, metrics in GROUPS.items():
        fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.6), squeeze=False)
        for ax, metric in zip(axes[0], metrics):
            for run in runs:
                steps, values = run.series(metric)
                if not values:
                    continue
                line, = ax.plot(steps, values, alpha=0.25, linewidth=0.8)
                k = max(1, min(size, len(values) // 10 or 1))
                smooth = [sum(values[max(0, i - k + 1):i + 1]) / len(values[max(0, i - k + 1):i + 1]) for i in range(len(values))]
                ax.plot(steps, smooth, color=line.get_color(), linewidth=1.8, label=run.name)
            ax.set_title(metric)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            if metric == "lr":
                ax.set_yscale("log")
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"report-{group}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))
    return written
