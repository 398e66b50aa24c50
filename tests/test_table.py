"""The reference-free result's tables as rows (compare/table.py): the CSV report written from
them is byte for byte what pandas' ``to_csv`` writes from the same rows, and the sort is
pandas' sort (test_compare.py: such a compare imports no pandas)."""

from __future__ import annotations

import io
import math
import os
import random

import numpy as np
import pandas as pd

from srdd_dump.compare.reference_free import layers_table, sites_table
from srdd_dump.compare.results import LAYER_COLUMNS, SITE_COLUMNS, CompareResult
from srdd_dump.compare.table import Table
from srdd_dump.report.diagnosis_csv import write_csv, write_table
from srdd_dump.report.escape import escape_formulas

from dumpfactory import write_dump

VALUES = [None, math.nan, np.nan, 0, 1, -3, 7, 1.5, 0.1, -0.0, 1e-5, 3.0, 1e17, math.inf,
          -math.inf, True, False, np.bool_(True), np.int64(7), np.float64(0.25), "a", "-x",
          "=SUM(A1)", "", "a,b", 'q"x', "PILEUP_SAT,DEAD_ZONE", 2**63 + 5, np.float32(0.1)]


def _pandas_csv(rows: list[dict], columns: list[str], whole=()) -> str:
    df = pd.DataFrame(rows, columns=columns)
    for col in whole:
        df[col] = df[col].astype("Int64")
    path = io.StringIO()
    escape_formulas(df).to_csv(path, index=False)
    return path.getvalue()


def _rows_csv(table: Table, tmp_path) -> str:
    path = str(tmp_path / "t.csv")
    write_table(table, path)
    with open(path, newline="", encoding="utf-8") as fh:
        return fh.read()


def test_rows_write_the_csv_pandas_writes(tmp_path):
    """Mixed columns (ints with a missing value become floats, bools with one become text,
    text escaped where a spreadsheet would run it): the same bytes; a value pandas types by
    rules of its own (a numpy float32, an int beyond int64) is written by pandas itself."""
    rng = random.Random(0)
    for _ in range(1500):
        n = rng.randint(1, 5)
        kinds = rng.sample(VALUES, rng.randint(1, 4))
        rows = [{"a": rng.choice(kinds), "b": rng.choice(VALUES),
                 "rank": rng.choice([None, 0, 3])} for _ in range(n)]
        table = Table(["a", "b", "rank"], rows, whole_numbers=("rank",))
        assert _rows_csv(table, tmp_path) == _pandas_csv(rows, ["a", "b", "rank"], ("rank",))
    assert Table(["a"], [{"a": np.float32(0.1)}]).text_rows() is None
    assert Table(["a"], [{"a": 2**64}]).text_rows() is None
    assert Table(["a"], [{"a": 1.5}]).text_rows() == [["1.5"]]


def test_empty_tables_and_a_given_frame(tmp_path):
    for rows in ([], [{"a": ""}], [{"a": None}]):
        assert _rows_csv(Table(["a", "b"], rows), tmp_path) == _pandas_csv(rows, ["a", "b"])
    frame = pd.DataFrame({"a": [np.float32(0.5), np.float32(-2)], "b": ["=1", "x"]})
    table = Table.of(frame)
    assert table.frame() is frame and table.has_frame and table.text_rows() is None
    assert _rows_csv(table, tmp_path) == _pandas_csv(frame.to_dict("records"), ["a", "b"])
    assert Table(["n"], [{"n": 2.5}], whole_numbers=("n",)).text_rows() is None  # pandas raises


def test_the_dataframe_once_built_is_the_table():
    """A change made to ``result.layers`` is what the verdict, the counts and the report read;
    new rows replace the DataFrame."""
    rows = [{"source": "a", "layer": 0, "verdict": "FAULT", "score": 9.0, "rank": None},
            {"source": "a", "layer": 1, "verdict": "NORMAL", "score": 0.1, "rank": 2}]
    result = CompareResult("x", layers_table(rows), Table(["status", "reason"], []))
    assert not result.layer_table.has_frame and result.worst_verdict() == "FAULT"
    assert str(result.layers["rank"].dtype) == "Int64"
    result.layers.loc[0, "verdict"] = "NORMAL"
    assert result.worst_verdict() == "NORMAL"
    assert result.layer_table.column("verdict") == ["NORMAL", "NORMAL"]
    result.layer_table.rows = rows
    assert not result.layer_table.has_frame and result.worst_verdict() == "FAULT"
    result.layers = result.layers.head(1)  # a DataFrame set, as before the tables were rows
    assert len(result.layer_table) == 1
    keywords = CompareResult(path="x", layers=result.layers, files=pd.DataFrame())
    assert keywords.worst_verdict() == "FAULT" and keywords.sites.empty


def _pandas_layer_order(rows: list[dict]) -> list[dict]:
    """The layer table's order as pandas sorted it before (verdict, score descending, source,
    layer; a stable sort, NaN scores last)."""
    from srdd_dump.analysis.verdicts import VERDICT_ORDER

    df = pd.DataFrame(rows, columns=LAYER_COLUMNS + ["tag"])
    order = df["verdict"].map(VERDICT_ORDER).fillna(len(VERDICT_ORDER))
    df = df.assign(_order=order).sort_values(
        ["_order", "score", "source", "layer"], ascending=[True, False, True, True],
        kind="mergesort")
    return df.drop(columns="_order").to_dict("records")


def test_layer_and_site_order_is_pandas_order():
    rng = random.Random(1)
    verdicts = ["FAULT", "SUSPECT", "NORMAL", "ODD"]
    for _ in range(200):
        rows = [{"source": rng.choice("ab"), "layer": rng.randint(0, 4),
                 "verdict": rng.choice(verdicts), "phase": rng.choice(["prefill", "decode"]),
                 "module": rng.choice(["m.mlp", "m.attn"]),
                 "score": rng.choice([0.0, 0.5, 2.0, 2.0, math.nan, 1e-3]),
                 "tag": i} for i in range(rng.randint(0, 12))]
        got = [r["tag"] for r in layers_table(rows).rows]
        assert got == [r["tag"] for r in _pandas_layer_order(rows)]
        df = pd.DataFrame(rows, columns=SITE_COLUMNS + ["tag"]).sort_values(
            ["source", "layer", "phase", "module"], kind="mergesort")
        assert [r["tag"] for r in sites_table(rows).rows] == list(df["tag"])


def test_a_compare_to_csv_is_the_same_from_rows_and_from_frames(tmp_path):
    """A real compare (a FAULT layer with a NaN, a dead one, NORMAL ones, Int64 rank and pid):
    its report written from the rows and from the DataFrames of the same result, byte for
    byte."""
    from srdd_dump.compare import compare_path

    rng = np.random.default_rng(0)
    rounds = [{k: rng.standard_normal((1, 40, 32)).astype(np.float32) for k in range(-1, 4)}
              for _ in range(2)]
    rounds[1][1][0, 2, 5] = np.nan
    rounds[0][2][:] = rounds[1][2][:] = 0.0
    os.makedirs(tmp_path / "d")
    write_dump(str(tmp_path / "d" / "run_rank0.h5"), rounds, dtype="bfloat16")
    result = compare_path(str(tmp_path / "d"), progress=False)
    assert not result.layer_table.has_frame
    write_csv(result, str(tmp_path / "rows.csv"))
    framed = CompareResult(result.path, result.layers, result.files, result.sites)
    assert framed.layer_table.has_frame
    write_csv(framed, str(tmp_path / "frames.csv"))
    for part in ("", ".files"):
        with open(tmp_path / f"rows{part}.csv", "rb") as a, \
                open(tmp_path / f"frames{part}.csv", "rb") as b:
            assert a.read() == b.read()
    assert result.worst_verdict() == framed.worst_verdict() == "FAULT"
    assert result.skipped_reasons == framed.skipped_reasons == []


def test_the_flagged_layers_are_an_aligned_table():
    from srdd_dump.report.terminal import aligned

    rows = [{"verdict": "FAULT", "score": 12.345678, "module": "model.layers.1", "gain": math.nan},
            {"verdict": "SUSPECT", "score": 3.0, "module": "m", "gain": None}]
    lines = aligned(rows, ["verdict", "score", "module", "gain"])
    assert lines == ["verdict score         module gain",  # not measured: "-", not NaN
                     "  FAULT 12.35 model.layers.1    -",
                     "SUSPECT     3              m    -"]
    labels = "SAT_SOURCE,STUCK,PILEUP_SAT,BATCH_DEP,MLP_MISMATCH"  # the first label is kept
    (_, line) = aligned([{"diagnosis": labels}], ["diagnosis"])
    assert line.strip().startswith("SAT_SOURCE,") and line.strip().endswith("...")
