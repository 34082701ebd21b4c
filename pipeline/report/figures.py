"""Figures of the report as PNG bytes: Figure 1 (the frequency curve), the slice bars, the
recall gain and the copy-length curve."""

from __future__ import annotations

import math

from ar_slicing.analysis.seeds import recipes
from ar_slicing.analysis.slices import TABLE1_SLICES
from pipeline.plotting import png_bytes as _png
from pipeline.plotting import pyplot as _pyplot


# Figure 1's panels per row: readable side by side up to three, then four to a row.
def _grid(n: int) -> tuple[int, int]:
    cols = max(1, min(n, 3 if n <= 6 else 4))
    return math.ceil(n / cols), cols


def _panels(plt, n: int):
    """(figure, axes, columns) of Figure 1's grid: one panel per model, shared axes."""
    n_rows, n_cols = _grid(n)
    fig, axes = plt.subplots(
        n_rows,
        n_cols,
        figsize=(4.2 * n_cols, 3.0 * n_rows + 0.9),
        dpi=110,
        sharex=True,
        sharey=True,
        squeeze=False,
        layout="constrained",
    )
    return fig, axes, n_cols


def _label_x(axes, n: int, n_cols: int, ticks, labels, xlabel: str) -> None:
    """Ticks and tick labels on every one of the `n` panels (a shared x axis would hide them
    above an empty slot of the grid), the axis title under each column's lowest panel."""
    lowest = {i % n_cols: i for i in range(n)}.values()
    for i, ax in enumerate(axes.flat[:n]):
        ax.set_xticks(ticks, labels, fontsize=8)
        ax.minorticks_off()
        ax.xaxis.set_tick_params(labelbottom=True)
        if i in lowest:
            ax.set_xlabel(xlabel, fontsize=9)


def bucket_x(bucket: int) -> float:
    """Where a training-count bucket sits on Figure 1's log axis: the geometric middle of its
    decade (bucket k >= 1 holds counts 10^(k-1) .. 10^k - 1), and count 0 one decade below 1."""
    return 10 ** (bucket - 0.5)


def frequency_curve_png(columns: list[str], rows: list[tuple], reference: str) -> bytes:
    """Figure 1: mean NLL (log ppl) per training-count decade bucket, one panel per model with
    shared axes; solid repeats, dashed non-repeats, the reference's two curves grey in the others."""
    plt = _pyplot()
    recs = [dict(zip(columns, r)) for r in rows]
    buckets = sorted({r["bucket"] for r in recs}) or [0]
    models = sorted({r["model"] for r in recs}, key=lambda m: (m != reference, m))
    curves = {
        (model, repeat): sorted(
            (bucket_x(r["bucket"]), r["mean_nll"])
            for r in recs
            if r["model"] == model and r["is_repeat"] == repeat
        )
        for model in models
        for repeat in (True, False)
    }
    fig, axes, n_cols = _panels(plt, len(models))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ((True, "-", "o", "repeats"), (False, "--", "s", "non-repeats"))
    for i, model in enumerate(models):
        ax = axes.flat[i]
        if model != reference:
            for repeat, style, marker, _ in styles:
                pts = curves[(reference, repeat)]
                if pts:
                    ax.plot(*zip(*pts), style, marker=marker, ms=3, color="0.7", lw=1.2)
        for repeat, style, marker, _ in styles:
            pts = curves[(model, repeat)]
            if pts:
                ax.plot(*zip(*pts), style, marker=marker, ms=4, color=colours[i % len(colours)])
        ax.set_title(model + (" (reference)" if model == reference else ""), fontsize=10)
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(models) :]:
        ax.set_visible(False)
    # ticks at the decade edges (count 0 gets the decade below 1), a point inside each decade
    edges = [0] + list(range(1, max(buckets) + 1))
    ticks = [10.0 ** (b - 1) for b in edges]
    tick_labels = ["0", "1", "10"] + [f"$10^{{{k}}}$" for k in range(2, max(buckets))]
    _label_x(axes, len(models), n_cols, ticks, tick_labels[: len(ticks)],
             "training count of the bigram (decades)")  # fmt: skip
    for ax in axes[:, 0]:
        ax.set_ylabel("mean NLL (nats)")
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], ls=s, marker=m, color="k", label=lab) for _, s, m, lab in styles]
    handles.append(Line2D([], [], color="0.7", label=f"{reference} (reference)"))
    fig.suptitle("Loss vs training frequency: in-context repeats vs other tokens", fontsize=11)
    fig.legend(handles=handles, loc="outside lower center", ncol=3, fontsize=8, frameon=False)
    return _png(fig)


def copy_length_png(rows: list[dict], reference: str) -> bytes:
    """Mean NLL vs copy length (`ar_slicing.analysis.copy_length` rows, spans "novel_seen"): one panel per
    model as in Figure 1, copy-length buckets on a log axis, the copied span novel (training
    count 0) or seen; the dotted line is the model's non-repeats, the reference grey in the
    others. A point per bucket of at least 20 tokens."""
    plt = _pyplot()
    models = sorted({r["model"] for r in rows}, key=lambda m: (m != reference, m))

    def curve(model, span):
        return sorted(
            (2 ** (r["copy_bucket"] - 1) * math.sqrt(2), r["mean_nll"])
            for r in rows
            if r["model"] == model
            and r["copy_bucket"] > 0
            and r["span_bucket"] == span
            and r["n_tokens"] >= 20
        )

    def baseline(model):
        return next(
            (r["mean_nll"] for r in rows if r["model"] == model and not r["copy_bucket"]), None
        )

    fig, axes, n_cols = _panels(plt, len(models))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ((0, "-", "o", "novel span (training count 0)"), (1, "--", "s", "seen span"))
    top = max((r["copy_bucket"] for r in rows), default=1)
    for i, model in enumerate(models):
        ax = axes.flat[i]
        if model != reference:
            for span, style, marker, _ in styles:
                pts = curve(reference, span)
                if pts:
                    ax.plot(*zip(*pts), style, marker=marker, ms=3, color="0.7", lw=1.2)
        for span, style, marker, _ in styles:
            pts = curve(model, span)
            if pts:
                ax.plot(*zip(*pts), style, marker=marker, ms=4, color=colours[i % len(colours)])
        if baseline(model) is not None:
            ax.axhline(baseline(model), ls=":", color=colours[i % len(colours)], lw=1)
        ax.set_title(model + (" (reference)" if model == reference else ""), fontsize=10)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(models) :]:
        ax.set_visible(False)
    ticks = [2**k for k in range(top)]
    _label_x(axes, len(models), n_cols, ticks, [str(t) for t in ticks],
             "copy length match_len (buckets 1, 2-3, 4-7, ...)")  # fmt: skip
    for ax in axes[:, 0]:
        ax.set_ylabel("mean NLL (nats)")
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], ls=s, marker=m, color="k", label=lab) for _, s, m, lab in styles]
    handles.append(Line2D([], [], ls=":", color="k", label="non-repeats"))
    handles.append(Line2D([], [], color="0.7", label=f"{reference} (reference)"))
    fig.suptitle("Loss vs copy length: how long a span is being copied", fontsize=11)
    fig.legend(handles=handles, loc="outside lower center", ncol=4, fontsize=8, frameon=False)
    return _png(fig)


def recall_gain_png(t1) -> bytes:
    """The in-context recall gain per model (`ar_slicing.analysis.table1.Table1`), with its interval."""
    import numpy as np

    plt = _pyplot()
    recs = t1.records()
    names = [r["model"] for r in recs]
    gain = np.array([r["recall_gain"] for r in recs])
    fig, ax = plt.subplots(figsize=(6, 0.45 * len(recs) + 1.3), dpi=110)
    kwargs = {}
    if t1.n_bootstrap:
        lo = np.array([r["recall_gain_lo"] for r in recs])
        hi = np.array([r["recall_gain_hi"] for r in recs])
        kwargs = {
            "xerr": np.nan_to_num(np.vstack([gain - lo, hi - gain]).clip(min=0)),
            "capsize": 3,
        }
    y = np.arange(len(recs))[::-1]
    colours = ["0.55" if m == t1.reference else "C0" for m in names]
    ax.barh(y, np.nan_to_num(gain), color=colours, **kwargs)
    ax.set_yticks(y)
    ax.set_yticklabels(names, fontsize=8)
    ax.axvline(0, color="k", lw=0.8)
    ax.set_xlabel("recall gain (nats): non-repeats minus repeats of equal training count")
    ax.set_title(
        "In-context recall gain" + (" (95% intervals)" if t1.n_bootstrap else ""), fontsize=10
    )
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def slice_bars_png(report, order: list[str]) -> bytes:
    """Perplexity per slice of Table 1 (groups) per model (bars), with bootstrap intervals as
    error bars."""
    import numpy as np

    plt = _pyplot()
    rows = {r["model"]: r for r in report.rows()}
    slices = [s.name for s in TABLE1_SLICES]
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
    ax.set_xticklabels([s.label for s in TABLE1_SLICES])
    ax.set_ylabel("perplexity")
    ax.set_title(
        "Perplexity per slice"
        + (" (95% bootstrap intervals over windows)" if report.n_bootstrap else "")
    )
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _png(fig)


def _runs(
    ax,
    runs: dict[str, list[tuple]],
    colour,
    label: str | None,
    style: str = "-",
    alpha: float = 0.18,
    marker: str | None = "o",
) -> None:
    """The runs of one recipe (run name -> its (x, y) points) in one colour: a single run as a
    line; several as thin lines and, where two or more have a point at the same x, the band from
    their least to their greatest value (`ar_slicing.analysis.seeds`)."""
    import numpy as np

    several = len(runs) > 1
    for k, pts in enumerate(runs.values()):
        pts = sorted((x, y) for x, y in pts if y is not None and np.isfinite(y))
        if pts:
            ax.plot(*zip(*pts), style, marker=marker, ms=3 if several else 4, color=colour,
                    lw=0.8 if several else 1.2, label=label if k == 0 else None)  # fmt: skip
    if not several:
        return
    at: dict[float, list[float]] = {}
    for pts in runs.values():
        for x, y in pts:
            if y is not None and np.isfinite(y):
                at.setdefault(x, []).append(y)
    xs = sorted(x for x, ys in at.items() if len(ys) > 1)
    if xs:
        lo = [min(at[x]) for x in xs]
        hi = [max(at[x]) for x in xs]
        ax.fill_between(xs, lo, hi, color=colour, alpha=alpha, lw=0)


def _recipe_label(recipe: str, runs) -> str:
    return recipe if len(runs) == 1 else f"{recipe} ({len(runs)} seeds, band: their range)"


def emergence_png(rows: list[dict]) -> bytes:
    """Recall emergence (`ar_slicing.analysis.emergence` rows): the in-context recall gain against the
    training tokens seen (log axis), one line per model with its 95% band, and the gain at
    training count 0 dashed in the same colour. The runs of one recipe (models `<recipe>` and
    `<recipe>-seed<n>`) share a colour, each a thin line, and the band is then their spread
    (least to greatest run at each point) instead. A point at 0 tokens (the initial weights) has
    no place on a log axis: it is in the table, not drawn."""
    import numpy as np

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    groups = recipes(r["model"] for r in rows)
    for i, (recipe, runs) in enumerate(groups.items()):
        colour = colours[i % len(colours)]
        for key, style, label in (
            ("recall_gain", "-", _recipe_label(recipe, runs)),
            ("recall_gain_count0", "--", None),
        ):
            pts = {m: [(r["tokens_seen"], r[key]) for r in rows
                       if r["model"] == m and r["tokens_seen"] > 0] for m in runs}  # fmt: skip
            _runs(ax, pts, colour, label, style, alpha=0.18 if style == "-" else 0.08)
            if len(runs) > 1:
                continue
            mine = [r for r in rows if r["model"] == runs[0] and r["tokens_seen"] > 0]
            x = np.array([r["tokens_seen"] for r in mine], dtype=float)
            lo = np.array([r[f"{key}_lo"] for r in mine], dtype=float)
            hi = np.array([r[f"{key}_hi"] for r in mine], dtype=float)
            if np.isfinite(lo).any():
                ax.fill_between(x, lo, hi, color=colour, alpha=0.12 if style == "-" else 0.06)
    ax.set_xscale("log")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xlabel("training tokens seen")
    ax.set_ylabel("in-context recall gain (nats)")
    ax.set_title("Recall emergence: solid all bigrams, dashed never seen in training", fontsize=10)
    ax.grid(alpha=0.3)
    if groups:
        ax.legend(fontsize=8, title="model (95% bands)", title_fontsize=8)
    fig.tight_layout()
    return _png(fig)


def probes_png(curve: list[dict], by_k: list[dict], position: list[dict]) -> bytes:
    """The probes of the run's models (`probe_induction_curve`, `probe_recall_by_k` and
    `probe_position` rows of the models, not their checkpoints): the induction loss by position
    on repeated random tokens (the second copy starts after the dotted line), zero-shot recall
    accuracy against k pairs in context (with the 1/k guess, dotted), and the loss by window
    position on the run's text, all tokens solid and AR hits dashed (log position axis)."""
    import numpy as np

    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2), dpi=110)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    groups = recipes(r["model"] for r in (*curve, *by_k, *position))
    ax_ind, ax_rec, ax_pos = axes
    for i, (recipe, runs) in enumerate(groups.items()):
        colour = colours[i % len(colours)]
        label = _recipe_label(recipe, runs)

        def of(rows, x, y, runs=runs, **where):
            return {m: [(r[x], r[y]) for r in rows if r["model"] == m
                        and all(r[k] == v for k, v in where.items())] for m in runs}  # fmt: skip

        _runs(ax_ind, of(curve, "pos", "mean_nll"), colour, label, marker=None)
        _runs(ax_rec, of(by_k, "k", "accuracy"), colour, label)
        for slice_name, style in (("all", "-"), ("ar", "--")):
            _runs(ax_pos, of(position, "pos", "mean_nll", slice=slice_name), colour,
                  label if slice_name == "all" else None, style, marker=None)  # fmt: skip
    n = max((r["pos"] for r in curve), default=0) // 2
    if n:
        ax_ind.axvline(n + 0.5, color="k", lw=0.8, ls=":")
    ax_ind.set_xlabel("position in x + x (random tokens)")
    ax_ind.set_ylabel("mean NLL (nats)")
    ax_ind.set_title("Induction: loss by position", fontsize=10)
    ks = sorted({r["k"] for r in by_k})
    if ks:
        ax_rec.plot(ks, 1 / np.array(ks, dtype=float), ":", color="grey", label="1/k guess")
        ax_rec.set_xscale("log", base=2)
        ax_rec.set_xticks(ks, [str(k) for k in ks])
    ax_rec.set_ylim(-0.02, 1.02)
    ax_rec.set_xlabel("key-value pairs in context (k)")
    ax_rec.set_ylabel("accuracy at the queries")
    ax_rec.set_title("Zero-shot key-value recall", fontsize=10)
    ax_pos.set_xscale("log")
    ax_pos.set_xlabel("position in the window")
    ax_pos.set_ylabel("mean NLL (nats)")
    ax_pos.set_title("Loss by position: all tokens solid, AR hits dashed", fontsize=10)
    for ax in axes:
        ax.grid(alpha=0.3)
    if groups:
        ax_rec.legend(fontsize=8)
    fig.tight_layout()
    return _png(fig)


def probes_training_png(rows: list[dict]) -> bytes:
    """The probes along training (the report's probes rows with `tokens_seen`): per model, the
    induction score, zero-shot recall accuracy (mean over k) and the recall gain on the run's
    text against the training tokens seen (log axis), side by side, so a rise of one can be read
    against the others. Points at 0 tokens are in the table, not drawn."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2), dpi=110, sharex=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    groups = recipes(r["of_model"] for r in rows)
    panels = (
        ("induction_score", "induction score (nats)", "Induction score"),
        ("recall_accuracy", "accuracy (mean over k)", "Zero-shot key-value recall"),
        ("recall_gain", "recall gain (nats)", "In-context recall gain on the run's text"),
    )
    for i, (recipe, runs) in enumerate(groups.items()):
        colour = colours[i % len(colours)]
        for ax, (key, _label, _title) in zip(axes, panels):
            pts = {m: [(r["tokens_seen"], r[key]) for r in rows
                       if r["of_model"] == m and (r["tokens_seen"] or 0) > 0] for m in runs}  # fmt: skip
            _runs(ax, pts, colour, _recipe_label(recipe, runs))
    for ax, (_key, label, title) in zip(axes, panels):
        ax.set_xscale("log")
        ax.axhline(0, color="k", lw=0.8)
        ax.set_xlabel("training tokens seen")
        ax.set_ylabel(label)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    if groups:
        axes[0].legend(fontsize=8)
    fig.tight_layout()
    return _png(fig)
