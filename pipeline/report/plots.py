"""PNG plots per metric group for `pipeline report --plots` (matplotlib, imported when plotting:
optional and slow to import)."""

from __future__ import annotations

from pathlib import Path

from pipeline.records.eval_result import variants_in
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


def plot_kinds(decoded: dict, out_dir: Path) -> str:
    """Pooled tau per kind of turn, each variant side by side (report-tau-by-kind.png)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    kinds = list(decoded["by_kind"])
    methods = [v for v, _ in variants_in(decoded)]
    per_kind = {k: dict(variants_in(decoded["by_kind"][k])) for k in kinds}
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(kinds), 3.6))
    width = 0.8 / len(methods)
    for m, method in enumerate(methods):
        values = [per_kind[k].get(method, 0.0) for k in kinds]
        ax.bar([i + m * width for i in range(len(kinds))], values, width, label=method.plot_label)
    ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(kinds))])
    ax.set_xticklabels([f"{k.replace('_', '-')}\n({decoded['by_kind'][k]['prompts']} prompts)" for k in kinds])
    ax.set_ylabel("tau (pooled)")
    ax.set_title("decoded tau by kind of turn")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "report-tau-by-kind.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
