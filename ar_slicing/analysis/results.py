"""`results.duckdb`: one DuckDB file per run with views over the run's Parquet, for SQL questions.

Objects in the database (all read-only views except the two small tables):

  windows       windows.parquet of the tag stage (window_id, start, n_targets)
  tags          every tags-*.parquet shard (one row per scored validation token)
  losses        every complete losses/<model>/losses-*.parquet, with a `model` column holding
                the losses folder name (the key used everywhere else)
  counts        the training bigram counts (prev, next, count), when the counts dir is present
  token_losses  tags joined with losses on (window_id, pos): one row per (model, scored token)
  models        table: one row per model from its losses meta.json (name, spec, architecture,
                n_params, dtype, device, batch_size, tokens, tokens_per_s, fingerprint, losses_dir)

and, for the recall emergence (`ar_slicing.analysis.emergence`; empty in a run without checkpoints):

  checkpoints              table: one row per point of a model's training curve, each evaluated
                           checkpoint (`losses/<model>@step<n>`) and the model itself when it
                           records its step: model, checkpoint (the losses folder name), step,
                           tokens_seen, final, spec, hub_commit, window_subset, windows_scored,
                           losses_dir
  checkpoint_windows       table: (model, window_id), the windows every point of a model scored
  checkpoint_losses        the points' losses on those windows (model, checkpoint, window_id,
                           pos, nll)
  checkpoint_token_losses  every tag joined with checkpoint_losses, and each point's step and
                           tokens_seen

A checkpoint is not a model of Table 1: `losses`, `token_losses` and `models` hold the models
only, and a checkpoint scored on part of the windows restricts no other view.

and, for the probes (`arslice probe`; docs/design.md, "Probes of a checkpoint"; empty in a run
without them), one row set per complete probes/<name>/ folder of a model or checkpoint above
whose losses it was made from, `model` holding the folder name (`<model>@step<n>` for a
checkpoint):

  probes                    table: one row per probed model or checkpoint: model, checkpoint_of,
                            step, tokens_seen, spec, prefix_token, head_rows, drawable_ids,
                            sequences_digest (equal: the same sequences), probes_dir
  probe_induction           the induction probe's rows (seq_id, pos, token, copy, scored, nll,
                            argmax); probe_induction_scores and probe_induction_curve summarise them
  probe_recall              the zero-shot recall rows (seq_id, k, pos, token, role, pair,
                            distance, nll, argmax); probe_recall_by_k (with the baselines) and
                            probe_recall_by_distance summarise them
  probe_position            the loss by window position per slice (slice, pos, tokens, mean_nll)
  probe_icl                 the in-context learning score per slice, with its positions
  run_info      table: key/value facts about the run (directories, window, threshold,
                fingerprint, default reference, the plan the file was built with and its digest,
                `signature`)

and the SQL objects of the slices and the training-count buckets (`ar_slicing.analysis.slices`): the views
`slice_perplexity`, `slice_perplexity_by_subset` and `slice_token_losses`, the table `slices`,
the table macro `gap_vs_reference(reference)` and the macros `count_bucket`, `count_bucket_lo`, `count_bucket_hi`, `count_bucket_label` and
`ar_threshold()` (the run's AR threshold); and `recipe_of(model)` and `seed_of(model)`, the runs of
one recipe (`ar_slicing.analysis.seeds`).

Paths: the views name the Parquet files by **absolute** path, so the file works unchanged
whichever directory it is opened from (`duckdb.connect("runs/pile/results.duckdb")` from
anywhere, the `duckdb` shell, a notebook). The file follows a stage plan (`ar_slicing.machinery.plan`,
`results_plan`), kept in its own `run_info` (a file beside it would be one more name in the run
directory): its inputs are the place, identity and parts of the tags, the counts and every
complete losses folder; its one setting is the digest of the slices' and buckets' SQL
(`ar_slicing.analysis.slices.definitions_digest`). It keeps no work, so, as the report, it is rebuilt
whenever its inputs or those definitions change: when the run directory is moved or a model is added or
redone, `open_results` rebuilds the file (only views and two tiny tables: it takes well under a
second), so `arslice query` and `arslice report` never read stale paths; the same inputs reuse
it.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ar_slicing import __version__
from ar_slicing.data.tokenizer import require_same_fingerprint
from ar_slicing.errors import BadInput
from ar_slicing.machinery.executor import process_alive
from ar_slicing.machinery.io import atomic_path, read_json, require_writable
from ar_slicing.machinery.layout import (
    BIGRAMS_NAME,
    LOSS_PART_GLOB,
    TAG_PART_GLOB,
    TMP_SUFFIX,
    WINDOWS_NAME,
    RunLayout,
    is_complete,
    is_temporary,
    looks_like_run_dir,
    meta_path,
    require_dir,
)
from ar_slicing.machinery.parts import require_whole

log = logging.getLogger(__name__)

# Model columns of the `models` table, in order, with their DuckDB types.
MODEL_COLUMNS = (
    ("model", "VARCHAR"),
    ("name", "VARCHAR"),
    ("spec", "VARCHAR"),
    ("architecture", "VARCHAR"),
    ("n_params", "BIGINT"),
    ("dtype", "VARCHAR"),
    ("device", "VARCHAR"),
    ("batch_size", "INTEGER"),
    ("tokens", "BIGINT"),
    ("tokens_per_s", "DOUBLE"),
    ("fingerprint", "VARCHAR"),
    ("losses_dir", "VARCHAR"),
)

# A model is taken as the attention reference when its architecture or name says so ...
_ATTENTION = re.compile(r"attention|attn|transformer", re.IGNORECASE)
# ... or, failing that, when it is one of the common attention families and nothing else.
_ATTENTION_FAMILIES = re.compile(r"gpt|llama|pythia|neox|mistral|qwen|opt|bert", re.IGNORECASE)
_NOT_ATTENTION = re.compile(r"hyena|rwkv|conv|mamba|based|s4|h3|ssm|retnet", re.IGNORECASE)


@dataclass
class CheckedRun:
    """What `find_run` found in a run's layout and checked to belong together: the tags'
    meta.json, the store and counts the layout found for them, the complete evaluations, the
    losses folders left out and why, and the windows every model scored. Every path comes from
    `layout`."""

    layout: RunLayout
    tags_meta: dict
    tokens_dir: Path | None  # the tags' validation store (`RunLayout.found_store`)
    counts_dir: Path | None  # the tags' counts (`RunLayout.found_counts`); None: no counts view
    models: list[str] = field(default_factory=list)  # complete losses folders, by name
    skipped_losses: dict[str, str] = field(default_factory=dict)  # folder name -> why
    # When some model was evaluated on windows 0..N-1 only (`arslice eval --max-windows N`), the
    # smallest such N: every view is restricted to those windows so all models are compared on
    # the same tokens. None when every model covers every window.
    scored_windows: int | None = None
    partial_models: dict[str, int] = field(default_factory=dict)  # name -> windows it scored
    # complete losses folders of checkpoints along a model's training (`checkpoint_of`), by name
    checkpoints: list[str] = field(default_factory=list)
    # complete probes folders made from the losses of a model or checkpoint above, by name
    probes: list[str] = field(default_factory=list)
    skipped_probes: dict[str, str] = field(default_factory=dict)  # folder name -> why


def find_run(run_dir: str | os.PathLike) -> CheckedRun:
    """Locate tags, losses, counts and the validation store of the run in `run_dir`, and check
    that they belong together."""
    given = Path(run_dir)
    require_dir(given, "run directory")
    run_dir = given.resolve()
    layout = RunLayout(run_dir)
    tags_dir = layout.tags
    if not is_complete(tags_dir):
        parent = next((p for p in given.resolve().parents if looks_like_run_dir(p)), None)
        if not looks_like_run_dir(run_dir) and parent is not None:
            raise BadInput(
                f"{given} is a folder inside the run directory {parent}; pass --run {parent}"
            )
        raise BadInput(
            f"{tags_dir}: no complete tags (meta.json missing); run `arslice tag ... --out {tags_dir}` first"
        )
    tags_meta = read_json(meta_path(tags_dir))
    shards = layout.tag_parts()
    if not shards:
        raise BadInput(
            f"{tags_dir}: meta.json is there but no {TAG_PART_GLOB}; rerun `arslice tag --overwrite`"
        )
    if not layout.windows.is_file():
        raise BadInput(f"{tags_dir}: no {WINDOWS_NAME}; rerun `arslice tag --overwrite`")
    if "span_order" not in tags_meta:
        raise BadInput(
            f"{tags_dir}: tags without copy lengths (match_len, span_train_count), made by an "
            "older version; rerun `arslice tag --overwrite` (or `make tags`)"
        )

    # The tags record absolute paths; when the run was moved since, the run layout finds them.
    run = CheckedRun(
        layout=layout,
        tags_meta=tags_meta,
        tokens_dir=layout.found_store(tags_meta.get("tokens")),
        counts_dir=layout.found_counts(tags_meta.get("counts_dir")),
    )
    require_whole(shards)  # (cheap: here on every query, so a part cut short is named at once)
    folders = layout.loss_folders()
    for d in folders.incomplete:
        run.skipped_losses[d.name] = "incomplete (no meta.json)"
    for d in folders.complete:
        parts = layout.loss_parts(d.name)
        if not parts:
            run.skipped_losses[d.name] = f"no {LOSS_PART_GLOB}"
            continue
        require_whole(parts)
        meta = read_json(meta_path(d))
        check_losses_belong(d, meta, run)
        if meta.get("checkpoint_of") is not None:
            run.checkpoints.append(d.name)  # (its windows are its model's curve's business)
            continue
        run.models.append(d.name)
        if meta.get("partial"):
            n = int(meta.get("windows_evaluated", 0))
            run.partial_models[d.name] = n
            run.scored_windows = n if run.scored_windows is None else min(n, run.scored_windows)
    run.skipped_losses = dict(sorted(run.skipped_losses.items()))
    for name, why in run.skipped_losses.items():
        log.warning("losses/%s skipped: %s", name, why)
    if run.scored_windows is not None:
        log.warning(
            "partial losses (%s): the results cover windows 0..%d only",
            ", ".join(f"{k}: {n} windows" for k, n in sorted(run.partial_models.items())),
            run.scored_windows - 1,
        )
    _find_probes(run)
    if not run.models:
        losses_root = layout.losses_root
        raise BadInput(
            f"{losses_root}: no complete losses/<model>/ folder; run `arslice eval --tags {tags_dir} "
            f"--out {losses_root}/NAME` for at least one model"
        )
    return run


def _find_probes(run: CheckedRun) -> None:
    """The complete probes folders of the run's models and checkpoints, each made from the
    losses folder of its name as it is now (probes of losses since redone are left out)."""
    from ar_slicing.machinery.plan import identity

    layout = run.layout
    evaluated = set(run.models) | set(run.checkpoints)
    for d in layout.probe_folders().complete:
        meta = read_json(meta_path(d))
        made_from = (meta.get("plan") or {}).get("inputs", {}).get("losses")
        if d.name not in evaluated:
            run.skipped_probes[d.name] = f"no complete losses/{d.name}/ in the run"
        elif made_from != identity(layout.losses(d.name)):
            run.skipped_probes[d.name] = (
                f"made from other losses than losses/{d.name}/ holds now; rerun `arslice probe`"
            )
        else:
            run.probes.append(d.name)
    for name, why in sorted(run.skipped_probes.items()):
        log.warning("probes/%s skipped: %s", name, why)


def check_losses_belong(losses_dir: Path, meta: dict, run: CheckedRun) -> None:
    """Refuse losses scored on other windows than the tags': another window length, another
    validation store or another tokenizer would join each loss to the wrong token."""
    from ar_slicing.machinery.plan import identity

    tags = run.tags_meta
    tags_dir = run.layout.tags
    if meta.get("fingerprint") and tags.get("fingerprint"):
        require_same_fingerprint(
            meta["fingerprint"],
            f"losses {losses_dir}",
            tags["fingerprint"],
            f"tags {tags_dir}",
        )
    problems = []
    if meta.get("window") is not None and tags.get("window") is not None:
        if meta["window"] != tags["window"]:
            problems.append(f"window length: losses {meta['window']}, tags {tags['window']}")
    tokens_dir = run.tokens_dir
    plan_tokens = (meta.get("plan") or {}).get("inputs", {}).get("tokens")
    if plan_tokens and tokens_dir is not None and is_complete(tokens_dir):
        if plan_tokens != identity(tokens_dir):
            problems.append(
                f"validation store: the losses were scored on another {tokens_dir.name} "
                f"store than the tags' {tokens_dir}"
            )
    if problems:
        raise BadInput(
            f"losses {losses_dir} do not belong to the tags {tags_dir} ("
            + "; ".join(problems)
            + f"); re-run `arslice eval --overwrite --tags {tags_dir} --out {losses_dir}`"
        )


def results_plan(run: CheckedRun) -> dict:
    """results.duckdb's stage plan (as JSON). It keeps no work; its one setting is the digest of
    the SQL it defines for the slices and buckets (another version's are rebuilt). Its inputs are what its views and tables read, each by where it is (the views name files by
    absolute path, so a moved run is another input), its identity (a redone input is another
    one), its parts (an evaluation extended to more windows keeps its plan but adds parts) and
    its meta.json as a file (an input redone under the same plan, say with another batch size,
    writes it again, and the tables that copy its fields must follow)."""
    from ar_slicing.analysis.slices import definitions_digest
    from ar_slicing.machinery.plan import StagePlan, file_identity, identity

    layout = run.layout

    def folder_input(folder: Path, parts: list[Path]) -> dict:
        return {
            "path": str(folder),
            "identity": identity(folder),
            "parts": [p.name for p in parts],
            "meta": file_identity(meta_path(folder)),
        }

    counts = None
    if run.counts_dir is not None:
        bigrams = run.counts_dir / BIGRAMS_NAME
        counts = {
            "path": str(bigrams),
            # (counts whose count stage was cut short after bigrams.parquet have no meta.json)
            "identity": identity(run.counts_dir)
            if is_complete(run.counts_dir)
            else file_identity(bigrams),
        }
    inputs = {
        "tags": folder_input(layout.tags, layout.tag_parts()),
        "counts": counts,
        "losses": {
            name: folder_input(layout.losses(name), layout.loss_parts(name)) for name in run.models
        },
        "scored_windows": run.scored_windows,
    }
    if run.checkpoints:  # (recorded only when there are some: other runs keep their plans)
        inputs["checkpoints"] = {
            name: folder_input(layout.losses(name), layout.loss_parts(name))
            for name in run.checkpoints
        }
    if run.probes:  # (likewise)
        inputs["probes"] = {
            name: folder_input(layout.probes(name), probe_files(layout, name))
            for name in run.probes
        }
    settings = {"definitions": definitions_digest()}
    return StagePlan("results", settings=settings, inputs=inputs).as_json()


def sql_string(value: str | os.PathLike) -> str:
    """A SQL string literal. Only for DDL (view definitions cannot take bound parameters)."""
    return "'" + str(value).replace("'", "''") + "'"


def _parquet_list(paths: list[Path]) -> str:
    return "[" + ", ".join(sql_string(p) for p in paths) + "]"


def model_rows(run: CheckedRun) -> list[tuple]:
    """One `models` row per losses folder; refuses losses made with another tokenizer than the tags."""
    rows = []
    tags_fp = run.tags_meta.get("fingerprint")
    for name in run.models:
        d = run.layout.losses(name)
        meta = read_json(meta_path(d))
        fp = meta.get("fingerprint")
        if tags_fp and fp:
            require_same_fingerprint(fp, f"losses {d}", tags_fp, f"tags {run.layout.tags}")
        rows.append(
            (
                name,
                meta.get("name", name),
                meta.get("spec"),
                meta.get("architecture"),
                meta.get("n_params"),
                meta.get("dtype"),
                meta.get("device"),
                meta.get("batch_size"),
                meta.get("tokens"),
                meta.get("tokens_per_s"),
                fp,
                str(d),
            )
        )
    return rows


def default_reference(models: list[tuple[str, str | None, str | None]]) -> str:
    """The reference model: the first (by folder name) whose architecture or name says attention.

    `models` holds (folder name, meta name, architecture). Failing an explicit "attention"/"attn"/
    "transformer", a well-known attention family (GPT, Llama, Pythia, ...) that is not a known
    attention-free one (Hyena, RWKV, ...); failing that, the first model.
    """
    if not models:
        raise BadInput("no models to choose a reference from")
    ordered = sorted(models, key=lambda m: m[0])
    texts = [(m[0], " ".join(str(x) for x in m if x)) for m in ordered]
    for name, text in texts:
        if _ATTENTION.search(text):
            return name
    for name, text in texts:
        if _ATTENTION_FAMILIES.search(text) and not _NOT_ATTENTION.search(text):
            return name
    return ordered[0][0]


def _window_filter(run: CheckedRun) -> str:
    """The WHERE clause restricting every view to the windows all models scored."""
    if run.scored_windows is None:
        return ""
    return f" WHERE window_id < {int(run.scored_windows)}"


def _check_coverage(con, run: CheckedRun) -> None:
    """Every model must have exactly one loss per tag row of the compared windows.

    With complete losses this reads only Parquet footers; with partial ones it counts rows of
    the compared windows.
    """

    def n_rows(paths: list[Path]) -> int:
        if run.scored_windows is None:
            sql = f"SELECT sum(num_rows)::BIGINT FROM parquet_file_metadata({_parquet_list(paths)})"
        else:
            sql = f"SELECT count(*) FROM read_parquet({_parquet_list(paths)}){_window_filter(run)}"
        return int(con.execute(sql).fetchone()[0] or 0)

    layout = run.layout
    n_tags = n_rows(layout.tag_parts())
    _check_points_coverage(con, run)
    for name in run.models:
        n = n_rows(layout.loss_parts(name))
        if n != n_tags:
            scope = "" if run.scored_windows is None else f" in windows 0..{run.scored_windows - 1}"
            raise BadInput(
                f"losses {layout.losses(name)}: {n} rows{scope} but the tags in {layout.tags} have {n_tags}; a losses "
                "folder must hold exactly one row per tag row. Re-run `arslice eval --overwrite` for "
                "this model against these tags."
            )


def _check_points_coverage(con, run: CheckedRun) -> None:
    """Every point of an emergence curve has exactly one loss per tag row of the windows its
    meta.json says it scored (read from Parquet footers)."""
    from ar_slicing.analysis.emergence import losses_windows

    if not run.checkpoints:
        return
    n_targets = window_targets(run)
    for name in run.checkpoints:
        meta = read_json(meta_path(run.layout.losses(name)))
        expected = int(n_targets[losses_windows(meta, len(n_targets))].sum())
        paths = _parquet_list(run.layout.loss_parts(name))
        sql = f"SELECT sum(num_rows)::BIGINT FROM parquet_file_metadata({paths})"
        n = int(con.execute(sql).fetchone()[0] or 0)
        if n != expected:
            raise BadInput(
                f"losses {run.layout.losses(name)}: {n} rows but the windows its meta.json says "
                f"it scored hold {expected} tag rows; re-run `arslice eval --overwrite` for this "
                "checkpoint against these tags."
            )


def window_targets(run: CheckedRun):
    """(W,) the tag rows of each window, from the tags' window table."""
    import pyarrow.parquet as pq

    return pq.read_table(run.layout.windows, columns=["n_targets"]).column(0).to_numpy()


def build_results(run: CheckedRun, plan: dict | None = None) -> Path:
    """Write `<run>/results.duckdb` atomically (built under a temporary name, then renamed),
    recording `plan` (by default `results_plan(run)`) in its `run_info`.

    A full disk raises the `OSError` (ENOSPC) every stage's writes raise, other DuckDB errors a
    `BadInput` naming the file; either way no temporary is left behind, and those of a build
    that was killed are removed first."""
    import duckdb

    path = run.layout.results
    plan = results_plan(run) if plan is None else plan
    rows = model_rows(run)
    reference = default_reference([(r[0], r[1], r[3]) for r in rows])
    _remove_orphaned_temporaries(path)
    with atomic_path(path) as tmp:
        try:
            con = duckdb.connect(str(tmp))
            try:
                _write_results(con, run, rows, reference, plan)
            finally:
                con.close()
        except duckdb.Error as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if "no space left on device" in first.lower():
                raise OSError(
                    errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({first})", str(path)
                ) from None
            raise BadInput(f"{path}: could not be built ({first})") from None
        finally:
            _remove_sidecars(tmp)
        # A write-ahead log left by a crashed writer of the old file would be replayed onto the new one.
        Path(str(path) + ".wal").unlink(missing_ok=True)
    log.info("wrote %s (%d models, reference %s)", path, len(rows), reference)
    return path


def _write_results(con, run: CheckedRun, rows: list[tuple], reference: str, plan: dict) -> None:
    """The views and the two tables of results.duckdb, into the open connection `con`."""
    from ar_slicing.analysis.slices import create_definitions
    from ar_slicing.machinery.plan import digest

    layout = run.layout
    _check_coverage(con, run)
    where = _window_filter(run)
    con.execute(
        f"CREATE VIEW windows AS SELECT * FROM read_parquet({sql_string(layout.windows)}){where}"
    )
    con.execute(
        f"CREATE VIEW tags AS SELECT * FROM read_parquet({_parquet_list(layout.tag_parts())}){where}"
    )
    selects = [
        f"SELECT {sql_string(name)} AS model, window_id, pos, nll "
        f"FROM read_parquet({_parquet_list(layout.loss_parts(name))}){where}"
        for name in run.models
    ]
    con.execute("CREATE VIEW losses AS " + "\nUNION ALL\n".join(selects))
    if run.counts_dir is not None:
        con.execute(
            f"CREATE VIEW counts AS SELECT * FROM read_parquet({sql_string(run.counts_dir / BIGRAMS_NAME)})"
        )
    else:
        log.warning("no counts dir with %s found; the `counts` view is left out", BIGRAMS_NAME)
    con.execute(
        """
        CREATE VIEW token_losses AS
        SELECT l.model, t.window_id, t.pos, t.doc_id, t.token, t.prev, t.train_count,
               t.prev_pos, t.is_repeat, t.is_ar_hit, t.subset, t.match_len,
               t.span_train_count, l.nll
        FROM tags AS t JOIN losses AS l ON l.window_id = t.window_id AND l.pos = t.pos
        """
    )
    con.execute("CREATE TABLE models (" + ", ".join(f"{c} {t}" for c, t in MODEL_COLUMNS) + ")")
    con.executemany(
        "INSERT INTO models VALUES (" + ", ".join("?" for _ in MODEL_COLUMNS) + ")", rows
    )
    tags = run.tags_meta
    create_definitions(con, tags.get("threshold"))
    _write_emergence(con, run)
    _write_probes(con, run)
    info = {
        "run_dir": str(layout.run_dir),
        "tags_dir": str(layout.tags),
        "tokens_dir": str(run.tokens_dir) if run.tokens_dir else None,
        "counts_dir": str(run.counts_dir) if run.counts_dir else None,
        "fingerprint": tags.get("fingerprint"),
        "window": tags.get("window"),
        "threshold": tags.get("threshold"),
        "reset_at_doc_boundary": tags.get("reset_at_doc_boundary"),
        "default_reference": reference,
        "scored_windows": run.scored_windows,
        "signature": digest(plan),
        "plan": json.dumps(plan, sort_keys=True),
        "version": __version__,
    }
    con.execute("CREATE TABLE run_info (key VARCHAR PRIMARY KEY, value VARCHAR)")
    con.executemany(
        "INSERT INTO run_info VALUES (?, ?)",
        [(k, None if v is None else str(v)) for k, v in info.items()],
    )
    con.execute("CHECKPOINT")


# The `checkpoints` table's columns, in order, with their DuckDB types.
CHECKPOINT_COLUMNS = (
    ("model", "VARCHAR"),
    ("checkpoint", "VARCHAR"),
    ("step", "BIGINT"),
    ("tokens_seen", "BIGINT"),
    ("final", "BOOLEAN"),
    ("spec", "VARCHAR"),
    ("hub_commit", "VARCHAR"),
    ("window_subset", "INTEGER"),
    ("windows_scored", "INTEGER"),
    ("losses_dir", "VARCHAR"),
)


def _write_emergence(con, run: CheckedRun) -> None:
    """The recall emergence's tables and views (module docstring), into `con`."""
    import pyarrow as pa

    from ar_slicing.analysis.emergence import common_windows, emergence_points

    layout = run.layout
    points = emergence_points(layout, run.models, run.checkpoints, len(window_targets(run)))
    rows = []
    for p in points:
        meta = read_json(meta_path(layout.losses(p.checkpoint)))
        rows.append(
            (
                p.model, p.checkpoint, p.step, p.tokens_seen, p.final, meta.get("spec"),
                meta.get("hub_commit"), meta.get("window_subset"), len(p.windows),
                str(layout.losses(p.checkpoint)),
            )
        )  # fmt: skip
    columns = ", ".join(f"{c} {t}" for c, t in CHECKPOINT_COLUMNS)
    con.execute(f"CREATE TABLE checkpoints ({columns})")
    if rows:  # (DuckDB refuses an empty executemany)
        marks = ", ".join("?" for _ in CHECKPOINT_COLUMNS)
        con.executemany(f"INSERT INTO checkpoints VALUES ({marks})", rows)
    shared = common_windows(points)
    windows = pa.table(
        {
            "model": pa.array([m for m, ids in shared.items() for _ in ids], pa.string()),
            "window_id": pa.array([int(w) for ids in shared.values() for w in ids], pa.int32()),
        }
    )
    con.register("shared_windows", windows)
    con.execute(
        "CREATE TABLE checkpoint_windows AS SELECT * FROM shared_windows ORDER BY model, window_id"
    )
    con.unregister("shared_windows")
    selects = [
        f"SELECT {sql_string(p.model)} AS model, {sql_string(p.checkpoint)} AS checkpoint, "
        f"window_id, pos, nll FROM read_parquet({_parquet_list(layout.loss_parts(p.checkpoint))})"
        for p in points
    ] or [
        "SELECT NULL::VARCHAR AS model, NULL::VARCHAR AS checkpoint, NULL::INTEGER AS window_id, "
        "NULL::INTEGER AS pos, NULL::FLOAT AS nll WHERE false"
    ]
    con.execute(
        "CREATE VIEW checkpoint_losses AS SELECT l.* FROM ("
        + "\nUNION ALL\n".join(selects)
        + ") AS l SEMI JOIN checkpoint_windows AS w ON w.model = l.model AND w.window_id = l.window_id"
    )
    # every tag (not the `tags` view: a partial model of Table 1 restricts that one)
    con.execute(
        f"""
        CREATE VIEW checkpoint_token_losses AS
        SELECT l.model, l.checkpoint, c.step, c.tokens_seen, c.final, t.window_id, t.pos,
               t.doc_id, t.token, t.prev, t.train_count, t.prev_pos, t.is_repeat, t.is_ar_hit,
               t.subset, t.match_len, t.span_train_count, l.nll
        FROM read_parquet({_parquet_list(layout.tag_parts())}) AS t
        JOIN checkpoint_losses AS l ON l.window_id = t.window_id AND l.pos = t.pos
        JOIN checkpoints AS c ON c.checkpoint = l.checkpoint
        """
    )


# The probes' views: each reads one file of every probes folder (`PROBE_FILES`), with these
# columns after `model`, in order, with their DuckDB types.
PROBE_VIEWS: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {
    "probe_induction": (
        "induction.parquet",
        (("seq_id", "INTEGER"), ("pos", "INTEGER"), ("token", "INTEGER"), ("copy", "TINYINT"),
         ("scored", "BOOLEAN"), ("nll", "FLOAT"), ("argmax", "INTEGER")),
    ),
    "probe_induction_scores": (
        "induction_score.parquet",
        (("sequences", "BIGINT"), ("n", "BIGINT"), ("first_nll", "DOUBLE"),
         ("second_nll", "DOUBLE"), ("score", "DOUBLE"), ("score_lo", "DOUBLE"),
         ("score_hi", "DOUBLE"), ("second_accuracy", "DOUBLE")),
    ),
    "probe_induction_curve": (
        "induction_curve.parquet",
        (("pos", "INTEGER"), ("copy", "TINYINT"), ("sequences", "BIGINT"),
         ("mean_nll", "DOUBLE"), ("accuracy", "DOUBLE")),
    ),
    "probe_recall": (
        "recall.parquet",
        (("seq_id", "INTEGER"), ("k", "INTEGER"), ("pos", "INTEGER"), ("token", "INTEGER"),
         ("role", "VARCHAR"), ("pair", "INTEGER"), ("distance", "INTEGER"), ("nll", "FLOAT"),
         ("argmax", "INTEGER")),
    ),
    "probe_recall_by_k": (
        "recall_by_k.parquet",
        (("k", "BIGINT"), ("sequences", "BIGINT"), ("queries", "BIGINT"), ("accuracy", "DOUBLE"),
         ("accuracy_lo", "DOUBLE"), ("accuracy_hi", "DOUBLE"), ("nll", "DOUBLE"),
         ("nll_lo", "DOUBLE"), ("nll_hi", "DOUBLE"), ("pair_value_nll", "DOUBLE"),
         ("chance_accuracy", "DOUBLE"), ("chance_nll", "DOUBLE"), ("guess_accuracy", "DOUBLE"),
         ("guess_nll", "DOUBLE")),
    ),
    "probe_recall_by_distance": (
        "recall_by_distance.parquet",
        (("k", "INTEGER"), ("distance", "INTEGER"), ("queries", "BIGINT"),
         ("accuracy", "DOUBLE"), ("nll", "DOUBLE")),
    ),
    "probe_position": (
        "position.parquet",
        (("slice", "VARCHAR"), ("pos", "INTEGER"), ("tokens", "BIGINT"), ("mean_nll", "DOUBLE")),
    ),
    "probe_icl": (
        "icl.parquet",
        (("slice", "VARCHAR"), ("early", "BIGINT"), ("late", "BIGINT"), ("windows", "BIGINT"),
         ("tokens_early", "BIGINT"), ("tokens_late", "BIGINT"), ("nll_early", "DOUBLE"),
         ("nll_late", "DOUBLE"), ("score", "DOUBLE"), ("score_lo", "DOUBLE"),
         ("score_hi", "DOUBLE")),
    ),
}  # fmt: skip
# The `probes` table's columns, in order, with their DuckDB types (from each folder's meta.json).
PROBE_COLUMNS = (
    ("model", "VARCHAR"),
    ("checkpoint_of", "VARCHAR"),
    ("step", "BIGINT"),
    ("tokens_seen", "BIGINT"),
    ("spec", "VARCHAR"),
    ("prefix_token", "INTEGER"),
    ("head_rows", "INTEGER"),
    ("drawable_ids", "INTEGER"),
    ("sequences_digest", "VARCHAR"),
    ("probes_dir", "VARCHAR"),
)


def probe_files(layout: RunLayout, name: str) -> list[Path]:
    """The Parquet files of `probes/<name>/` the views read."""
    return [layout.probes(name) / file for file, _columns in PROBE_VIEWS.values()]


def _write_probes(con, run: CheckedRun) -> None:
    """The probes' table and views (module docstring), into `con`."""
    layout = run.layout
    rows = []
    for name in sorted(run.probes):
        meta = read_json(meta_path(layout.probes(name)))
        recorded = [meta.get(c) for c, _t in PROBE_COLUMNS[1:-1]]
        rows.append((name, *recorded, str(layout.probes(name))))
    con.execute(f"CREATE TABLE probes ({', '.join(f'{c} {t}' for c, t in PROBE_COLUMNS)})")
    if rows:
        marks = ", ".join("?" for _ in PROBE_COLUMNS)
        con.executemany(f"INSERT INTO probes VALUES ({marks})", rows)
    for view, (file, columns) in PROBE_VIEWS.items():
        typed = ", ".join(f"{c}::{t} AS {c}" for c, t in columns)
        selects = [
            f"SELECT {sql_string(name)} AS model, {typed} "
            f"FROM read_parquet({sql_string(layout.probes(name) / file)})"
            for name in sorted(run.probes)
        ] or [
            "SELECT NULL::VARCHAR AS model, "
            + ", ".join(f"NULL::{t} AS {c}" for c, t in columns)
            + " WHERE false"
        ]
        con.execute(f"CREATE VIEW {view} AS " + "\nUNION ALL\n".join(selects))


def _remove_sidecars(db: Path) -> None:
    """DuckDB's own files beside the database `db` (its write-ahead log, its spill directory)."""
    for sidecar in (Path(f"{db}.wal"), Path(f"{db}.tmp")):
        _remove(sidecar)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _remove_orphaned_temporaries(path: Path) -> None:
    """The temporaries of `path` (`.<name>.<pid>.tmp` and DuckDB's `.wal`/`.tmp` beside it) whose
    builder, the process `pid`, is gone: a report killed while it built the file. A live
    builder's are kept."""
    own = re.compile(re.escape(f".{path.name}.") + r"(\d+)" + re.escape(TMP_SUFFIX) + r"(\..*)?")
    for tmp in path.parent.glob(f".{path.name}.*"):
        found = own.fullmatch(tmp.name)
        if found and is_temporary(tmp.name) and not process_alive(int(found.group(1))):
            _remove(tmp)


def recorded_plan(path: Path) -> dict | None:
    """The plan an existing results.duckdb was built with, or None if it cannot be read (or was
    built before results.duckdb recorded one)."""
    import duckdb

    try:
        con = duckdb.connect(str(path), read_only=True)
    except duckdb.Error:
        return None
    try:
        row = con.execute("SELECT value FROM run_info WHERE key = 'plan'").fetchone()
        return json.loads(row[0]) if row and row[0] else None
    except (duckdb.Error, ValueError):
        return None
    finally:
        con.close()


def ensure_results(run_dir: str | os.PathLike, rebuild: bool = False) -> tuple[CheckedRun, bool]:
    """The checked run, with results.duckdb up to date. Returns (run, whether results.duckdb was
    (re)built). As for every stage's output, the same plan (`results_plan`) keeps the file;
    as for the report's, which keeps no work either, any change of its inputs rebuilds it."""
    from ar_slicing.machinery.plan import differences, digest

    run = find_run(run_dir)
    path = run.layout.results
    plan = results_plan(run)
    if not rebuild and path.is_file():
        old = recorded_plan(path)
        if old is not None and digest(old) == digest(plan):
            return run, False
        log.info("%s is out of date with the run's inputs; rebuilding it", path)
        for line in differences(old, plan) if old is not None else []:
            log.info("  %s", line)
    state = "out of date with the run's files: a moved run?" if path.is_file() else "missing"
    require_writable(path, f"{path} ({state})", "copy the run to a writable disk and use it there")
    build_results(run, plan)
    return run, True


def open_results(run_dir: str | os.PathLike, rebuild: bool = False):
    """A read-only DuckDB connection to the run's up-to-date results.duckdb."""
    import duckdb

    run, _ = ensure_results(run_dir, rebuild=rebuild)
    return duckdb.connect(str(run.layout.results), read_only=True)


def run_info(con) -> dict[str, str | None]:
    return dict(con.execute("SELECT key, value FROM run_info ORDER BY key").fetchall())
