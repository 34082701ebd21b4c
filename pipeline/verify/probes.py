"""Checks of the probes (`arslice probe`, docs/design.md "Probes of a checkpoint"): each folder's
files whole and of their writer's schema, their rows as many as its meta.json counts, keyed once
each in order, the layout of the sequences as the definitions place them, and every summary (the
induction score, its curve, recall by k and by distance, the loss by position) recomputed from
the rows it summarises; folders of one vocabulary and one set of sizes read the same sequences."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ar_slicing.machinery.layout import PROBE_FILES, is_complete
from pipeline.verify.checks import Checks

# a recomputed summary and the stored one agree to this (both float64 sums of the same rows)
TOLERANCE = 1e-9


def _close(a, b) -> bool:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return a.shape == b.shape and bool(
        np.all((np.isnan(a) & np.isnan(b)) | (np.abs(a - b) <= TOLERANCE * (1 + np.abs(b))))
    )


def _same_frame(got, stored, keys: list[str]) -> str | None:
    """None when the polars frames `got` (recomputed) and `stored` hold the same rows (every
    numeric column within TOLERANCE), else what differs."""
    if stored.columns != got.columns:
        return f"columns {stored.columns}, recomputed {got.columns}"
    if stored.height != got.height:
        return f"{stored.height} rows, recomputed {got.height}"
    stored, got = stored.sort(keys), got.sort(keys)
    for c in got.columns:
        a, b = got[c], stored[c]
        if a.dtype.is_numeric() and b.dtype.is_numeric():
            if not _close(a.to_numpy(), b.to_numpy()):
                return f"column {c} differs from its rows' (first at row {_first_diff(a, b)})"
        elif a.to_list() != b.to_list():
            return f"column {c} differs from its rows'"
    return None


def _first_diff(a, b) -> int:
    x, y = a.to_numpy().astype(np.float64), b.to_numpy().astype(np.float64)
    bad = np.flatnonzero(
        ~((np.isnan(x) & np.isnan(y)) | (np.abs(x - y) <= TOLERANCE * (1 + abs(y))))
    )
    return int(bad[0]) if bad.size else -1


def _keys_once_in_order(df, keys: list[str]) -> str | None:
    """None when `keys` strictly increase row by row (each key once, sorted), else what is wrong."""
    k = df.select(keys).to_numpy().astype(np.int64)
    if k.shape[0] < 2:
        return None
    step = k[1:] - k[:-1]
    # lexicographic: the first non-zero difference of each row pair must be positive
    nonzero = step != 0
    first = np.argmax(nonzero, axis=1)
    sign = step[np.arange(step.shape[0]), first]
    bad = np.flatnonzero(~nonzero.any(axis=1) | (sign < 0))
    if bad.size:
        i = int(bad[0]) + 1
        return f"row {i} ({', '.join(f'{c}={v}' for c, v in zip(keys, k[i]))}) duplicated or out of order"
    return None


def _counted_and_keyed(df, where: str, counted, checks: Checks) -> str | None:
    """Check that a probe table has the rows meta.json counts; what is wrong with its keys."""
    checks.check(
        df.height == counted,
        f"{where}: {df.height:,} rows, as meta.json counts",
        f"meta.json counts {counted}",
    )
    return _keys_once_in_order(df, ["seq_id", "pos"])


def verify_probes(d: Path, meta: dict, layout, checks: Checks) -> None:
    """Every check of one complete probes/<name>/ folder."""
    import polars as pl

    from ar_slicing.analysis.probes import induction, recall
    from ar_slicing.machinery.parts import damage

    files = {name: d / name for names in PROBE_FILES.values() for name in names}
    missing = [name for name, path in files.items() if not path.is_file()]
    if not checks.check(not missing, f"{d}: every probe file present", f"missing {missing}"):
        return
    schemas = {
        "induction.parquet": induction.induction_schema(),
        "recall.parquet": recall.recall_schema(),
    }
    problems = [p for name, path in files.items() if (p := damage(path, schemas.get(name)))]
    for problem in problems:
        checks.fail(problem)
    if problems:
        return
    read = {name: pl.read_parquet(path) for name, path in files.items()}
    counts = meta.get("counts", {})

    losses = layout.losses(d.name)
    checks.check(
        is_complete(losses),
        f"{d}: made from the complete losses {losses}",
        "no complete losses folder of that name; rerun `arslice eval`, then `arslice probe`",
    )

    ind = read["induction.parquet"]
    where = f"{d / 'induction.parquet'}"
    problem = _counted_and_keyed(ind, where, counts.get("induction_rows"), checks)
    if problem is None:
        n = int(ind["pos"].max()) // 2
        copy = np.where(ind["pos"].to_numpy() <= n, 1, 2)
        index = ind["pos"].to_numpy() - n * (copy - 1)
        if not np.array_equal(ind["copy"].to_numpy(), copy):
            problem = f"copy is not 1 up to pos {n} and 2 after it"
        elif not np.array_equal(ind["scored"].to_numpy(), index >= 2):
            problem = "scored is not every position but the first of each copy"
        elif not bool(np.isfinite(ind["nll"].to_numpy()).all() and (ind["nll"] >= 0).all()):
            problem = "an NLL that is negative or not finite"
    checks.check(
        problem is None,
        f"{where}: rows keyed by (seq_id, pos), as the probe lays them out",
        problem or "",
    )
    if problem is None:
        score = induction.induction_score(ind, n_bootstrap=0)
        stored = read["induction_score.parquet"]
        same = all(
            _close(score[k], stored[k][0])
            for k in ("score", "first_nll", "second_nll", "second_accuracy")
        )
        same = same and _close(score["score"], meta.get("induction_score", {}).get("score", np.nan))
        checks.check(
            same, f"{d / 'induction_score.parquet'}: the score its rows give (and meta.json's)"
        )
        diff = _same_frame(induction.induction_curve(ind), read["induction_curve.parquet"], ["pos"])
        checks.check(
            diff is None, f"{d / 'induction_curve.parquet'}: the curve its rows give", diff or ""
        )

    rec = read["recall.parquet"]
    where = f"{d / 'recall.parquet'}"
    problem = _counted_and_keyed(rec, where, counts.get("recall_rows"), checks)
    if problem is None and not set(rec["role"].unique().to_list()) <= set(recall.ROLES):
        problem = f"a role outside {recall.ROLES}"
    checks.check(problem is None, f"{where}: rows keyed by (seq_id, pos)", problem or "")
    if problem is None:
        by_k = recall.recall_by_k(rec, int(meta.get("head_rows", 1)), n_bootstrap=0)
        stored = read["recall_by_k.parquet"]
        plain = [c for c in by_k.columns if not c.endswith(("_lo", "_hi"))]
        diff = _same_frame(by_k.select(plain), stored.select(plain), ["k"])
        recorded = meta.get("recall_accuracy", {})
        if diff is None and not _close(
            by_k["accuracy"].to_numpy(), [recorded.get(str(k), np.nan) for k in by_k["k"]]
        ):
            diff = "meta.json's recall_accuracy is not the rows'"
        checks.check(
            diff is None,
            f"{d / 'recall_by_k.parquet'}: the accuracy and NLL its rows give",
            diff or "",
        )
        diff = _same_frame(
            recall.recall_by_distance(rec), read["recall_by_distance.parquet"], ["k", "distance"]
        )
        checks.check(
            diff is None, f"{d / 'recall_by_distance.parquet'}: what its rows give", diff or ""
        )

    pos = read["position.parquet"]
    all_tokens = int(pos.filter(pl.col("slice") == "all")["tokens"].sum())
    checks.check(
        all_tokens == counts.get("position_tokens"),
        f"{d / 'position.parquet'}: {all_tokens:,} tokens by position, as meta.json counts",
        f"meta.json counts {counts.get('position_tokens')}",
    )


def verify_same_sequences(metas: dict[Path, dict], checks: Checks) -> None:
    """Probes of one vocabulary (the same drawable ids) and the same sizes and seed read the same
    sequences: their `sequences_digest` agree."""
    groups: dict[tuple, dict[str, list[Path]]] = {}
    for d, meta in metas.items():
        cfg = meta.get("config", {})
        key = (
            meta.get("vocabulary_digest"),
            meta.get("prefix_token"),
            *(repr(cfg.get(k)) for k in ("seed", "induction_length", "induction_sequences",
                                         "recall_pairs", "recall_queries")),
        )  # fmt: skip
        groups.setdefault(key, {}).setdefault(meta.get("sequences_digest"), []).append(d)
    for by_digest in groups.values():
        folders = [d for ds in by_digest.values() for d in ds]
        if len(folders) < 2:
            continue
        listing = "; ".join(
            f"{str(k)[:12]}…: {', '.join(p.name for p in ds)}" for k, ds in by_digest.items()
        )
        checks.check(
            len(by_digest) == 1,
            f"probes of one vocabulary and sizes read the same sequences ({len(folders)} folders)",
            f"sequences differ: {listing}",
        )
