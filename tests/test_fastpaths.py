"""The compare hot path's shortcuts give exactly what the plain numpy formulations give."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import numpy as np
import pytest

from srdd_dump.analysis import array_stats, metrics
from srdd_dump.format.schema import bf16_bits_to_float32, float32_to_bf16_bits

from capture_utils import python_words
from dumpfactory import normal_rounds, write_dump

RNG = np.random.default_rng(0)


def _pileup_reference(x: np.ndarray, bins: int = 100) -> float:
    """The full-histogram formulation the fast _pileup replaces."""
    x = x[np.isfinite(x)]
    if x.size < 10 * bins or x.min() == x.max():
        return float("nan")
    hist, _ = np.histogram(x, bins=bins)
    hist = hist.astype(np.float64)
    right = hist[-1] / max(1.0, (hist[-3] + hist[-4]) / 2)
    left = hist[0] / max(1.0, (hist[2] + hist[3]) / 2)
    return float(max(left, right))


def _adversarial(dtype, n=5000) -> list[np.ndarray]:
    base = RNG.standard_normal(n).astype(dtype)
    clipped = np.clip(base, -1.5, 1.5)  # pile-ups on both edges
    lo, hi = base.min(), base.max()
    edges = np.linspace(lo, hi, 101, dtype=dtype)
    # values exactly on every bin edge and one ulp either side
    on_edges = np.concatenate([base, edges, np.nextafter(edges, np.inf).astype(dtype),
                               np.nextafter(edges, -np.inf).astype(dtype)])
    on_edges = np.clip(on_edges, lo, hi)
    steps = np.round(base * 3).astype(dtype)  # few distinct values
    wide = (RNG.standard_normal(n) * 1e30).astype(dtype)
    return [base, clipped, on_edges, steps, wide, np.abs(base)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_pileup_matches_full_histogram(dtype):
    for x in _adversarial(dtype):
        got, want = array_stats.pileup(x), _pileup_reference(x)
        assert (np.isnan(got) and np.isnan(want)) or got == want


def test_median_matches_numpy():
    for n in (1, 2, 3, 10, 33001, 33002):
        x = np.abs(RNG.standard_normal(n)).astype(np.float32)
        x[: n // 3] = 0
        assert array_stats.median(x) == float(np.median(x))


def test_median_selection_matches_numpy():
    """Large arrays: the middle values selected between a sample's quantiles (ties, sorted
    input, infinities, few distinct values) are np.median's."""
    n = 23040
    base = RNG.standard_normal(n).astype(np.float32)
    cases = [np.abs(base), np.sort(base), np.round(base * 2), np.zeros(n, np.float32),
             np.where(base > 1.5, np.inf, base), np.abs(base)[:-1], np.repeat(base[:64], 360)]
    for x in cases:
        assert array_stats.median(x) == float(np.median(x))


def _grid_reference(rows: np.ndarray, dtype: str) -> float:
    from srdd_dump.vocabulary import UNIT_ROUNDOFF, grid_min_values, grid_row_picks, on_grid
    tested = on = 0
    for r in grid_row_picks(rows.shape[0]):
        v = rows[r][np.isfinite(rows[r])]
        if np.count_nonzero(v) >= grid_min_values(dtype):
            tested += 1
            on += on_grid(np.unique(v.astype(np.float64)), UNIT_ROUNDOFF[dtype])
    return on / tested if tested else float("nan")


def test_grid_rows_match_one_row_at_a_time():
    """The grid test's shortcuts (rows sorted at once, rows of 258 distinct first values
    ruled out) give the answers of np.unique row by row."""
    x = RNG.standard_normal((40, 576)).astype(np.float32)
    scale = np.abs(x).max(axis=1, keepdims=True) / 127
    cases = [x, x[:1], (np.rint(x / scale) * scale).astype(np.float32),
             bf16_bits_to_float32(float32_to_bf16_bits(x)), np.where(x > 0, x, 0),
             np.rint(x * 3), np.vstack([np.rint(x[:1] * 3), x[1:]]),
             (np.rint(x[:, :100] / scale) * scale).astype(np.float32)]  # bf16: too few values
    for rows in cases:
        for dtype in ("float32", "bfloat16", "float16"):
            got, want = array_stats.grid_rows(rows, dtype), _grid_reference(rows, dtype)
            assert (math.isnan(got) and math.isnan(want)) or got == want


def _ties_reference(rows: np.ndarray) -> float:
    rows = np.unique(rows, axis=0)
    if rows.shape[0] < 2:
        return float("nan")
    hi, lo = rows.max(axis=0), rows.min(axis=0)
    at_hi = np.where(hi > 0, (rows == hi).sum(axis=0), 1)
    at_lo = np.where(lo < 0, (rows == lo).sum(axis=0), 1)
    return float(max(at_hi.max(), at_lo.max()))


def test_ties_and_unique_rows_match_np_unique():
    x = RNG.standard_normal((40, 16)).astype(np.float32)
    cases = [
        x,
        np.vstack([x, x[:5]]),  # duplicated rows (a batch repeating a prompt)
        np.clip(x, -0.5, 0.5),  # clipped columns: ties in every column
        np.where(x > 0, x, 0).astype(np.float32),  # many zeros
        np.vstack([x[:1] * 0.0, -(x[:1] * 0.0), x[1:]]),  # +0 and -0 rows are equal
        np.zeros((7, 16), np.float32),
        x[:1],
    ]
    for rows in cases:
        (got, _), want = array_stats.ties(rows), _ties_reference(rows)
        assert (np.isnan(got) and np.isnan(want)) or got == want
        assert len(array_stats.unique_rows(rows)) == len(np.unique(rows, axis=0))


def test_tie_excess_is_scale_free():
    """A healthy quantised channel: the extreme holds no more values than its neighbours, for
    10 tokens or 4,000; a clip at a fixed value piles every value beyond it on one."""
    for n, q in ((10, 0.7), (4000, 0.99)):
        x = RNG.standard_normal((n, 576)).astype(np.float32)
        coarse = bf16_bits_to_float32(float32_to_bf16_bits(x))  # bf16: ties at every value
        count, excess = array_stats.ties(coarse)
        assert excess <= 3.0, (n, count, excess)  # measured: 2-3 from 10 to 16,000 tokens
        clipped = np.minimum(coarse, np.quantile(coarse, q))  # a clamp at a fixed value
        count, excess = array_stats.ties(clipped)
        assert excess >= 3 * (n * (1 - q)) ** 0.5, (n, count, excess)


def test_exp_terms_match_the_full_sums_above_the_flush_limit():
    """Whichever path _exp_terms takes (all terms, the few near the peak, or the rest clamped),
    its sum and weighted sum equal numpy's over every term, flushed ones contributing < 1e-300."""
    for peak in (0.0, 50.0, 720.0, 800.0, 30000.0):
        for spread in (1.0, 300.0, 1e4):
            x = np.concatenate([RNG.standard_normal(5000) * spread,
                                [peak, peak - 700, peak - 707, peak - 708.5, peak - 745.1]])
            x = x[x <= peak]
            w = RNG.standard_normal(x.size)
            e, w_kept = metrics._exp_terms(x, peak, float(x.min()), w)
            with np.errstate(under="ignore"):
                full = np.exp(x - peak)
            assert abs(e.sum() - full.sum()) <= 1e-12 * full.sum() + 1e-300 * x.size
            assert abs(np.dot(e, w_kept) - np.dot(full, w)) <= (
                1e-12 * np.abs(full * w).sum() + 1e-300 * np.abs(w).sum())
            assert np.all(e >= 0) and np.all(np.isfinite(e))


def test_flushed_terms_do_not_move_the_kl_of_float64_data():
    """Terms under exp(EXP_FLUSH) count as 0 even when their weights are huge (float64)."""
    g = np.array([0.0] * 600 + [-1e300] * 400)
    m = np.array([0.0] * 600 + [-1e307] * 400)
    assert metrics.compare_arrays(g, m).kl_divergence == 0.0


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_pair_stats_fast_path_matches_general_path(dtype):
    """A finite block takes the fast path; the same block with NaN/Inf added at the same
    positions on both sides takes the general one, which must give the same metrics."""
    for trial in range(6):
        g = RNG.standard_normal(3000).astype(dtype)
        m = (g.astype(np.float32) + RNG.standard_normal(3000).astype(np.float32) * 1e-2)
        m = m.astype(dtype)
        if trial % 2:
            g[:500] = 0
        if trial % 3 == 0:
            g[500:600] = 1e-8
        fast = metrics.PairStats().add(g, m)
        bad = np.array([np.nan, np.inf, -np.inf], dtype=dtype)
        slow = metrics.PairStats().add(np.concatenate([g[:7], bad, g[7:]]),
                                       np.concatenate([m[:7], bad, m[7:]]))
        assert slow.nan_inf.golden == 3 and slow.nan_inf.mismatched == 0
        assert slow.metrics() == pytest.approx(fast.metrics(), rel=1e-12, abs=1e-300)
        assert slow.golden.values() == pytest.approx(fast.golden.values(), rel=1e-12)
        assert slow.mine.values() == pytest.approx(fast.mine.values(), rel=1e-12)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_memory_kept_only_when_the_entry_point_asks(tmp_path):
    """A compare called as a library leaves the process's malloc settings alone; the
    entry point's call takes effect (and a second call changes nothing)."""
    write_dump(str(tmp_path / "d.h5"), normal_rounds(RNG))
    code = (
        "import sys; from srdd_dump.compare import compare_path\n"
        "from srdd_dump.runtime.memory import keep_freed_memory, keeps_freed_memory\n"
        "compare_path(sys.argv[1], progress=False)\n"
        "print(keeps_freed_memory(), keep_freed_memory(), keep_freed_memory(), "
        "keeps_freed_memory())\n"
    )
    out = python_words(code, str(tmp_path))
    assert out == ["False", "True", "True", "True"]


def test_worker_processes_give_the_same_report(tmp_path):
    """compare_path with jobs=2 (layers split between this process and a spawned worker) gives
    the report of jobs=1, sub-layer signals included."""
    import torch

    from srdd_dump import DumpConfig, register_hook

    from dumpfactory import compare_written as compare_path
    from tiny_models import build

    model = build("llama", layers=6)
    gen = torch.Generator().manual_seed(0)
    cfg = DumpConfig(dump_path=str(tmp_path), granularity="sublayer",
                     inject=["dead_zone@layer=3,m=0.3"])
    with register_hook(model, cfg), torch.no_grad():
        for n in (24, 31):
            model(input_ids=torch.randint(0, 128, (1, n), generator=gen))
    one = compare_path(str(tmp_path), progress=False)
    two = compare_path(str(tmp_path), progress=False, jobs=2)
    assert one.layers.equals(two.layers)
    assert one.sites.equals(two.sites)


def test_direct_chunk_reads_match_h5py(tmp_path):
    import h5py

    from srdd_dump.format.direct import ChunkRows, open_file

    path = str(tmp_path / "x.h5")
    data = RNG.standard_normal((1000, 24)).astype(np.float32)
    with h5py.File(path, "w") as f:
        f.create_dataset("plain", data=data, chunks=(37, 24), maxshape=(None, 24))
        f.create_dataset("u2", data=data.view(np.uint16)[:, :24], chunks=(50, 24))
        f.create_dataset("gzip", data=data, chunks=(37, 24), compression="gzip")
        f.create_dataset("cols", data=data, chunks=(37, 12))
        holes = f.create_dataset("holes", shape=(1000, 24), dtype=np.float32, chunks=(37, 24))
        holes[:100] = data[:100]
        holes[500:600] = data[500:600]
    fd, size = open_file(path)
    try:
        with h5py.File(path, "r") as f:
            for name in ("plain", "u2"):
                ds = f[name]
                rows = ChunkRows.open(ds, fd, size, int(f.userblock_size))
                assert rows is not None
                for a, b in [(0, 1), (0, 1000), (36, 38), (37, 74), (999, 1000), (5, 5),
                             (123, 777)]:
                    assert rows.read(a, b).tobytes() == ds[a:b].tobytes()
            for name in ("gzip", "cols"):  # h5py answers
                assert ChunkRows.open(f[name], fd, size, int(f.userblock_size)) is None
            holes = ChunkRows.open(f["holes"], fd, size, int(f.userblock_size))
            assert holes is not None
            assert holes.read(0, 100).tobytes() == data[:100].tobytes()
            assert holes.read(100, 200) is None  # never written: HDF5's fill value
            plain = ChunkRows.open(f["plain"], fd, size, int(f.userblock_size))
        # cut short while compared: an error (HDF5 itself would read zeros: a false FAULT)
        os.truncate(path, plain.offsets[0] + 10 * plain.row_bytes)
        assert plain.read(0, 5).tobytes() == data[:5].tobytes()
        with pytest.raises(OSError, match="shorter than when it was opened"):
            plain.read(0, 37)
    finally:
        os.close(fd)


def test_log_sum_exp_streamed_matches_one_pass():
    """Blocks folded in one by one (a large outlier, then a block whose peak is lower) give the
    log-sum-exp and weighted sum of the concatenation, computed directly."""
    for trial in range(20):
        x = RNG.standard_normal(4000)
        x[int(RNG.integers(0, 4000))] = 1000.0 + trial
        w = RNG.standard_normal(4000)
        streamed = metrics._LogSumExp()
        streamed.add(x, w)
        streamed.add(x * 0.5, w)
        both, ws = np.concatenate([x, x * 0.5]), np.concatenate([w, w])
        with np.errstate(under="ignore"):
            e = np.exp(both - both.max())
        assert streamed.peak == both.max()
        assert streamed.total == pytest.approx(e.sum(), rel=1e-13)
        assert streamed.weighted == pytest.approx(np.dot(e, ws), rel=1e-12, abs=1e-300)
        assert streamed.value == pytest.approx(both.max() + np.log(e.sum()), rel=1e-15)


def test_percentile_matches_numpy():
    for n in (1, 2, 3, 39, 575, 576, 577, 4096):
        for scale in (1e-5, 1.0, 1e5):
            x = np.abs(RNG.standard_normal(n)) * scale
            for values in (x, np.round(x, 1)):
                for q in (0.0, 0.5, 0.9, 0.99, 1.0):
                    assert array_stats.percentile(values, q) == float(np.quantile(values, q))


def test_one_blas_thread_restores_the_callers_settings():
    from threadpoolctl import threadpool_info, threadpool_limits

    from srdd_dump.analysis import sums
    from srdd_dump.compare.pipeline import single_threaded_kernels

    def blas_threads() -> list[int]:
        return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]

    assert blas_threads(), "numpy's BLAS was not found: compares would run it on every core"
    x, y = RNG.standard_normal(50_000), RNG.standard_normal(50_000)
    plain = sums.dot(x, y)
    with threadpool_limits(2, user_api="blas"):
        before = blas_threads()
        with single_threaded_kernels():
            assert blas_threads() == [1] * len(before)
            assert sums._blas is True
            assert sums.dot(x, y) == pytest.approx(plain, rel=1e-12)
        assert blas_threads() == before
    assert sums._blas is False
    assert sums.total(x) == pytest.approx(math.fsum(x), rel=1e-12)


class _SynchronousExecutor(Executor):
    """Runs each task at submit, in the caller's thread: no timing, so counts are exact."""

    def submit(self, fn, *args, **kwargs):
        fut = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001
            fut.set_exception(exc)
        return fut


def test_share_runs_every_task_once_in_order():
    """pool.share hands each task to exactly one of the workers or this process, results in
    task order, and both take part."""
    from srdd_dump.runtime.pool import share

    ran: list[tuple[str, int]] = []
    lock = threading.Lock()
    here_ran = threading.Event()

    def here(t):
        with lock:
            ran.append(("here", t))
        here_ran.set()
        return t * t

    def worker(t):
        assert here_ran.wait(10)  # the first worker task ends after this process ran one
        with lock:
            ran.append(("worker", t))
        return t * t

    with ThreadPoolExecutor(2) as pool:
        finished = []
        out = share(list(range(40)), here, worker, pool, 2, lambda: finished.append(1))
    assert out == [t * t for t in range(40)]
    assert sorted(t for _, t in ran) == list(range(40))
    assert {w for w, _ in ran} == {"here", "worker"} and len(finished) == 40


def test_share_uses_a_head_start_only_for_the_task_it_planned():
    """A head start's result stands for the scan's task of its index when the worker planned
    the same task; a task planned otherwise (the files changed in between) runs again here.
    Either way every task's result is the scan's own."""
    from srdd_dump.runtime.pool import share

    ran: list[int] = []

    def here(t):
        ran.append(t)
        return t * t

    for planned, reran in (([0, 1], []), ([0, 99], [1])):
        ran.clear()

        heads = [_SynchronousExecutor().submit(lambda t=t: (t, t * t)) for t in planned]
        out = share(list(range(10)), here, lambda t: t * t, _SynchronousExecutor(), 2,
                    heads=heads)
        assert out == [t * t for t in range(10)]
        assert set(ran) & {0, 1} == set(reran)


def test_a_single_task_is_not_run_again_after_its_head_start():
    """A plan of one task whose head start a worker already ran: its result is used, the task
    not run again here (it was: the pool waited for the head, then the task ran again)."""
    from srdd_dump.runtime.pool import run_tasks

    ran: list[int] = []

    def here(t):
        ran.append(t)
        return t * 10

    with ThreadPoolExecutor(1) as pool:
        head = pool.submit(lambda: (7, 70))
        assert run_tasks(here, [7], jobs=2, pool=pool, heads=[head]) == [70]
    assert ran == []
    with ThreadPoolExecutor(1) as pool:  # planned otherwise: run here
        head = pool.submit(lambda: (8, 80))
        assert run_tasks(here, [7], jobs=2, pool=pool, heads=[head]) == [70]
    assert ran == [7]


def test_forked_workers_released_at_the_scans_end_are_reaped_before_the_command_ends():
    """A forked pool is told to end without waiting (its workers end while the report is
    written), and ``reap`` waits for them: no worker outlives the command as an orphan."""
    code = (
        "import multiprocessing, os\n"
        "from srdd_dump.runtime.pool import release, reap, start_pool\n"
        "pool = start_pool(2, fork=True)\n"
        "print(pool.forked, pool.submit(os.getpid).result() != os.getpid())\n"
        "release(pool)\n"
        "reap()\n"
        "print(multiprocessing.active_children())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.splitlines() == [f"{sys.platform.startswith('linux')} True", "[]"]
    assert out.stderr == ""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forked workers: Linux")
def test_workers_leave_ctrl_c_to_the_compare():
    """A worker ignores SIGINT (Ctrl-C reaches the whole process group): the compare stops,
    and no worker is interrupted in the middle of sending a result (that left the parent
    waiting for the rest, once in about 100 interrupts)."""
    code = (
        "import os, signal\n"
        "from srdd_dump.runtime.pool import start_pool\n"
        "def interrupted():\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    return 'worked on'\n"
        "if __name__ == '__main__':\n"
        "    with start_pool(1, fork=True) as pool:  # a spawned one finds no __main__ here\n"
        "        print(pool.submit(interrupted).result())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout == "worked on\n" and "Traceback" not in out.stderr, out.stderr


def test_blas_loaded_at_one_thread_leaves_the_environment_alone():
    """srdd-compare's process loads numpy's BLAS at one thread (its idle threads would spin,
    and again in every forked worker), without passing the setting to what it runs later;
    importing the command's module from a script changes nothing."""
    threads = "[i['num_threads'] for i in threadpool_info() if i['user_api'] == 'blas']"
    command = (
        "import os, sys, types\n"
        "from threadpoolctl import threadpool_info\n"
        "def report():\n"
        f"    print({threads})\n"
        "    print(os.environ.get('OPENBLAS_NUM_THREADS'), os.environ.get('OMP_NUM_THREADS'))\n"
        "stand_in = types.ModuleType('srdd_dump.cli.compare')\n"
        "stand_in.main = report\n"
        "sys.modules['srdd_dump.cli.compare'] = stand_in  # the command, once its BLAS is set\n"
        "from srdd_dump.cli.compare_command import main\n"
        "main()\n"
    )
    script = ("import srdd_dump.cli.compare\n"
              f"from threadpoolctl import threadpool_info\nprint({threads})\n")
    plain = f"import numpy\nfrom threadpoolctl import threadpool_info\nprint({threads})\n"
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}

    def run(code: str) -> list[str]:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=env, check=True).stdout.splitlines()

    assert run(command) == ["[1]", "None None"]
    assert run(script) == run(plain)
    env["OPENBLAS_NUM_THREADS"] = "2"
    assert run(command) == ["[1]", "2 None"]


def test_share_raises_a_workers_error_and_hands_out_nothing_more():
    from srdd_dump.runtime.pool import share

    ran = []

    def fails(t):
        raise RuntimeError("worker died")

    with pytest.raises(RuntimeError, match="worker died"):
        share(list(range(20)), ran.append, fails, _SynchronousExecutor(), 1)
    assert ran == []  # the worker failed on task 0 before this process took one


def test_share_stops_feeding_workers_when_this_process_fails():
    from srdd_dump.runtime.pool import share

    remote_ran = []
    release = threading.Event()

    def remote(t):
        assert release.wait(10)  # busy until this process has failed
        remote_ran.append(t)

    def local(t):
        raise ValueError("damaged")

    with ThreadPoolExecutor(2) as pool:
        with pytest.raises(ValueError, match="damaged"):
            share(list(range(40)), local, remote, pool, 2)
        release.set()
    assert sorted(remote_ran) == [0, 1]  # the two handed out first, not the other 37
