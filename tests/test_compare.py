"""srdd-compare: streaming moments, verdicts, report tables/files, CLI errors, no torch."""

from __future__ import annotations

import csv
import math
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import h5py
import numpy as np
import openpyxl
import pytest

from srdd_dump.analysis import moments as moments_mod
from srdd_dump.analysis.diagnosis import FAULT, NORMAL, SUSPECT, ZERO_FRAC, lower_bound
from srdd_dump.analysis.moments import Moments
from srdd_dump.compare.results import LAYER_COLUMNS
from srdd_dump.errors import UserError
from srdd_dump.format import schema as s

from capture_utils import python_words
from dumpfactory import compare_written as compare_path
from dumpfactory import logical, make_partial, normal_rounds, write_dump

COLUMNS = [
    "source", "layer", "module", "score", "verdict", "diagnosis", "mean", "std", "absmax",
    "kurtosis", "zero_frac", "nan_count", "inf_count", "samples",
]


def direct(x: np.ndarray) -> tuple[float, float, float]:
    x = np.asarray(x, dtype=np.float64).ravel()
    d = x - x.mean()
    m2, m4 = (d**2).mean(), (d**4).mean()
    return x.mean(), math.sqrt(m2), m4 / m2**2 - 3.0


def run_cli(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "srdd_dump.cli.compare", *args],
        capture_output=True, text=True, cwd=cwd, timeout=60,
    )


# -- Moments ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_moments_chunked_match_direct(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.lognormal(1.0, 0.8, 5000), rng.normal(-3.0, 0.1, 3000)]) + 1e4
    rng.shuffle(x)
    monkeypatch.setattr(moments_mod, "BLOCK", 333)  # also split inside add()
    cuts = np.sort(rng.choice(np.arange(1, x.size), 10, replace=False))
    m = Moments()
    for part in np.split(x, cuts):
        m.add(part.reshape(-1, 1))
    m.add(np.zeros(0))
    mean, std, kurt = direct(x)
    assert m.count == x.size
    assert m.mean == pytest.approx(mean, rel=1e-12)
    assert m.std == pytest.approx(std, rel=1e-9)
    assert m.kurtosis == pytest.approx(kurt, rel=1e-8)
    assert m.absmax == np.abs(x).max()
    assert kurt > 1.0  # the test data is far from normal, so kurtosis is really checked

    a, b = Moments().add(x[:1234]), Moments().add(x[1234:])
    merged = a.merge(b)
    assert merged.kurtosis == pytest.approx(kurt, rel=1e-8)
    assert merged.std == pytest.approx(std, rel=1e-9)


def test_moments_counts_nonfinite_and_zeros():
    x = np.array([1.0, 0.0, np.nan, -np.inf, 3.0, 0.0, np.inf, -2.0], dtype=np.float32)
    m = Moments().add(x[:3]).add(x[3:])
    finite = x[np.isfinite(x)]
    assert (m.count, m.nan_count, m.inf_count, m.zeros) == (5, 1, 2, 2)
    assert m.total == 8
    assert m.zero_frac == pytest.approx(2 / 5)
    assert m.absmax == 3.0
    mean, std, kurt = direct(finite)
    assert (m.mean, m.std) == (pytest.approx(mean), pytest.approx(std))
    assert m.kurtosis == pytest.approx(kurt)


def test_moments_constant_and_empty():
    m = Moments().add(np.full(1000, 0.1, dtype=np.float32)).add(np.full(7, 0.1, np.float32))
    assert m.std == 0.0 and m.kurtosis == 0.0
    assert m.mean == pytest.approx(0.1)
    empty = Moments().add(np.array([np.nan]))
    assert empty.count == 0 and math.isnan(empty.mean) and math.isnan(empty.kurtosis)


# -- verdict rules ---------------------------------------------------------------------------


# -- compare_path and the report files -------------------------------------------------------


def _suspect_zeros(dtype: str) -> int:
    """Zeros per round (of 1600 values, two rounds) whose rate's lower bound is 70% of the
    dtype's FAULT limit."""
    return next(k for k in range(1, 1600)
                if lower_bound(2 * k / 3200, 3200) >= 0.7 * ZERO_FRAC[dtype])


def faulty_dump(folder, dtype="bfloat16", name="run_rank0.h5", names=None):
    """Layer 0 normal, 1 has a NaN in sample 1, 2 all zero, 3 a few exact zeros (their rate's
    lower bound about 70% of the dtype's FAULT threshold: SUSPECT); plus stack input."""
    rng = np.random.default_rng(42)
    rounds = []
    zeros = _suspect_zeros(dtype)
    for i in range(2):
        r = {k: rng.standard_normal((1, 50, 32)).astype(np.float32) for k in (-1, 0, 1, 2, 3)}
        r[2][:] = 0.0
        r[3].reshape(-1)[i * 100 : i * 100 + zeros] = 0.0
        if i == 1:
            r[1][0, 2, 5] = np.nan
        rounds.append(r)
    path = write_dump(os.path.join(folder, name), rounds, dtype=dtype, names=names)
    return path, rounds


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_compare_verdicts_sorted_and_stats(tmp_path, dtype):
    _, rounds = faulty_dump(str(tmp_path), dtype=dtype)
    result = compare_path(str(tmp_path), progress=False)
    t = result.layers
    assert list(t.columns[: len(COLUMNS)]) == COLUMNS
    assert list(t["layer"]) == [1, 2, 3, 0]  # stack input (-1) has no row
    assert list(t["verdict"]) == [FAULT, FAULT, SUSPECT, NORMAL]
    assert t["diagnosis"][0] == "OVERFLOW"
    assert t["diagnosis"][1].split(",")[0] == "DEAD_ZONE"
    assert t["diagnosis"][2] == "DEAD_ZONE" and t["diagnosis"][3] == ""
    assert t["nan_count"].tolist() == [1, 0, 0, 0]
    assert set(t["samples"]) == {2}
    assert set(t["source"]) == {"run_rank0.h5"}
    assert t.loc[0, "module"] == "model.layers.1"
    assert t.loc[0, "rank"] == 0 and t.loc[0, "pid"] == 1234

    row = t[t["layer"] == 0].iloc[0]
    x = np.concatenate([logical(r[0], dtype).ravel() for r in rounds])
    mean, std, kurt = direct(x)
    assert row["mean"] == pytest.approx(mean, rel=1e-9, abs=1e-12)
    assert row["std"] == pytest.approx(std, rel=1e-9)
    assert row["kurtosis"] == pytest.approx(kurt, rel=1e-7, abs=1e-9)
    assert row["absmax"] == np.abs(x).max()
    assert t[t["layer"] == 3].iloc[0]["zero_frac"] == pytest.approx(
        2 * _suspect_zeros(dtype) / 3200
    )
    assert list(result.files["status"]) == ["ok"]
    assert result.written == []


def test_csv_report_columns_and_files_table(tmp_path):
    faulty_dump(str(tmp_path / "dumps"))
    out = tmp_path / "out" / "report.csv"
    result = compare_path(str(tmp_path / "dumps"), str(out), progress=False)
    files_csv = tmp_path / "out" / "report.files.csv"
    assert result.written == [str(out), str(files_csv)]
    with open(out, newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0][: len(COLUMNS)] == COLUMNS
    assert rows[0] == LAYER_COLUMNS
    assert [r[rows[0].index("verdict")] for r in rows[1:]] == [FAULT, FAULT, SUSPECT, NORMAL]
    with open(files_csv, newline="") as f:
        files = list(csv.DictReader(f))
    assert [(r["source"], r["status"]) for r in files] == [("run_rank0.h5", "ok")]


def test_xlsx_report_sheets_colours_and_formula_escape(tmp_path):
    names = ["=HYPERLINK(\"http://x\")", "model.layers.1", "+1", "@sum"]
    faulty_dump(str(tmp_path), names=names)
    out = tmp_path / "report.xlsx"
    compare_path(str(tmp_path), str(out), progress=False)
    wb = openpyxl.load_workbook(out)
    assert wb.sheetnames == ["summary", "layers", "signals", "files"]
    assert wb["summary"]["A3"].value.startswith("run_rank0.h5: Layer 1 (")
    assert len(wb["signals"]._charts) >= 5
    ws = wb["layers"]
    header = [c.value for c in ws[1]]
    assert header[: len(COLUMNS)] == COLUMNS
    assert ws.freeze_panes == "A2"
    module = header.index("module")
    cells = {ws.cell(row=i, column=module + 1) for i in range(2, ws.max_row + 1)}
    values = {c.value for c in cells}
    assert "'=HYPERLINK(\"http://x\")" in values and "'+1" in values and "'@sum" in values
    assert all(c.data_type == "s" for c in cells)
    verdict = header.index("verdict") + 1
    fills = {ws.cell(row=i, column=verdict).value: ws.cell(row=i, column=1).fill.fgColor.rgb
             for i in range(2, ws.max_row + 1)}
    assert fills[FAULT] == "FFFFC7CE" and fills[SUSPECT] == "FFFFEB9C"
    assert fills[NORMAL] != fills[FAULT]
    assert isinstance(ws.cell(row=2, column=header.index("mean") + 1).value, float)
    files = [[c.value for c in row] for row in wb["files"].iter_rows()]
    assert files[0][:3] == ["source", "status", "reason"]
    assert files[1][:2] == ["run_rank0.h5", "ok"]


def test_xlsx_of_a_table_the_user_changed_and_the_summary_as_the_terminals(tmp_path):
    """The in-code API: a result whose layer table lost columns or rows is written to XLSX as
    it stands (the CSV already was); the summary sheet holds what the terminal's first screen
    says (the hunt command included), a missing value empty."""
    from srdd_dump.report import write_report

    faulty_dump(str(tmp_path / "dumps"))
    result = compare_path(str(tmp_path / "dumps"), progress=False)
    result.hunts = ["srdd-dump --exec 'python infer.py' --layers model.layers.1"]
    out = tmp_path / "all.xlsx"
    write_report(result, str(out))
    summary = [c.value for c in openpyxl.load_workbook(out)["summary"]["A"] if c.value]
    assert any(result.hunts[0] in line for line in summary)
    rows = list(openpyxl.load_workbook(out)["summary"].iter_rows(values_only=True))
    assert not any(v == "nan" for row in rows for v in row)
    result.layers = result.layers.drop(columns=["score", "nan_count", "kurtosis", "diagnosis"])
    result.layers = result.layers[result.layers["layer"] >= 1]
    out = tmp_path / "cut.xlsx"
    assert write_report(result, str(out)) == [str(out)]
    ws = openpyxl.load_workbook(out)["layers"]
    header = [c.value for c in ws[1]]
    assert "score" not in header and "verdict" in header and ws.max_row == 4
    result.layers = result.layers.drop(columns=["verdict", "source"])
    write_report(result, str(out))
    assert "layers" in openpyxl.load_workbook(out).sheetnames


def test_partial_file_is_used_and_flagged(tmp_path):
    rng = np.random.default_rng(1)
    good = write_dump(str(tmp_path / "a.h5"), normal_rounds(rng))
    crashed = make_partial(write_dump(str(tmp_path / "b.h5"), normal_rounds(rng)))
    assert crashed.endswith(".h5.partial") and os.path.exists(good)
    result = compare_path(str(tmp_path), progress=False)
    status = dict(zip(result.files["source"], result.files["status"]))
    assert status == {"a.h5": "ok", "b.h5.partial": "incomplete"}
    reason = result.files.set_index("source").loc["b.h5.partial", "reason"]
    assert "did not finish" in reason
    assert set(result.layers["source"]) == {"a.h5", "b.h5.partial"}
    assert len(result.layers) == 4


def test_a_file_still_being_written_is_skipped_saying_so(tmp_path):
    """A run still writing its file (HDF5 holds it locked): the compare of its folder skips it
    saying so and uses the others; alone, it is that one line (it was "not a readable HDF5
    file ([Errno 11] ...)")."""
    rng = np.random.default_rng(1)
    write_dump(str(tmp_path / "a.h5"), normal_rounds(rng))
    live = make_partial(write_dump(str(tmp_path / "b.h5"), normal_rounds(rng)))
    code = ("import h5py, sys, time\nf = h5py.File(sys.argv[1], 'r+')\nprint('open', "
            "flush=True)\ntime.sleep(60)\n")
    writer = subprocess.Popen([sys.executable, "-c", code, live], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert writer.stdout.readline().strip() == "open"
        result = compare_path(str(tmp_path), progress=False)
        status = dict(zip(result.files["source"], result.files["status"]))
        assert status == {"a.h5": "ok", "b.h5.partial": "skipped"}
        reason = result.files.set_index("source").loc["b.h5.partial", "reason"]
        assert "still being written" in reason
        with pytest.raises(UserError, match="still being written"):
            compare_path(live, progress=False)
    finally:
        writer.kill()
        writer.wait()


def test_compare_path_user_errors(tmp_path):
    with pytest.raises(UserError, match="no such file or directory"):
        compare_path(str(tmp_path / "nope"))
    with pytest.raises(UserError, match=str(tmp_path)):
        compare_path(str(tmp_path))
    with pytest.raises(UserError, match="use .csv or .xlsx"):
        compare_path(str(tmp_path), str(tmp_path / "report.txt"))


def test_a_folder_as_the_report_and_a_second_dump_are_said_so(tmp_path):
    """-o naming a folder read as 'unknown report format'; two dumps without --baseline got
    click's bare 'unexpected extra argument'."""
    rng = np.random.default_rng(3)
    dump = write_dump(str(tmp_path / "d" / "ok.h5"), normal_rounds(rng, n_rounds=2))
    proc = run_cli(dump, "-o", str(tmp_path))
    assert proc.returncode == 2 and f"{tmp_path}: a folder; -o names the report file" in \
        proc.stderr, proc.stderr
    proc = run_cli(dump, dump, "-o", str(tmp_path / "r.csv"))
    assert proc.returncode == 2 and "to compare with a golden run: srdd-compare MINE " \
        "--baseline GOLDEN" in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
    # msit's -o is a folder: one not made yet, named with its slash, is said as a folder too
    # (it read "unknown report format '(no extension)'")
    proc = run_cli(dump, "-o", str(tmp_path / "out") + "/")
    assert proc.returncode == 2 and "out/: a folder; -o names the report file" in proc.stderr
    assert not (tmp_path / "out").exists()
    proc = run_cli(dump, "-o", "")  # it read "error: : unknown report format"
    assert proc.returncode == 2 and "error: -o is empty: name the report file" in proc.stderr, \
        proc.stderr
    # msit's paths as flags: -gp read as "No such option: -g"
    for flags in (["-gp", dump, "-mp", dump], ["--golden-path", dump]):
        proc = run_cli(*flags, "-o", str(tmp_path / "r.csv"))
        assert proc.returncode == 2 and f"No such option: {flags[0]}; the dumps are arguments: " \
            "srdd-compare MY_DUMPS --baseline GOLDEN_DUMPS" in proc.stderr, proc.stderr
    # -op is read by click as -o p (a report named "p"): said before click reads it
    proc = run_cli(dump, "--baseline", dump, "-op", "map.yaml", "--bogus")
    assert proc.returncode == 2 and "No such option: -op; use --mapping" in proc.stderr, \
        proc.stderr
    # msprobe's selections as flags, and a step folder given as a run: its folder is the path
    proc = run_cli(dump, "--step", "1", "-o", str(tmp_path / "r.csv"))
    assert proc.returncode == 2 and "No such option: --step; give the step's folder as the " \
        "path" in proc.stderr, proc.stderr
    folder = os.path.dirname(dump)
    os.makedirs(os.path.join(folder, "step1"))
    proc = run_cli(folder, "--run", "step1", "-o", str(tmp_path / "r.csv"))
    assert proc.returncode == 2 and proc.stderr.rstrip().endswith(
        f"{os.path.join(folder, 'step1')} is a folder: give it as the path (an msprobe dump's "
        "step or rank folder is no run)"), proc.stderr
    os.rmdir(os.path.join(folder, "step1"))
    # srdd-dump's options given to srdd-compare, and the other way round: said whose they are
    # (click offered "Possible options: --help", and --seed for --baseline)
    proc = run_cli(dump, "--steps", "0")
    assert proc.returncode == 2 and proc.stderr.startswith(
        "srdd-compare: error: No such option: --steps; --steps is an option of srdd-dump "
        "(what a run captures)") and "Possible" not in proc.stderr, proc.stderr
    proc = run_cli(dump, "-o")  # an option both commands have: no hint
    assert proc.returncode == 2 and "srdd-dump" not in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "srdd_dump.cli.dump", "--exec", "python x.py",
                           "--baseline=g"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith(
        "srdd-dump: error: No such option: --baseline; --baseline is an option of "
        "srdd-compare") and "Possible" not in proc.stderr, proc.stderr


# -- CLI -------------------------------------------------------------------------------------


def _bad_inputs(tmp_path) -> dict:
    rng = np.random.default_rng(3)
    good = write_dump(str(tmp_path / "good" / "ok.h5"), normal_rounds(rng, n_rounds=4))
    cases = {"missing": (str(tmp_path / "missing"), str(tmp_path / "missing"))}
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("not a dump")
    cases["empty"] = (str(empty), str(empty))

    text = tmp_path / "text" / "bad.h5"
    text.parent.mkdir()
    text.write_text("this is not HDF5\n" * 100)
    cases["not_hdf5"] = (str(text.parent), str(text))

    cut = tmp_path / "cut" / "cut.h5"
    cut.parent.mkdir()
    blob = Path(good).read_bytes()
    cut.write_bytes(blob[: len(blob) // 2])
    cases["truncated"] = (str(cut.parent), str(cut))

    newer = tmp_path / "newer" / "vnext.h5"
    newer.parent.mkdir()
    shutil.copy(good, newer)
    with h5py.File(newer, "r+") as f:
        f.attrs[s.ATTR_VERSION] = s.SCHEMA_VERSION + 1
    cases["newer_schema"] = (str(newer.parent), str(newer))
    return cases


def test_cli_bad_inputs_one_line_exit_2(tmp_path):
    for case, (arg, named) in _bad_inputs(tmp_path).items():
        out = tmp_path / f"{case}.csv"
        proc = run_cli(arg, "-o", str(out))
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, (case, proc.stderr)
        assert len(lines) == 1, (case, proc.stderr)
        assert lines[0].startswith("srdd-compare: error: ") and named in lines[0], case
        assert "Traceback" not in proc.stderr
        assert not out.exists()
        if case == "newer_schema":
            assert f"schema version {s.SCHEMA_VERSION + 1}" in lines[0]
    # what the option parser refuses: one line as well, naming the option, not click's usage
    for args, named in ((["x", "-j", "two"], "--jobs"), (["x", "--bogus"], "--bogus"),
                        ([], "DUMPS"), (["x", "y"], "(y)")):
        proc = run_cli(*args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (args, proc.stderr)
        assert lines[0].startswith("srdd-compare: error: ") and named in lines[0], lines


def test_cli_good_and_bad_file_writes_report(tmp_path):
    rng = np.random.default_rng(5)
    dumps = tmp_path / "dumps"
    write_dump(str(dumps / "good.h5"), normal_rounds(rng))
    (dumps / "broken.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 64)
    proc = run_cli(str(dumps), cwd=str(tmp_path))  # default output in the cwd
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    warnings = proc.stderr.strip().splitlines()
    assert len(warnings) == 1 and "broken.h5" in warnings[0] and "warning" in warnings[0]
    assert "1 skipped" in proc.stdout and "srdd_report.csv" in proc.stdout
    with open(tmp_path / "srdd_report.files.csv", newline="") as f:
        files = {r["source"]: r for r in csv.DictReader(f)}
    assert files["good.h5"]["status"] == "ok"
    assert files["broken.h5"]["status"] == "skipped"
    assert "broken.h5" in files["broken.h5"]["reason"]
    with open(tmp_path / "srdd_report.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["source"] for r in rows} == {"good.h5"} and len(rows) == 2


def test_cli_quiet_xlsx_and_version(tmp_path):
    faulty_dump(str(tmp_path))
    out = tmp_path / "r.xlsx"
    proc = run_cli(str(tmp_path), "-o", str(out), "--quiet")
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == ""
    assert out.exists()
    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("srdd-compare ")
    proc = run_cli()
    assert proc.returncode == 2


@pytest.mark.parametrize("baseline", [False, True])
def test_a_report_extension_in_capitals_is_written(tmp_path, baseline):
    faulty_dump(str(tmp_path / "d"))
    faulty_dump(str(tmp_path / "g"))  # a dump of its own: the same one would be said to be
    out = tmp_path / "R.XLSX"
    extra = ["--baseline", str(tmp_path / "g")] if baseline else []
    proc = run_cli(str(tmp_path / "d"), *extra, "-o", str(out), "--quiet")
    assert proc.returncode in (0, 1) and proc.stderr == "", proc.stderr
    assert out.exists() and out.read_bytes()[:2] == b"PK"  # a workbook (a zip)


NO_TORCH = """
import sys
from pathlib import Path
{poison}
from srdd_dump.cli.compare import run_command  # the command, in this process
sys.argv = ["srdd-compare", {folder!r}, "-o", {out!r}, "--quiet"]
try:
    run_command()
except SystemExit as e:
    assert e.code in (0, None), e.code
assert sys.modules.get("torch") is None, "torch was imported"
print("ok")
"""


@pytest.mark.parametrize("poison", [
    "sys.modules['torch'] = None", "",
    "sys.modules['threadpoolctl'] = None",  # installed without it (--no-deps): speed only
])
def test_compare_never_imports_torch(tmp_path, poison):
    faulty_dump(str(tmp_path))
    out = str(tmp_path / "r.xlsx")
    code = NO_TORCH.format(poison=poison, folder=str(tmp_path), out=out)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok" and os.path.exists(out)


def test_cli_unexpected_error_one_line_traceback_only_with_debug(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import srdd_dump.compare
    from srdd_dump.cli.compare import app

    def boom(*args, **kwargs):
        raise RuntimeError("disk on fire\nsecond line")

    monkeypatch.setattr(srdd_dump.compare, "compare_path", boom)
    runner = CliRunner()
    result = runner.invoke(app, [str(tmp_path)])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "srdd-compare: error: unexpected RuntimeError: disk on fire "
        "(run with --debug for the traceback)"
    ]
    result = runner.invoke(app, [str(tmp_path), "--debug"])
    assert result.exit_code == 2
    assert "Traceback" in result.stderr and "disk on fire" in result.stderr


CRASH = """
import os, sys, time
sys.path.insert(0, {tests!r})
import numpy as np
from dumpfactory import to_storage
from srdd_dump.format.writer import DumpWriter, Round, Tensor
w = DumpWriter({path!r}, {{"rank": 3, "pid": os.getpid()}}, ["a", "b"])
rng = np.random.default_rng(0)
for i in range(3):
    x = to_storage(rng.standard_normal((1, 4, 64)).astype(np.float32), "bfloat16")
    w.submit(Round(sample=i, step=0, batch=1, seq=4, positions=np.arange(4),
                   tensors=[Tensor(0, x, "bfloat16"), Tensor(1, x * 0, "bfloat16")]))
while w.rounds_written < 3:
    time.sleep(0.01)
os._exit(1)  # crash: no close, no rename
"""


def test_really_crashed_writer_leaves_usable_partial(tmp_path):
    code = CRASH.format(tests=os.path.dirname(__file__), path=str(tmp_path / "r.h5"))
    subprocess.run([sys.executable, "-c", code], timeout=60, check=False)
    assert os.listdir(tmp_path) == ["r.h5.partial"]
    result = compare_path(str(tmp_path), progress=False)
    assert list(result.files["status"]) == ["incomplete"]
    assert result.files.loc[0, "rank"] == 3 and result.files.loc[0, "rounds"] == 3
    assert list(result.layers["diagnosis"]) == ["DEAD_ZONE", ""]
    assert set(result.layers["samples"]) == {3}


def test_fit_columns_handles_all_missing_columns():
    import pandas as pd
    from openpyxl import Workbook

    from srdd_dump.report.sheets import MAX_WIDTH, fit_columns

    df = pd.DataFrame({"name": pd.array([pd.NA, pd.NA], dtype="string"), "x": ["a" * 99, "b"]})
    sheet = Workbook().active
    fit_columns(sheet, df)
    assert sheet.column_dimensions["A"].width == len("name") + 2
    assert sheet.column_dimensions["B"].width == MAX_WIDTH


def test_a_dead_worker_is_not_called_a_damaged_file(tmp_path):
    """compare_path(jobs=2) from a script without a __main__ guard: the spawned worker re-runs
    the script, and the message says what to do instead of blaming the dump file."""
    faulty_dump(tmp_path / "d")
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import sys\nfrom srdd_dump.compare import compare_path\nfrom srdd_dump.errors import "
        "UserError\ntry:\n    compare_path(sys.argv[1], progress=False, jobs=2)\n"
        "except UserError as exc:\n    print('ERROR', exc)\n"
    )
    res = subprocess.run([sys.executable, str(script), str(tmp_path / "d")], capture_output=True,
                         text=True, timeout=120)
    assert "if __name__ == '__main__':" in res.stdout and "damaged" not in res.stdout


def test_a_csv_report_does_not_load_openpyxl(tmp_path):
    """openpyxl costs 0.09 s of a CSV compare: only the XLSX writers import it."""
    faulty_dump(str(tmp_path))
    code = (
        "import sys\nfrom srdd_dump.compare import compare_path\n"
        "from srdd_dump.report import write_report\n"
        "write_report(compare_path(sys.argv[1], progress=False), sys.argv[1] + '/r.csv')\n"
        "print('openpyxl' in sys.modules)\n"
    )
    out = python_words(code, str(tmp_path))
    assert out == ["False"]


def test_pandas_is_not_loaded_by_a_reference_free_compare_to_csv(tmp_path):
    """pandas (0.15 s of CPU) is for DataFrames: a reference-free compare, its CSV report and
    the terminal summary, healthy or with flagged layers, never import it (compare/table.py)."""
    faulty_dump(str(tmp_path))
    code = (
        "import sys\nfrom srdd_dump.compare import api\n"
        "seen = []\nreal = api.scan\n"
        "def scan(*a, **k):\n    seen.append('pandas' in sys.modules)\n"
        "    return real(*a, **k)\n"
        "api.scan = scan\n"
        "from srdd_dump.report import write_report\n"
        "from srdd_dump.report.terminal import diagnosis_text\n"
        "r = api.compare_path(sys.argv[1], progress=False)\n"
        "written = write_report(r, sys.argv[1] + '/r.csv')\n"
        "flagged = r.layer_table.rows\n"
        "r.layer_table.rows = [dict(x, verdict='NORMAL') for x in flagged]\n"
        "diagnosis_text(r, written)\nseen.append('pandas' in sys.modules)\n"
        "r.layer_table.rows = flagged\n"
        "print(seen[0], seen[1], 'FAULT' in diagnosis_text(r, written), "
        "'pandas' in sys.modules)\n"
    )
    assert python_words(code, str(tmp_path)) == ["False", "False", "True", "False"]


@pytest.mark.integration
def test_a_dump_file_named_without_a_folder_part(tmp_path):
    """`srdd-compare file.h5` in the file's folder (it once failed: "no path specified")."""
    write_dump(str(tmp_path / "mine.h5"), normal_rounds(np.random.default_rng(0)))
    (tmp_path / "notes.h5").write_text("not HDF5")
    res = run_cli("mine.h5", "-o", "r.csv", "-q", cwd=str(tmp_path))
    assert res.returncode == 0 and (tmp_path / "r.csv").exists(), res.stderr
    res = run_cli("notes.h5", "-o", "r2.csv", "-q", cwd=str(tmp_path))
    assert res.returncode == 2 and "notes.h5: not a readable HDF5 file" in res.stderr
    # a report path under a file: the reason named
    res = run_cli("mine.h5", "-o", "notes.h5/r.csv", "-q", cwd=str(tmp_path))
    assert res.returncode == 2 and "notes.h5 is a file, not a folder" in res.stderr
    # said by the checks before any work (it came after the whole compare)
    from srdd_dump.errors import UserError
    from srdd_dump.report import report_format

    with pytest.raises(UserError, match="notes.h5 is a file, not a folder"):
        report_format(str(tmp_path / "notes.h5" / "sub" / "r.csv"))
    assert report_format(str(tmp_path / "new" / "r.csv")) == ".csv"  # made when written


def test_the_documented_layer_columns_are_the_report_columns():
    """docs/cli.md lists the layer table's columns in order: it stays the report's."""
    import re

    from srdd_dump.compare.results import LAYER_COLUMNS

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "cli.md")) as fh:
        text = fh.read()
    para = text[text.index("Layer table columns, in this order:"):]
    para = para[: para.index("Rows are sorted")]
    listed = [name for span in re.findall(r"`([^`]+)`", para)
              for name in re.split(r",\s*", span)]
    assert listed == LAYER_COLUMNS


@pytest.mark.parametrize("argv, started", [
    (["DIR", "-o", "r.csv"], [("DIR", None, None)]),
    (["-j", "3", "DIR", "--run", "srdd_dump_1"], [("DIR", 3, "srdd_dump_1")]),
    (["DIR", "--baseline", "GOLD"], []),
    (["DIR", "-j", "1"], []),
    (["DIR", "-j", "two"], []),
    (["DIR", "--version"], []),
    (["--help"], []),
    (["-o", "r.csv"], []),
])
def test_workers_start_from_the_raw_options_only_for_a_reference_free_compare(
        monkeypatch, argv, started):
    from srdd_dump.cli import compare as command

    calls = []
    monkeypatch.setattr("srdd_dump.compare.early.start_workers",
                        lambda *a, fork=False: calls.append(a + (fork,)))
    command.start_workers_early(argv)
    assert calls == [a + (True,) for a in started]  # forked: no file is open yet


CLI_JOBS = """
import sys
from srdd_dump.cli.compare import main
sys.argv = ["srdd-compare", *sys.argv[1:]]
main()
"""


def test_the_command_with_forked_workers_writes_the_one_process_report(tmp_path):
    """srdd-compare -j 2 forks its worker before it opens a file (Linux): the same report as
    -j 1."""
    folder = tmp_path / "dumps"
    for rank in range(2):
        faulty_dump(str(folder), name=f"run_rank{rank}.h5")
    reports = []
    for jobs in ("1", "2"):
        out = tmp_path / f"r{jobs}.csv"
        proc = subprocess.run([sys.executable, "-c", CLI_JOBS, str(folder), "-o", str(out),
                               "-q", "-j", jobs], capture_output=True, text=True, timeout=120,
                              cwd=tmp_path)
        # the two ranks ran the same inputs: one note, that the card check needs three
        said = [line for line in proc.stderr.splitlines() if "multi-card check" not in line]
        assert proc.returncode == 0 and said == [], proc.stderr
        reports.append([out.read_text(), (tmp_path / f"r{jobs}.sublayers.csv").read_text()
                        if (tmp_path / f"r{jobs}.sublayers.csv").exists() else ""])
    assert reports[0] == reports[1]


def test_a_workers_head_start_is_the_task_the_compare_plans(tmp_path):
    """A worker started early plans on its own and reads the task the compare will hand it:
    the same task (so its result is used) and the same result; past the plan's end, none."""
    from srdd_dump.compare.early import head_start, plan
    from srdd_dump.compare.readers import close_readers
    from srdd_dump.compare.signal_reader import run_task
    from srdd_dump.compare.sources import inspect_all, locate

    folder = str(tmp_path / "dumps")
    for rank in range(2):
        faulty_dump(folder, name=f"run_rank{rank}.h5")
    try:
        tasks = plan(inspect_all(*locate(folder)).files, 2)
        for i in (0, 1):
            task, result = head_start(i, folder, 2, None)
            assert task == tasks[i] and repr(result) == repr(run_task(tasks[i]))
        assert head_start(len(tasks), folder, 2, None) == (None, None)
        assert head_start(0, str(tmp_path / "missing"), 2, None) == (None, None)
    finally:
        close_readers()


def test_the_command_on_a_closed_pipe_and_beside_an_older_report(tmp_path):
    """`srdd-compare ... | true`: the report is written, the command ends as a writer to a
    closed pipe does (141), silently; an earlier report's sub-layer and consistency tables
    beside this one (a dump without sub-layers, one card) are removed, not left to pass for
    this run's; ``--run ./NAME`` and ``--run NAME/`` name a run as ``--run NAME`` does."""
    folder = tmp_path / "dumps" / "srdd_dump_20261128_090000"
    faulty_dump(str(folder))
    out = tmp_path / "r.csv"
    older = ["r.sublayers.csv", "r.consistency.csv", "r.consistency_summary.csv"]
    for name in older:
        (tmp_path / name).write_text("an older run's table\n")
    proc = subprocess.run(
        ["bash", "-c", '"$0" -c "$1" "$2" -o "$3" -j 1 | true; exit "${PIPESTATUS[0]}"',
         sys.executable, CLI_JOBS, str(tmp_path / "dumps"), str(out)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert (proc.returncode, proc.stderr) == (141, "")
    assert out.exists() and not any((tmp_path / name).exists() for name in older)
    for run in ("./srdd_dump_20261128_090000", "srdd_dump_20261128_090000/"):
        proc = subprocess.run([sys.executable, "-c", CLI_JOBS, str(tmp_path / "dumps"),
                               "--run", run, "-o", str(out), "-q"], capture_output=True,
                              text=True, timeout=120, cwd=tmp_path)
        assert proc.returncode in (0, 1) and "error" not in proc.stderr, proc.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE as a full disk")
@pytest.mark.parametrize("name", ["r.csv", "r.xlsx"])
def test_a_report_that_cannot_be_written_whole_leaves_the_older_one(tmp_path, name):
    """A full disk while the report is written (a file-size limit): exit 2 with one line, the
    finding still on the screen, the older report's files as they were, none truncated; a
    companion table that cannot be replaced (a folder in its place) is the file named, and the
    main report is not replaced either."""
    import resource

    folder = tmp_path / "dumps"
    faulty_dump(str(folder))
    out = tmp_path / name
    older = {p: b"an older report\n" for p in (out, tmp_path / "r.files.csv")}
    for path, data in older.items():
        path.write_bytes(data)

    def full_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (400, 400))

    proc = subprocess.run([sys.executable, "-m", "srdd_dump.cli.compare", str(folder), "-o",
                           str(out), "-j", "1"], capture_output=True, text=True, timeout=120,
                          preexec_fn=full_disk)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and f"{out}: cannot write the report" in proc.stderr
    assert "FAULT" in proc.stdout and "report:" not in proc.stdout  # the finding is shown
    assert all(path.read_bytes() == data for path, data in older.items())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["dumps", *(p.name for p in older)])
    if name.endswith(".csv"):
        (tmp_path / "r.files.csv").unlink()
        (tmp_path / "r.files.csv").mkdir()
        proc = run_cli(str(folder), "-o", str(out), "-j", "1")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert f"{tmp_path / 'r.files.csv'}: cannot write the report" in proc.stderr
        assert out.read_bytes() == older[out]


def test_report_files_placed_under_a_double_slash_or_through_a_link(tmp_path):
    """`-o "$OUT/r.csv"` with OUT ending in a slash: the tables just written stay (the stale
    check goes by name), an older report's table this one lacks goes; a link in the report's
    place is written through, the link kept."""
    from srdd_dump.report.placing import place

    def write(path):
        tables = [path, path[:-4] + ".sublayers.csv"]
        for table in tables:
            Path(table).write_text(os.path.basename(table))
        return tables

    (tmp_path / "r.consistency.csv").write_text("an older run's table")
    written = place(f"{tmp_path}//r.csv", write,
                    (f"{tmp_path}//r.sublayers.csv", f"{tmp_path}//r.consistency.csv"))
    assert [os.path.basename(p) for p in written] == ["r.csv", "r.sublayers.csv"]
    assert (tmp_path / "r.sublayers.csv").read_text() == "r.sublayers.csv"
    assert not (tmp_path / "r.consistency.csv").exists()
    target = tmp_path / "kept" / "elsewhere.csv"
    target.parent.mkdir()
    target.write_text("an older report")
    (tmp_path / "link.csv").symlink_to(target)
    place(str(tmp_path / "link.csv"), write)
    assert (tmp_path / "link.csv").is_symlink() and target.read_text() == "link.csv"


def test_workers_are_forked_only_from_a_clean_process(monkeypatch):
    from srdd_dump.runtime.pool import can_fork

    monkeypatch.delitem(sys.modules, "torch", raising=False)
    if threading.active_count() == 1:
        assert can_fork() == sys.platform.startswith("linux")
    monkeypatch.setitem(sys.modules, "torch", object())
    assert not can_fork()
    monkeypatch.delitem(sys.modules, "torch")
    wake = threading.Event()
    other = threading.Thread(target=wake.wait)
    other.start()
    try:
        assert not can_fork()
    finally:
        wake.set()
        other.join()


def test_experts_the_probed_tokens_never_reached_are_named_in_a_note():
    """An expert that got tokens, none of them in a probed sample (the router's choice), is
    judged without probe responses: a note names it; none when no site was probed at all."""
    from srdd_dump.analysis.signals import DECODE, PREFILL, Signals
    from srdd_dump.compare.reference_free import unprobed_experts
    from srdd_dump.vocabulary import EXPERT

    def expert(k, phase, probed):
        return Signals(layer=1, site=k, module=f"model.layers.1.mlp.experts.{k}", phase=phase,
                       role=EXPERT, samples=2, probed_samples=probed)

    block = Signals(layer=1, site=-1, module="model.layers.1", phase=PREFILL, samples=2,
                    probed_samples=1)
    signals = [block, expert(0, PREFILL, 1), expert(1, PREFILL, 0), expert(1, DECODE, 0),
               expert(2, PREFILL, 0), expert(2, DECODE, 1)]
    (note,) = unprobed_experts("f.h5", signals)
    assert note.startswith("f.h5: 1 expert got none of the probed tokens "
                           "(model.layers.1.mlp.experts.1): judged on their outputs alone"), note
    assert unprobed_experts("f.h5", [expert(1, PREFILL, 0)]) == []  # nothing probed: no note


def test_the_healthy_headline_names_the_phases_judged_and_unprobed_decode_steps():
    from srdd_dump.analysis.signals import DECODE, PREFILL, Signals
    from srdd_dump.compare.reference_free import phases_note

    prefill = Signals(layer=0, site=-1, module="m", phase=PREFILL, probed_samples=1)
    assert phases_note([prefill]) == " (prefill only: no decode step was captured)"
    probed = Signals(layer=0, site=-1, module="m", phase=DECODE, probed_samples=1)
    unprobed = Signals(layer=0, site=-1, module="m", phase=DECODE, probed_samples=0)
    unprobed_site = Signals(layer=0, site=0, module="m.mlp", phase=DECODE, probed_samples=0)
    assert phases_note([prefill, probed, unprobed_site]) == " (prefill and decode steps)"
    assert phases_note([prefill, unprobed]) == " (prefill and decode steps, decode unprobed)"
    # nothing probed at all (an msprobe dump): the sample count says so ("none probed")
    unprobed_prefill = Signals(layer=0, site=-1, module="m", phase=PREFILL, probed_samples=0)
    assert phases_note([unprobed_prefill, unprobed]) == " (prefill and decode steps)"
    # decode probed, no prefill probed (its probed forward was lost): not said to be probed
    assert phases_note([unprobed_prefill, probed]) == (
        " (prefill and decode steps, prefill unprobed)")
    # a sliding-window cache longer than its window: some layers' decode blocks unprobed
    layers = [Signals(layer=k, site=-1, module=f"m{k}", phase=DECODE, probed_samples=int(k < 3))
              for k in range(18)]
    assert phases_note([prefill, *layers]) == (
        " (prefill and decode steps, decode probed at 3 of 18 layers)")
    # a serving engine's later file holding decode steps of requests under way only
    assert phases_note([unprobed]) == " (decode steps only: no prefill is in this file)"
    assert phases_note(layers) == (
        " (decode steps only: no prefill is in this file, decode probed at 3 of 18 layers)")
    # no block's decode step probed while a sub-layer's was (every layer a sliding window)
    probed_site = Signals(layer=0, site=0, module="m.mlp", phase=DECODE, probed_samples=1)
    assert phases_note([prefill, unprobed, probed_site]) == (
        " (prefill and decode steps, decode probed at 0 of 1 layers)")
    # the stack input (layer -1) is never probed: not a layer left unprobed
    stack = Signals(layer=-1, site=-1, module="embed", phase=DECODE, probed_samples=0)
    assert phases_note([prefill, probed, stack]) == " (prefill and decode steps)"


def test_a_huge_jobs_count_is_capped_at_the_cores(tmp_path):
    """-j 100000 forked thousands of workers for a 4-layer dump and never ended: more processes
    than cores only wait for one, so -j is capped at the usable cores (at least 2)."""
    faulty_dump(str(tmp_path / "d"))
    done = run_cli(str(tmp_path / "d"), "-o", str(tmp_path / "r.csv"), "-q", "-j", "100000")
    assert done.returncode == 0, done.stderr
    from srdd_dump.compare.pipeline import check_jobs, job_cap

    assert check_jobs(100000) == job_cap() == max(2, len(os.sched_getaffinity(0)))
    assert check_jobs(1) == 1


def test_an_aqn_config_named_like_an_input_is_refused(tmp_path):
    """--aqn-config naming the dump compared replaced it with YAML at exit 0 (and one named
    like a dump inside the dump folder would be read as one next time)."""
    faulty_dump(str(tmp_path / "d"))
    dump = str(tmp_path / "d" / "run_rank0.h5")
    before = Path(dump).read_bytes()
    done = run_cli(dump, "-o", str(tmp_path / "r.csv"), "--aqn-config", dump)
    assert done.returncode == 2 and "an input" in done.stderr, done.stderr
    done = run_cli(str(tmp_path / "d"), "-o", str(tmp_path / "r.csv"), "--aqn-config",
                   str(tmp_path / "d" / "aqn.h5"))
    assert done.returncode == 2 and "are read from" in done.stderr, done.stderr
    assert Path(dump).read_bytes() == before and not (tmp_path / "d" / "aqn.h5").exists()


def test_module_names_with_control_characters_make_an_xlsx_report(tmp_path):
    """A crafted dump whose module names hold control characters (an escape sequence): the
    XLSX report was refused by openpyxl (exit 2, 'IllegalCharacterError'); each such character
    is written as U+FFFD."""
    names = ["layers.0", "layers.1\x01\x02", "layers.2\x1b]0;TITLE\x07", "layers.3\x0b"]
    faulty_dump(str(tmp_path / "d"), names=names)
    out = tmp_path / "r.xlsx"
    done = run_cli(str(tmp_path / "d"), "-o", str(out), "-q")
    assert done.returncode == 0, done.stderr
    cells = [c.value for ws in openpyxl.load_workbook(out) for row in ws.iter_rows()
             for c in row if isinstance(c.value, str)]
    assert any("layers.2\ufffd]0;TITLE\ufffd" in c for c in cells)
    assert not any("\x1b" in c or "\x01" in c for c in cells)


def test_module_names_with_control_characters_reach_the_terminal_as_text(tmp_path):
    """The same crafted names printed raw: an escape sequence in a module name acted on the
    user's terminal (here, set its title). Every control character but tab and newline is
    printed as U+FFFD, in both modes."""
    names = ["layers.0", "layers.1\x9b2J", "layers.2\x1b]0;TITLE\x07", "layers.3\r"]
    faulty_dump(str(tmp_path / "d"), names=names)
    shown = []
    for extra in ((), ("--baseline", str(tmp_path / "d"))):
        done = run_cli(str(tmp_path / "d"), "-o", str(tmp_path / "r.csv"), *extra,
                       *(() if extra else ("--explain",)))
        assert done.returncode == 0, done.stderr
        shown.append(done.stdout + done.stderr)
    for text in shown:
        assert not any(c in text for c in "\x1b\x07\x9b\r"), text
    assert "layers.2\ufffd]0;TITLE\ufffd" in shown[0], shown[0]


def test_a_named_pipe_named_like_a_dump_is_skipped_not_waited_on(tmp_path):
    """A FIFO named *.h5 in the dump folder: opening it waited for a writer until
    --read-timeout (300 s). It is skipped in one line; the real dump is compared."""
    faulty_dump(str(tmp_path / "d"))
    os.mkfifo(tmp_path / "d" / "pipe.h5")
    done = run_cli(str(tmp_path / "d"), "-o", str(tmp_path / "r.csv"), "-q",
                   "--read-timeout", "60")
    assert done.returncode == 0, done.stderr
    assert "pipe.h5: not a regular file" in done.stderr, done.stderr


def test_a_faults_hunt_line_follows_its_own_files_headline(tmp_path):
    """Several files, the first one faulty (a black-box user's folder of 7): the hunt line came
    after the last file's 'no faulty layer found', naming no file. It now follows the FAULT's
    own headline; a hunt the program set itself (no headline of it) still comes after them."""
    from srdd_dump.compare.results import CompareResult
    from srdd_dump.report.terminal import diagnosis_text

    faulty_dump(str(tmp_path / "dumps"))
    base = compare_path(str(tmp_path / "dumps"), progress=False)
    hunt = "srdd-dump --exec 'python infer.py' --layers model.layers.1"
    result = CompareResult(base.path, base.layers, base.files, headlines=[
        "a.h5: Layer 1 (model.layers.1): FAULT - dead zone", "b.h5: no faulty layer found"],
        hunts=[hunt, "srdd-dump --exec 'python other.py'"], hunt_of={0: hunt})
    lines = diagnosis_text(result).splitlines()
    assert lines[:3] == ["a.h5: Layer 1 (model.layers.1): FAULT - dead zone",
                         f"to name the operator inside it, capture that layer's operators: {hunt}",
                         "b.h5: no faulty layer found"], lines[:4]
    assert lines[3].endswith("srdd-dump --exec 'python other.py'"), lines[:4]
    # the real compare maps its one FAULT file's hunt to its headline
    if base.hunts:
        assert base.hunt_of == {0: base.hunts[0]}
