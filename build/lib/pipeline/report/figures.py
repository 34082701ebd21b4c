"""Figures of the report as PNG bytes: Figure 1 (the frequency curve) and the slice bars."""

from __future__ import annotations

import io

from pipeline.report.config import SLICE_LABELS


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def frequency_curve_png(columns: list[str], rows: list[tuple], reference: str) -> bytes:
    """Figure 1: mean NLL (log ppl) per training-count bucket; solid repeats, dashed non-repeats."""
    plt = _pyplot()
    recs = [dict(zip(columns, r)) for r in rows]
    buckets = sorted({r["bucket"] for r in recs})
    labels = {r["bucket"]: r["bucket_label"] for r in recs}
    x_of = {b: i for i, b in enumerate(buckets)}
    models = sorted({r["model"] for r in recs}, key=lambda m: (m != reference, m))
    fig, ax = plt.subplots(figsize=(10, 4.8), dpi=110)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, model in enumerate(models):
        for repeat, style in ((True, "-"), (False, "--")):
            pts = sorted(
                (x_of[r["bucket"]], r["mean_nll"])
                for r in recs
                if r["model"] == model and r["is_repeat"] == repeat
            )
            if not pts:
                continue
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                style,
                marker="o" if repeat else "s",
                color=colours[i % len(colours)],
                label=f"{model} — {'repeats' if repeat else 'non-repeats'}",
            )
    ax.set_xticks(range(len(buckets)))
    ax.set_xticklabels([labels[b] for b in buckets], rotation=30, ha="right")
    ax.set_xlabel("training count of the bigram")
    ax.set_ylabel("log perplexity (mean NLL, nats)")
    ax.set_title("Loss vs training frequency: in-context repeats vs other tokens")
    ax.grid(alpha=0.3)
    ax.legend(
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        title="solid: repeats",
        title_fontsize=7,
    )
    fig.tight_layout()
    return _png(fig)


def slice_bars_png(report, order: list[str]) -> bytes:
    """Perplexity per slice (groups) per model (bars), with bootstrap intervals as error bars."""
    import numpy as np

    plt = _pyplot()
    rows = {r["model"]: r for r in report.rows()}
    slices = list(SLICE_LABELS)
    width = 0.8 / max(len(order), 1)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    x = np.arange(len(slices))
    for i, model in enumerate(order):
        r = rows[model]
        values = np.array([r[f"ppl_{s}"] for s in slices])
        kwargs = {}
        if report.n_bootstrap:
            lo = np.array([r[f"ppl_{s}_lo"] for s in slices])
            hi = np.array([r[f"ppl_{s}_hi"] for s in slices])
            kwargs["yerr"] = np.nan_to_num(np.vstack([values - lo, hi - values]).clip(min=0))
            kwargs["capsize"] = 3
        ax.bar(
            x + (i - (len(order) - 1) / 2) * width,
            np.nan_to_num(values),
            width,
            label=model,
            **kwargs,
        )
    ax.set_xticks(x)
    ax.set_xticklabels([SLICE_LABELS[s] for s in slices])
    ax.set_ylabel("perplexity")
    ax.set_title(
        "Perplexity per slice"
        + (" (95% bootstrap intervals over windows)" if report.n_bootstrap else "")
    )
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _png(fig)


def _png(fig) -> bytes:
    plt = _pyplot()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()
