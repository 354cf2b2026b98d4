"""Optional figures (matplotlib): tau and speedup against budget, the acceptance histogram, the suffix decay,
chimeric shares."""
from __future__ import annotations

from math import nan
from pathlib import Path


def plots(out: Path, rows: list[dict]) -> list[str]:
    """Write the figures that this run's rows support into ``out``; returns their file names ([] without
    matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    by: dict = {}
    for r in rows:
        if r["budget"] and r["tau"] is not None:
            by.setdefault((r["method"].split("@")[0], r["temperature"]), []).append(r)
    if any(len(v) > 1 for v in by.values()):
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for (m, t), rs in sorted(by.items()):
            rs = sorted(rs, key=lambda r: r["budget"])
            axes[0].plot([r["budget"] for r in rs], [r["tau"] for r in rs], marker="o", label=f"{m} T={t:g}")
            # no AR pair at this temperature: a gap, not a plotted speedup of 0
            axes[1].plot([r["budget"] for r in rs], [nan if r["speedup"] is None else r["speedup"] for r in rs],
                         marker="o", label=f"{m} T={t:g}")
        for ax, yl in zip(axes, ("tau (tokens / round)", "speedup vs AR (aggregate)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("budget (tree nodes)")
            ax.set_ylabel(yl)
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "budget_sweep.png", dpi=110)
        plt.close(fig)
        files.append("budget_sweep.png")
    hist_rows = [r for r in rows if r["accept_hist"]]
    if hist_rows:
        fig, ax = plt.subplots(figsize=(8, 4))
        for r in hist_rows:
            h = r["accept_hist"]
            tot = sum(h.values())
            ks = range(max(h) + 1)  # every count up to the largest, so a count no round had plots 0, not a bridge
            ax.plot(ks, [h.get(k, 0) / tot for k in ks], marker=".",
                    label=f"{r['method']} T={r['temperature']:g} b={r['budget']}")
        ax.set_xlabel("accepted draft tokens per round")
        ax.set_ylabel("share of rounds")
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / "accept_hist.png", dpi=110)
        plt.close(fig)
        files.append("accept_hist.png")
    decay = [r for r in rows if r.get("suffix_decay")]
    if decay:
        fig, ax = plt.subplots(figsize=(7, 4))
        for r in decay:
            pts = [(k + 1, v) for k, v in enumerate(r["suffix_decay"]) if v is not None]
            ax.plot([k for k, _ in pts], [v for _, v in pts], marker="o",
                    label=f"{r['method']} T={r['temperature']:g} b={r['budget']}")
        ax.set_xlabel("draft depth k")
        ax.set_ylabel("P(depth k accepted | depth k-1 accepted)")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / "suffix_decay.png", dpi=110)
        plt.close(fig)
        files.append("suffix_decay.png")
    chim = [r for r in rows if r["chimeric_share"] is not None]
    if chim:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        # one bar per row: equal labels (a method at two temperatures) would stack on one category
        ax.bar([f"{r['method']}\nT={r['temperature']:g} b={r['budget']}" for r in chim],
               [r["chimeric_share"] for r in chim])
        ax.set_ylabel("chimeric share of drafted nodes")
        fig.tight_layout()
        fig.savefig(out / "chimeric.png", dpi=110)
        plt.close(fig)
        files.append("chimeric.png")
    return files
