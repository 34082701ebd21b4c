"""`ar_slicing.open_run`: the Python API gives the numbers `arslice report` and `arslice query`
print, as polars frames, without printing anything."""

from __future__ import annotations

import csv
import io
import math

import duckdb
import polars as pl
import pytest

from ar_slicing.analysis.sql import available_queries
from ar_slicing.errors import ArSliceError
from tests.pipeline.test_report import text_run  # noqa: F401
from tests.queries.test_queries import QUOTED, make_partial, tiny_run  # noqa: F401  (fixtures)


def cli(*argv: str) -> int:
    from pipeline.cli import main

    return main(list(argv))


def csv_rows(text: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(text)))


def same_value(cell: str, value) -> bool:
    """A CSV cell as the CLI wrote it against the API's value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return cell in ("", "nan")
    if isinstance(value, bool):
        return cell == str(value)
    if isinstance(value, (int, float)):
        return float(cell) == pytest.approx(float(value), rel=1e-9, abs=1e-12)
    return cell == str(value)


def test_table1_is_the_reports_table1_csv(text_run, capfd):  # noqa: F811
    from ar_slicing import open_run

    run_dir, _, _ = text_run
    assert cli("report", "--run", str(run_dir), "--bootstrap", "200", "--seed", "3") == 0
    capfd.readouterr()
    run = open_run(run_dir)
    t1 = run.table1(bootstrap=200, seed=3)
    assert capfd.readouterr() == ("", "")  # nothing printed on the way
    assert isinstance(t1, pl.DataFrame)
    written = csv_rows((run_dir / "report" / "table1.csv").read_text())
    assert t1.columns == list(written[0])
    assert "recall_gain_lo" in t1.columns and "ar_share_hi" in t1.columns
    assert t1["model"].to_list() == ["attention", "hyena", QUOTED]  # the reference first
    for row, want in zip(t1.iter_rows(named=True), written):
        for column, cell in want.items():
            assert same_value(cell, row[column]), (row["model"], column, cell, row[column])
    # the reference's own AR share has no value: null, not a number
    assert t1.filter(pl.col("model") == "attention")["ar_share"].to_list() == [None]
    # another reference, and no bootstrap: no interval columns
    other = run.table1(reference=QUOTED, bootstrap=0)
    assert other["model"][0] == QUOTED and "ppl_all_lo" not in other.columns
    with pytest.raises(ArSliceError, match="reference 'gpt-7' is not a model"):
        run.table1(reference="gpt-7")


@pytest.mark.parametrize("name", available_queries())
def test_query_is_what_arslice_query_prints(tiny_run, capsys, name):  # noqa: F811
    from ar_slicing import open_run

    params = {"reference": QUOTED} if name in ("gap_vs_reference", "examples") else {}
    flags = [f"--param={k}={v}" for k, v in params.items()]
    if name == "recall_emergence":  # (its rows are checkpoints': the tiny run gets one)
        from tests.ar_slicing.test_emergence import add_tiny_checkpoint

        add_tiny_checkpoint(tiny_run)
    if name.startswith("probe_"):  # (its rows are probes': the tiny run gets two)
        from tests.queries.test_probe_queries import write_probes

        write_probes(tiny_run, "attention")
        write_probes(tiny_run, "hyena", shift=1.0)
    assert cli("query", name, "--run", str(tiny_run), "--format", "csv", *flags) == 0
    printed = csv_rows(capsys.readouterr().out)
    got = open_run(tiny_run).query(name, **params)
    assert capsys.readouterr().out == ""
    assert got.height == len(printed) and got.height > 0
    for row, want in zip(got.iter_rows(named=True), printed):
        assert list(row) == list(want)
        for column, cell in want.items():
            assert same_value(cell, row[column]), (name, column, cell, row[column])


def test_query_parameters_take_python_values(tiny_run):  # noqa: F811
    from ar_slicing import open_run

    run = open_run(tiny_run)
    assert run.query("examples", limit=1)["model"].to_list() == ["hyena", QUOTED]
    assert run.query("examples")["model"].to_list().count("hyena") == 2  # default limit 10
    with pytest.raises(ArSliceError, match="has no parameter limt"):
        run.query("examples", limt=1)
    with pytest.raises(ArSliceError, match="no query 'nope'"):
        run.query("nope")


def test_sql_binds_its_parameters(tiny_run):  # noqa: F811
    from ar_slicing import open_run

    run = open_run(tiny_run)
    got = run.sql(
        "SELECT model, count(*) AS n, avg(nll) AS mean_nll FROM token_losses "
        "WHERE model = $m AND is_ar_hit GROUP BY model",
        m=QUOTED,  # a quote in the value: bound, so it cannot break the SQL
    )
    assert got.rows() == [(QUOTED, 3, 2.5)]
    assert run.sql("SELECT count(*) AS n FROM tags WHERE window_id = $w", w=1)["n"][0] == 7
    with pytest.raises(ArSliceError, match='column "nope" not found'):
        run.sql("SELECT nope FROM tags")


def test_run_metadata(tiny_run):  # noqa: F811
    from ar_slicing import open_run

    run = open_run(tiny_run)
    assert run.models == ("attention", "hyena", QUOTED)
    assert (run.window, run.threshold, run.reference) == (8, 1250, "attention")
    assert run.path == tiny_run.resolve()


def test_token_losses_is_a_lazy_scan_equal_to_the_view(tiny_run):  # noqa: F811
    from ar_slicing import open_run

    run = open_run(tiny_run)
    lazy = run.token_losses()
    assert isinstance(lazy, pl.LazyFrame)
    assert "parquet" in lazy.explain().lower()  # scanned, not loaded
    got = lazy.sort("model", "window_id", "pos").collect()
    con = duckdb.connect(str(tiny_run / "results.duckdb"), read_only=True)
    want = con.sql("SELECT * FROM token_losses ORDER BY model, window_id, pos").pl()
    con.close()
    assert got.columns == want.columns and got.height == 45
    assert got.equals(want)
    # the same means as the SQL slice table
    means = lazy.filter(pl.col("is_ar_hit")).group_by("model").agg(pl.col("nll").mean())
    assert dict(means.collect().rows()) == pytest.approx(
        {"attention": 2.0, "hyena": 3.0, QUOTED: 2.5}
    )


def test_token_losses_keep_to_the_windows_every_model_scored(tiny_run):  # noqa: F811
    from ar_slicing import open_run

    make_partial(tiny_run, "hyena", 1)  # evaluated on window 0 only
    run = open_run(tiny_run)
    got = run.token_losses().collect()
    assert set(got["window_id"].to_list()) == {0} and got.height == 3 * 8
    assert run.sql("SELECT count(*) AS n FROM token_losses")["n"][0] == got.height


def test_open_run_refuses_a_folder_that_is_not_a_run(tmp_path):
    from ar_slicing import open_run

    with pytest.raises(ArSliceError, match="no such directory"):
        open_run(tmp_path / "nowhere")
    with pytest.raises(ArSliceError, match="no complete tags"):
        open_run(tmp_path)


def test_read_only_files_keeps_sql_to_the_runs_own_files(tiny_run, tmp_path):  # noqa: F811
    """By default `sql()` reads any file, as DuckDB does; `read_only_files=True` refuses every
    file but the run's own Parquet (and any write, even to those), and answers the same."""
    from ar_slicing import open_run

    secret = tmp_path / "secret.csv"
    secret.write_text("user,password\nroot,hunter2\n")
    notebook = open_run(tiny_run)
    assert notebook.sql("SELECT * FROM read_csv_auto($f)", f=str(secret)).rows() == [
        ("root", "hunter2")
    ]
    served = open_run(tiny_run, read_only_files=True)
    part = sorted((tiny_run / "tags").glob("tags-*.parquet"))[0]
    before = part.read_bytes()
    refused = {
        "SELECT * FROM read_csv_auto($f)": ({"f": str(secret)}, "disabled by configuration"),
        "SELECT * FROM read_csv_auto('/etc/passwd')": ({}, "disabled by configuration"),
        "SELECT * FROM read_text($f)": ({"f": str(secret)}, "disabled by configuration"),
        "SET enable_external_access = true": ({}, "SET statement is refused"),
        "COPY (SELECT 1 AS x) TO $f (FORMAT csv, USE_TMP_FILE false)": (
            {"f": str(part)},
            "COPY statement is refused",
        ),
        "SELECT 1; COPY (SELECT 1 AS x) TO 'out.csv'": ({}, "COPY statement is refused"),
    }
    for sql, (params, why) in refused.items():
        with pytest.raises(ArSliceError, match=why):
            served.sql(sql, **params)
    assert part.read_bytes() == before
    # what the views read still works, with the same answers
    count = "SELECT model, count(*) AS n, avg(nll) AS m FROM token_losses GROUP BY model ORDER BY 1"
    assert served.sql(count).equals(notebook.sql(count))
    assert served.sql("SELECT count(*) AS n FROM counts").equals(
        notebook.sql("SELECT count(*) AS n FROM counts")
    )
    assert served.query("slice_perplexity").equals(notebook.query("slice_perplexity"))
    assert served.table1(bootstrap=0).equals(notebook.table1(bootstrap=0))


def test_open_run_waits_for_a_writer_of_results_duckdb(tiny_run):  # noqa: F811
    """`report` or `query` rebuilding results.duckdb holds its lock: open_run waits for it
    instead of building the same file beside it."""
    import subprocess
    import sys
    import threading

    from ar_slicing import open_run

    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from ar_slicing.machinery.ownership import results_lock\n"
         f"with results_lock({str(tiny_run)!r}):\n    print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        opened = []
        opener = threading.Thread(target=lambda: opened.append(open_run(tiny_run)))
        opener.start()
        opener.join(timeout=2)
        assert opener.is_alive() and not opened  # still waiting for the holder
        holder.stdin.close()
        opener.join(timeout=120)
        assert opened and opened[0].table1() is not None
    finally:
        holder.kill()
        holder.wait()
