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
  run_info      table: key/value facts about the run (directories, window, threshold,
                fingerprint, default reference, the signature of the inputs the file was built from)

Paths: the views name the Parquet files by **absolute** path, so the file works unchanged
whichever directory it is opened from (`duckdb.connect("runs/pile/results.duckdb")` from
anywhere, the `duckdb` shell, a notebook). If the run directory is moved or a model is added,
`open_results` notices that the recorded input signature no longer matches and rebuilds the file
(only views and two tiny tables: it takes well under a second), so `arslice query` and
`arslice report` never read stale paths.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ar_slicing import __version__
from ar_slicing.errors import BadInput
from ar_slicing.executor import process_alive
from ar_slicing.io import atomic_path, read_json, sha256_file
from ar_slicing.layout import (
    BIGRAMS_NAME,
    LOSS_PART_GLOB,
    META_NAME,
    TAG_PART_GLOB,
    TMP_SUFFIX,
    WINDOWS_NAME,
    RunLayout,
    is_complete,
    is_temporary,
    looks_like_run_dir,
    require_dir,
)
from ar_slicing.parts import require_whole
from ar_slicing.tokenizer import require_same_fingerprint

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
class RunInputs:
    """Where a run's inputs are: found by the run layout (`ar_slicing.layout`) and the tags'
    meta.json, and checked to belong together."""

    run_dir: Path
    tags_dir: Path
    tokens_dir: Path | None
    counts_dir: Path | None
    tags_meta: dict
    tag_shards: list[Path]
    models: dict[str, Path] = field(default_factory=dict)  # losses folder name -> dir
    skipped_losses: dict[str, str] = field(default_factory=dict)  # folder name -> why
    # When some model was evaluated on windows 0..N-1 only (`arslice eval --max-windows N`), the
    # smallest such N: every view is restricted to those windows so all models are compared on
    # the same tokens. None when every model covers every window.
    scored_windows: int | None = None
    partial_models: dict[str, int] = field(default_factory=dict)  # name -> windows it scored

    @property
    def layout(self) -> RunInputs:
        return RunLayout(self.run_dir)

    @property
    def results_path(self) -> Path:
        return self.layout.results


def _first_existing(*candidates: str | os.PathLike | None, marker: str) -> Path | None:
    for c in candidates:
        if c and (Path(c) / marker).is_file():
            return Path(c)
    return None


def find_run(run_dir: str | os.PathLike) -> RunInputs:
    """Locate tags, losses, counts and the validation store of the run in `run_dir`."""
    given = Path(run_dir)
    require_dir(given, "run directory")
    run_dir = given.resolve()
    paths = RunLayout(run_dir)
    tags_dir = paths.tags
    if not is_complete(tags_dir):
        parent = next((p for p in given.resolve().parents if looks_like_run_dir(p)), None)
        if not looks_like_run_dir(run_dir) and parent is not None:
            raise BadInput(
                f"{given} is a folder inside the run directory {parent}; pass --run {parent}"
            )
        raise BadInput(
            f"{tags_dir}: no complete tags (meta.json missing); run `arslice tag ... --out {tags_dir}` first"
        )
    tags_meta = read_json(tags_dir / "meta.json")
    shards = sorted(tags_dir.glob(TAG_PART_GLOB))
    if not shards:
        raise BadInput(
            f"{tags_dir}: meta.json is there but no {TAG_PART_GLOB}; rerun `arslice tag --overwrite`"
        )
    if not (tags_dir / WINDOWS_NAME).is_file():
        raise BadInput(f"{tags_dir}: no {WINDOWS_NAME}; rerun `arslice tag --overwrite`")
    if "span_order" not in tags_meta:
        raise BadInput(
            f"{tags_dir}: tags without copy lengths (match_len, span_train_count), made by an "
            "older version; rerun `arslice tag --overwrite` (or `make tags`)"
        )

    # The tags record absolute paths; when the run was moved since, the run layout finds them.
    tokens_dir = _first_existing(tags_meta.get("tokens"), paths.store("val"), marker=META_NAME)
    counts_dir = _first_existing(tags_meta.get("counts_dir"), paths.counts, marker=BIGRAMS_NAME)
    layout = RunInputs(
        run_dir=run_dir,
        tags_dir=tags_dir,
        tokens_dir=tokens_dir,
        counts_dir=counts_dir,
        tags_meta=tags_meta,
        tag_shards=shards,
    )
    require_whole(shards)  # (cheap: here on every query, so a part cut short is named at once)
    losses_root = paths.losses_root
    for d in sorted(losses_root.iterdir()) if losses_root.is_dir() else []:
        if not d.is_dir():
            continue  # losses/meta.json marks every model evaluated; it is not a model
        if not is_complete(d):
            layout.skipped_losses[d.name] = "incomplete (no meta.json)"
        elif not any(d.glob(LOSS_PART_GLOB)):
            layout.skipped_losses[d.name] = f"no {LOSS_PART_GLOB}"
        else:
            layout.models[d.name] = d
            require_whole(d.glob(LOSS_PART_GLOB))
            meta = read_json(d / META_NAME)
            check_losses_belong(d, meta, layout)
            if meta.get("partial"):
                n = int(meta.get("windows_evaluated", 0))
                layout.partial_models[d.name] = n
                layout.scored_windows = (
                    n if layout.scored_windows is None else min(n, layout.scored_windows)
                )
    for name, why in layout.skipped_losses.items():
        log.warning("losses/%s skipped: %s", name, why)
    if layout.scored_windows is not None:
        log.warning(
            "partial losses (%s): the results cover windows 0..%d only",
            ", ".join(f"{k}: {n} windows" for k, n in sorted(layout.partial_models.items())),
            layout.scored_windows - 1,
        )
    if not layout.models:
        raise BadInput(
            f"{losses_root}: no complete losses/<model>/ folder; run `arslice eval --tags {tags_dir} "
            f"--out {losses_root}/NAME` for at least one model"
        )
    return layout


def check_losses_belong(losses_dir: Path, meta: dict, layout: RunInputs) -> None:
    """Refuse losses scored on other windows than the tags': another window length, another
    validation store or another tokenizer would join each loss to the wrong token."""
    from ar_slicing.plan import identity

    tags = layout.tags_meta
    if meta.get("fingerprint") and tags.get("fingerprint"):
        require_same_fingerprint(
            meta["fingerprint"],
            f"losses {losses_dir}",
            tags["fingerprint"],
            f"tags {layout.tags_dir}",
        )
    problems = []
    if meta.get("window") is not None and tags.get("window") is not None:
        if meta["window"] != tags["window"]:
            problems.append(f"window length: losses {meta['window']}, tags {tags['window']}")
    plan_tokens = (meta.get("plan") or {}).get("inputs", {}).get("tokens")
    if plan_tokens and layout.tokens_dir is not None and is_complete(layout.tokens_dir):
        if plan_tokens != identity(layout.tokens_dir):
            problems.append(
                f"validation store: the losses were scored on another {layout.tokens_dir.name} "
                f"store than the tags' {layout.tokens_dir}"
            )
    if problems:
        raise BadInput(
            f"losses {losses_dir} do not belong to the tags {layout.tags_dir} ("
            + "; ".join(problems)
            + f"); re-run `arslice eval --overwrite --tags {layout.tags_dir} --out {losses_dir}`"
        )


def inputs_signature(layout: RunInputs) -> str:
    """sha256 over where the inputs are and the meta.json of each: changes when anything moves or is redone."""
    h = hashlib.sha256()
    parts: list[Any] = [
        str(layout.run_dir),
        str(layout.tags_dir),
        [p.name for p in layout.tag_shards],
    ]
    parts.append(sha256_file(layout.tags_dir / "meta.json"))
    parts.append(str(layout.counts_dir))
    for name, d in layout.models.items():
        parts.append(
            [
                name,
                str(d),
                sha256_file(d / "meta.json"),
                sorted(p.name for p in d.glob(LOSS_PART_GLOB)),
            ]
        )
    h.update(json.dumps(parts).encode())
    return h.hexdigest()


def sql_string(value: str | os.PathLike) -> str:
    """A SQL string literal. Only for DDL (view definitions cannot take bound parameters)."""
    return "'" + str(value).replace("'", "''") + "'"


def _parquet_list(paths: list[Path]) -> str:
    return "[" + ", ".join(sql_string(p) for p in paths) + "]"


def model_rows(layout: RunInputs) -> list[tuple]:
    """One `models` row per losses folder; refuses losses made with another tokenizer than the tags."""
    rows = []
    tags_fp = layout.tags_meta.get("fingerprint")
    for name, d in layout.models.items():
        meta = read_json(d / "meta.json")
        fp = meta.get("fingerprint")
        if tags_fp and fp:
            require_same_fingerprint(fp, f"losses {d}", tags_fp, f"tags {layout.tags_dir}")
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


def _window_filter(layout: RunInputs) -> str:
    """The WHERE clause restricting every view to the windows all models scored."""
    if layout.scored_windows is None:
        return ""
    return f" WHERE window_id < {int(layout.scored_windows)}"


def _check_coverage(con, layout: RunInputs) -> None:
    """Every model must have exactly one loss per tag row of the compared windows.

    With complete losses this reads only Parquet footers; with partial ones it counts rows of
    the compared windows.
    """

    def n_rows(paths: list[Path]) -> int:
        if layout.scored_windows is None:
            sql = f"SELECT sum(num_rows)::BIGINT FROM parquet_file_metadata({_parquet_list(paths)})"
        else:
            sql = (
                f"SELECT count(*) FROM read_parquet({_parquet_list(paths)}){_window_filter(layout)}"
            )
        return int(con.execute(sql).fetchone()[0] or 0)

    n_tags = n_rows(layout.tag_shards)
    for d in layout.models.values():
        n = n_rows(sorted(d.glob(LOSS_PART_GLOB)))
        if n != n_tags:
            scope = (
                ""
                if layout.scored_windows is None
                else f" in windows 0..{layout.scored_windows - 1}"
            )
            raise BadInput(
                f"losses {d}: {n} rows{scope} but the tags in {layout.tags_dir} have {n_tags}; a losses "
                "folder must hold exactly one row per tag row. Re-run `arslice eval --overwrite` for "
                "this model against these tags."
            )


def build_results(layout: RunInputs) -> Path:
    """Write `<run>/results.duckdb` atomically (built under a temporary name, then renamed).

    A full disk raises the `OSError` (ENOSPC) every stage's writes raise, other DuckDB errors a
    `BadInput` naming the file; either way no temporary is left behind, and those of a build
    that was killed are removed first."""
    import duckdb

    path = layout.results_path
    rows = model_rows(layout)
    reference = default_reference([(r[0], r[1], r[3]) for r in rows])
    _remove_orphaned_temporaries(path)
    with atomic_path(path) as tmp:
        try:
            con = duckdb.connect(str(tmp))
            try:
                _write_results(con, layout, rows, reference)
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


def _write_results(con, layout: RunInputs, rows: list[tuple], reference: str) -> None:
    """The views and the two tables of results.duckdb, into the open connection `con`."""
    _check_coverage(con, layout)
    where = _window_filter(layout)
    con.execute(
        "CREATE VIEW windows AS SELECT * FROM "
        f"read_parquet({sql_string(layout.tags_dir / WINDOWS_NAME)}){where}"
    )
    con.execute(
        f"CREATE VIEW tags AS SELECT * FROM read_parquet({_parquet_list(layout.tag_shards)}){where}"
    )
    selects = [
        f"SELECT {sql_string(name)} AS model, window_id, pos, nll "
        f"FROM read_parquet({_parquet_list(sorted(d.glob(LOSS_PART_GLOB)))}){where}"
        for name, d in layout.models.items()
    ]
    con.execute("CREATE VIEW losses AS " + "\nUNION ALL\n".join(selects))
    if layout.counts_dir is not None:
        con.execute(
            f"CREATE VIEW counts AS SELECT * FROM read_parquet({sql_string(layout.counts_dir / BIGRAMS_NAME)})"
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
    info = {
        "run_dir": str(layout.run_dir),
        "tags_dir": str(layout.tags_dir),
        "tokens_dir": str(layout.tokens_dir) if layout.tokens_dir else None,
        "counts_dir": str(layout.counts_dir) if layout.counts_dir else None,
        "fingerprint": layout.tags_meta.get("fingerprint"),
        "window": layout.tags_meta.get("window"),
        "threshold": layout.tags_meta.get("threshold"),
        "reset_at_doc_boundary": layout.tags_meta.get("reset_at_doc_boundary"),
        "default_reference": reference,
        "scored_windows": layout.scored_windows,
        "signature": inputs_signature(layout),
        "version": __version__,
    }
    con.execute("CREATE TABLE run_info (key VARCHAR PRIMARY KEY, value VARCHAR)")
    con.executemany(
        "INSERT INTO run_info VALUES (?, ?)",
        [(k, None if v is None else str(v)) for k, v in info.items()],
    )
    con.execute("CHECKPOINT")


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


def recorded_signature(path: Path) -> str | None:
    """The input signature stored in an existing results.duckdb, or None if it cannot be read."""
    import duckdb

    try:
        con = duckdb.connect(str(path), read_only=True)
    except duckdb.Error:
        return None
    try:
        row = con.execute("SELECT value FROM run_info WHERE key = 'signature'").fetchone()
        return row[0] if row else None
    except duckdb.Error:
        return None
    finally:
        con.close()


def ensure_results(run_dir: str | os.PathLike, rebuild: bool = False) -> tuple[RunInputs, bool]:
    """The run's layout, with results.duckdb up to date. Returns (layout, whether it was (re)built)."""
    layout = find_run(run_dir)
    path = layout.results_path
    if not rebuild and path.is_file() and recorded_signature(path) == inputs_signature(layout):
        return layout, False
    if path.is_file() and not rebuild:
        log.info("%s is out of date with the run's inputs; rebuilding it", path)
    build_results(layout)
    return layout, True


def open_results(run_dir: str | os.PathLike, rebuild: bool = False):
    """A read-only DuckDB connection to the run's up-to-date results.duckdb."""
    import duckdb

    layout, _ = ensure_results(run_dir, rebuild=rebuild)
    return duckdb.connect(str(layout.results_path), read_only=True)


def run_info(con) -> dict[str, str | None]:
    return dict(con.execute("SELECT key, value FROM run_info ORDER BY key").fetchall())
