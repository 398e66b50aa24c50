"""Performance of srdd-dump on this machine, as ratios, in one run: capture, scan, dump, compare,
side by side with a plain forward, msprobe and the first SRDD; checks the targets of issue 6.

    python bench/perf.py [--quick] [--sections capture,scan,scaling,dump,compare,msprobe]
                         [--workdir DIR] [--keep] [--msprobe-python PATH] [--out JSON]

Models: SmolLM2-135M-Instruct (real weights, 30 layers, fp32) and a random-initialised model of
Qwen2-0.5B's shape (fp32, built from a config; see bench/_models.py). Inputs are seeded random
token ids, 121 tokens unless said otherwise, batch 1. Times are medians of interleaved repeats;
every result is a ratio of two times taken in the same run. msprobe (PyPI mindstudio-probe) is
run with --msprobe-python (default /tmp/msprobe-venv/bin/python, or this Python if it has
msprobe); it is never a dependency of srdd-dump. The figures go to --out (JSON) and are printed
as markdown tables; docs/benchmarks.md explains each one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

RESULTS: dict = {}
TARGETS: list[dict] = []
GB = 1e9


# -- helpers -----------------------------------------------------------------------------------


def say(text: str = "") -> None:
    print(text, flush=True)


def loadavg() -> float:
    return os.getloadavg()[0]


def median(xs) -> float:
    return float(statistics.median(xs))


def table(title: str, header: list[str], rows: list[list]) -> None:
    say(f"\n### {title}\n")
    say("| " + " | ".join(header) + " |")
    say("|" + "---|" * len(header))
    for row in rows:
        say("| " + " | ".join(_fmt(x) for x in row) + " |")


def _fmt(x) -> str:
    if isinstance(x, float):
        if math.isnan(x):
            return "n/a"
        if abs(x) >= 100:
            return f"{x:.0f}"
        if abs(x) >= 10:
            return f"{x:.1f}"
        return f"{x:.2f}"
    return str(x)


def target(name: str, value: float, limit: float, op: str, unit: str = "") -> None:
    ok = value <= limit if op == "<=" else value >= limit
    TARGETS.append({"target": name, "value": value, "limit": limit, "op": op, "unit": unit,
                    "met": bool(ok)})


def drop_cache(path: str) -> None:
    """Evict a file (or every file under a folder) from the page cache (clean pages only)."""
    paths = [path] if os.path.isfile(path) else [
        os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(path: str) -> None:
    paths = [path] if os.path.isfile(path) else [
        os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    for p in paths:
        with open(p, "rb", buffering=0) as fh:
            while fh.read(16 << 20):
                pass


def dump_bytes(path: str) -> int:
    from _models import du

    return du(path)[0] if os.path.isdir(path) else os.path.getsize(path)


def run_measured(cmd: list[str], env: dict | None = None) -> dict:
    """Run ``cmd``; wall time, peak RSS of its whole process tree (the sum over its processes,
    sampled every 20 ms), the largest RSS of one of them, and its last JSON line of stdout."""
    import psutil

    full_env = dict(os.environ, **(env or {}))
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env)
    peak = [0, 0]
    done = threading.Event()

    def sample():
        try:
            root = psutil.Process(proc.pid)
        except psutil.NoSuchProcess:
            return
        while not done.is_set():
            total = 0
            try:
                for p in [root] + root.children(recursive=True):
                    try:
                        rss = p.memory_info().rss
                    except psutil.NoSuchProcess:
                        continue
                    total += rss
                    peak[1] = max(peak[1], rss)
            except psutil.NoSuchProcess:
                break
            peak[0] = max(peak[0], total)
            time.sleep(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    out, err = proc.communicate()
    wall = time.perf_counter() - t
    done.set()
    thread.join()
    result = {"wall_s": wall, "peak_rss_tree": peak[0], "max_rss_one": peak[1],
              "returncode": proc.returncode}
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if lines:
        result.update(json.loads(lines[-1]))
    if proc.returncode != 0:
        result["stderr"] = err[-2000:]
    return result


# -- machine -----------------------------------------------------------------------------------


def machine() -> dict:
    import h5py
    import numpy as np
    import torch
    import transformers

    cpu = "?"
    with open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as fh:
        mem = int(fh.readline().split()[1]) * 1024
    info = {
        "cpu": cpu, "cores": os.cpu_count(), "ram_gb": round(mem / 2**30, 1),
        "os": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "numpy": np.__version__, "h5py": h5py.version.version,
        "hdf5": h5py.version.hdf5_version, "loadavg_at_start": loadavg(),
        "torch_threads": torch.get_num_threads(),
    }
    RESULTS["machine"] = info
    table("Machine", ["item", "value"], [[k, v] for k, v in info.items()])
    return info


# -- capture and scan --------------------------------------------------------------------------


def _forward(model, ids) -> float:
    t = time.perf_counter()
    model(input_ids=ids)
    return time.perf_counter() - t


def layer_time(model, ids, repeats: int) -> float:
    """Time of the decoder layers alone within a forward (hooks on the first and last)."""
    layers = model.model.layers
    marks = {}
    h1 = layers[0].register_forward_pre_hook(lambda *_: marks.__setitem__("a", time.perf_counter()))
    h2 = layers[-1].register_forward_hook(lambda *_: marks.__setitem__("b", time.perf_counter()))
    times = []
    try:
        for _ in range(repeats):
            model(input_ids=ids)
            times.append(marks["b"] - marks["a"])
    finally:
        h1.remove()
        h2.remove()
    return median(times)


def capture_only(model, ids, reps: int, workdir: str) -> tuple[list, list, float]:
    """Plain forwards and forwards captured with probes none, interleaved in one session (the
    hooks are installed around every other forward); returns both lists of times and the dump
    bytes per captured forward."""
    from srdd_dump import DumpConfig, register_hook

    tmp = tempfile.mkdtemp(dir=workdir)
    session = register_hook(model, DumpConfig(dump_path=tmp, samples=10**9, probes="none",
                                              progress=False))
    session.remove()
    plain, captured = [], []
    for _ in range(reps):
        plain.append(_forward(model, ids))
        session._install()
        captured.append(_forward(model, ids))
        session.remove()
    path = session.close()
    size = os.path.getsize(path) / reps
    shutil.rmtree(tmp)
    return plain, captured, size


def scan_session(model, ids_list, workdir, **config) -> tuple[float, str]:
    """Capture ``ids_list`` (one sample each) in one session; total wall time including the
    writer's close, and the dump file."""
    from srdd_dump import DumpConfig, register_hook

    out = tempfile.mkdtemp(dir=workdir)
    cfg = DumpConfig(dump_path=out, samples=len(ids_list), progress=False, **config)
    t = time.perf_counter()
    session = register_hook(model, cfg)
    for ids in ids_list:
        model(input_ids=ids)
    path = session.close()
    return time.perf_counter() - t, path


def capture_and_scan(name: str, model, args, workdir: str) -> dict:
    """Plain forward, capture-only (probes none) and the default scan, interleaved."""
    import torch
    from _models import prompts

    from srdd_dump import DumpConfig

    ids = prompts(model, args.tokens, 1)[0]
    reps = args.repeats
    res: dict = {"tokens": args.tokens, "layers": len(model.model.layers)}
    with torch.no_grad():
        for _ in range(2):
            model(input_ids=ids)
        # capture only: the hooks are installed around every other forward of one session
        plain, captured, res["capture_bytes_per_sample"] = capture_only(model, ids, reps,
                                                                        workdir)
        # default scan (DumpConfig's probes), batched, store sample:32768
        scan = []
        scan_bytes = 0
        for _ in range(max(2, reps // 2)):
            plain.append(_forward(model, ids))
            elapsed, path = scan_session(model, [ids], workdir)
            scan.append(elapsed)
            scan_bytes = os.path.getsize(path)
            shutil.rmtree(os.path.dirname(path))
        layers_t = layer_time(model, ids, max(3, reps // 2))
    # each captured forward against the plain forward just before it: drifts of this shared
    # VM (10% between minutes) cancel in the pair
    paired = median([cf / pf for pf, cf in zip(plain, captured)])
    p, c, sc = median(plain), median(captured), median(scan)
    cfg = DumpConfig()
    replays = 1 + len(cfg.sigmas) * cfg.draws + len(cfg.dc) + cfg.repeats
    ideal = p + replays * layers_t
    n_layers = res["layers"]
    first = 11 * n_layers * p
    res.update({
        "plain_s": p, "plain_min_s": min(plain), "capture_s": c, "capture_ratio": paired,
        "capture_over_median_plain": c / p,
        "layers_s": layers_t, "scan_s": sc, "scan_forwards": sc / p, "replays": replays,
        "ideal_s": ideal, "ideal_forwards": ideal / p, "scan_over_ideal": sc / ideal,
        "upper_ideal_forwards": 1 + replays, "first_srdd_estimate_s": first,
        "first_over_scan": first / sc, "scan_bytes_per_sample": scan_bytes,
        "loadavg": loadavg(),
    })
    target(f"{name}: capture-only / plain forward", paired, 1.15, "<=", "x")
    target(f"{name}: default scan / ideal (forward + {replays} layer passes)", sc / ideal, 2.0,
           "<=", "x")
    target(f"{name}: first SRDD estimate / default scan", first / sc, 20.0, ">=", "x")
    return res


def section_capture(args, workdir: str) -> None:
    import torch
    from _models import MODELS, build

    torch.set_num_threads(os.cpu_count() or 1)
    out = {}
    for name in MODELS if not args.quick else ("smollm2",):
        t = time.perf_counter()
        model = build(name)
        build_s = time.perf_counter() - t
        params = sum(p.numel() for p in model.parameters())
        out[name] = capture_and_scan(name, model, args, workdir)
        out[name].update({"build_s": build_s, "params": params})
        del model
    RESULTS["capture"] = out
    rows = []
    for name, r in out.items():
        rows.append([name, f"{r['params'] / 1e6:.0f} M", r["layers"], r["tokens"],
                     f"{r['plain_s'] * 1e3:.1f} ms", f"{r['capture_ratio']:.3f}x",
                     f"{r['capture_bytes_per_sample'] / 1e6:.2f} MB"])
    table("Capture only (probes none) vs a plain forward",
          ["model", "params", "layers", "tokens", "plain forward", "capture-only", "bytes/sample"],
          rows)
    rows = []
    for name, r in out.items():
        rows.append([name, f"{r['scan_forwards']:.2f}", f"{r['ideal_forwards']:.2f}",
                     f"{r['scan_over_ideal']:.2f}x", f"{r['layers_s'] / r['plain_s']:.2f}",
                     f"{r['first_srdd_estimate_s']:.1f} s", f"{r['first_over_scan']:.0f}x",
                     f"{r['scan_bytes_per_sample'] / 1e6:.1f} MB"])
    table("Default scan (gain 2x2 + dc 1 + repeat 3 = 9 layer passes + reference) in forward "
          "equivalents", ["model", "scan", "ideal", "scan/ideal", "layers share of forward",
                          "first SRDD (estimate)", "first SRDD / scan", "bytes/sample"], rows)


def section_scaling(args, workdir: str) -> None:
    """Scan cost vs layers (SmolLM2 truncated), tokens and samples."""
    import torch
    from _models import build, prompts, restore, truncate

    torch.set_num_threads(os.cpu_count() or 1)
    model = build("smollm2")
    reps = 3 if not args.quick else 1
    out: dict = {"layers": [], "tokens": [], "samples": []}
    with torch.no_grad():
        ids = prompts(model, args.tokens, 1)[0]
        for _ in range(2):
            model(input_ids=ids)
        for n in ((8, 16, 30) if not args.quick else (8, 30)):
            saved = truncate(model, n)
            try:
                plain, scan = [], []
                for _ in range(reps):
                    plain.append(_forward(model, ids))
                    elapsed, path = scan_session(model, [ids], workdir)
                    scan.append(elapsed)
                    shutil.rmtree(os.path.dirname(path))
                p, s = median(plain), median(scan)
                out["layers"].append({"layers": n, "plain_s": p, "scan_s": s,
                                      "scan_forwards": s / p, "first_over_scan": 11 * n * p / s})
            finally:
                restore(model, saved)
        for tokens in ((32, 128, 512) if not args.quick else (32, 128)):
            ids_t = prompts(model, tokens, 1)[0]
            model(input_ids=ids_t)
            plain, captured, cap_size = capture_only(model, ids_t, 2 * reps + 1, workdir)
            scan, size = [], 0
            for _ in range(reps):
                plain.append(_forward(model, ids_t))
                elapsed, path = scan_session(model, [ids_t], workdir)
                scan.append(elapsed)
                size = os.path.getsize(path)
                shutil.rmtree(os.path.dirname(path))
            p = median(plain)
            out["tokens"].append({"tokens": tokens, "plain_s": p,
                                  "capture_ratio": median(captured) / p,
                                  "scan_s": median(scan), "scan_forwards": median(scan) / p,
                                  "capture_bytes": cap_size, "scan_bytes": size})
        p = median([_forward(model, ids) for _ in range(reps)])
        for n in ((1, 4, 16) if not args.quick else (1, 4)):
            elapsed, path = scan_session(model, prompts(model, args.tokens, n, seed=1), workdir)
            size = os.path.getsize(path)
            shutil.rmtree(os.path.dirname(path))
            out["samples"].append({"samples": n, "total_s": elapsed, "per_sample_s": elapsed / n,
                                   "per_sample_forwards": elapsed / n / p, "bytes": size})
    RESULTS["scaling"] = out
    table("Scan cost vs layers (SmolLM2 truncated, 121 tokens)",
          ["layers", "plain forward", "scan", "scan (forwards)", "first SRDD / scan"],
          [[r["layers"], f"{r['plain_s'] * 1e3:.1f} ms", f"{r['scan_s'] * 1e3:.0f} ms",
            f"{r['scan_forwards']:.2f}", f"{r['first_over_scan']:.0f}x"] for r in out["layers"]])
    table("Cost vs tokens (SmolLM2, 30 layers; scan: one-sample sessions, writer close "
          "included)", ["tokens", "plain forward", "capture-only", "scan (forwards)",
                        "capture bytes", "scan bytes"],
          [[r["tokens"], f"{r['plain_s'] * 1e3:.1f} ms", f"{r['capture_ratio']:.3f}x",
            f"{r['scan_forwards']:.2f}", f"{r['capture_bytes'] / 1e6:.1f} MB",
            f"{r['scan_bytes'] / 1e6:.1f} MB"] for r in out["tokens"]])
    table("Scan cost vs samples (one session, SmolLM2, 121 tokens)",
          ["samples", "total", "per sample", "per sample (forwards)", "dump"],
          [[r["samples"], f"{r['total_s']:.2f} s", f"{r['per_sample_s'] * 1e3:.0f} ms",
            f"{r['per_sample_forwards']:.2f}", f"{r['bytes'] / 1e6:.0f} MB"]
           for r in out["samples"]])


# -- dump: bytes, writer vs disk, store, compression -------------------------------------------


def dd_write(path: str, nbytes: int, sync: bool) -> float:
    count = max(1, nbytes // (8 << 20))
    cmd = ["dd", "if=/dev/zero", f"of={path}", "bs=8M", f"count={count}"]
    if sync:
        cmd.append("conv=fdatasync")
    t = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    elapsed = time.perf_counter() - t
    os.remove(path)
    return count * (8 << 20) / elapsed


def synthetic_round(sample: int, rng, layers: int = 30, tokens: int = 121, width: int = 576,
                    probe_rows: int = 57):
    """A round shaped like a SmolLM2 default-scan round (31 clean records + 9 probe records per
    layer), random float32 values."""
    import numpy as np

    from srdd_dump.format import schema as s
    from srdd_dump.format.writer import Round, Tensor

    r = Round(sample=sample, step=0, batch=1, seq=tokens, positions=np.arange(tokens),
              token_ids=np.zeros((1, tokens), np.int64),
              probe_rows=np.arange(probe_rows))
    for layer in range(-1, layers):
        r.tensors.append(Tensor(layer, rng.standard_normal((1, tokens, width), np.float32),
                                "float32"))
        if layer < 0:
            continue
        kinds = [s.KIND_REPLAY] + [s.KIND_GAIN] * 4 + [s.KIND_DC] + [s.KIND_REPEAT] * 3
        for i, kind in enumerate(kinds):
            r.tensors.append(Tensor(layer, rng.standard_normal((1, probe_rows, width),
                                                               np.float32), "float32",
                                    kind=kind, probe=i, pert_rms=1.0, subset=True))
    return r


def section_dump(args, workdir: str) -> None:
    import h5py
    import numpy as np

    from srdd_dump.format.writer import DumpWriter

    out: dict = {}
    # writer throughput: rounds handed over as capture does, the writer thread does the I/O;
    # alternated with dd writing the same bytes, best of two of each
    rng = np.random.default_rng(0)
    rounds = [synthetic_round(i, rng) for i in range(4)]
    per_round = sum(t.array.nbytes for t in rounds[0].tensors)
    target_bytes = (1 if not args.quick else 0.2) * GB
    n = max(4, int(target_bytes // per_round))
    best = {"to_page_cache_mb_s": 0.0, "with_fsync_mb_s": 0.0}
    dd = {"to_page_cache_mb_s": 0.0, "fdatasync_mb_s": 0.0}
    size = 0
    for _ in range(2):
        path = os.path.join(workdir, "writer_test.h5")
        t = time.perf_counter()
        w = DumpWriter(path, {"bench": True}, [f"model.layers.{i}" for i in range(30)])
        for i in range(n):
            r = rounds[i % len(rounds)]
            r.sample = i
            w.submit(r)
        w.close()
        cached = time.perf_counter() - t
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        synced = time.perf_counter() - t
        size = os.path.getsize(path)
        os.remove(path)
        best["to_page_cache_mb_s"] = max(best["to_page_cache_mb_s"], size / cached / 1e6)
        best["with_fsync_mb_s"] = max(best["with_fsync_mb_s"], size / synced / 1e6)
        ddfile = os.path.join(workdir, "dd.bin")
        dd["to_page_cache_mb_s"] = max(dd["to_page_cache_mb_s"],
                                       dd_write(ddfile, size, False) / 1e6)
        dd["fdatasync_mb_s"] = max(dd["fdatasync_mb_s"], dd_write(ddfile, size, True) / 1e6)
    out["writer"] = {"bytes": size, "rounds": n, **best}
    out["dd"] = {"bytes": size, **dd}
    # store: full vs sample:N (SmolLM2 default scan)
    import torch
    from _models import build, prompts

    model = build("smollm2")
    ids = prompts(model, args.tokens, 1)[0]
    store_rows = []
    with torch.no_grad():
        model(input_ids=ids)
        for store in ("full", "sample:32768", "sample:8192"):
            times, plain, size = [], [], 0
            for _ in range(3 if not args.quick else 1):
                plain.append(_forward(model, ids))
                elapsed, path = scan_session(model, [ids], workdir, store=store)
                times.append(elapsed)
                size = os.path.getsize(path)
                shutil.rmtree(os.path.dirname(path))
            store_rows.append({"store": store, "bytes_per_sample": size,
                               "scan_forwards": median(times) / median(plain)})
    out["store"] = store_rows
    del model
    # compression of real hidden states: the clean data of a real dump rewritten with h5py
    src = RESULTS.get("_scan_dump")
    comp_rows = []
    if src and os.path.exists(src):
        with h5py.File(src, "r") as f:
            ds = f["data"]["clean_float32_576"]
            rows = min(ds.shape[0], int((256e6 if not args.quick else 32e6) // (576 * 4)))
            data = ds[:rows]
        options = [("none", {}), ("lzf", {"compression": "lzf"}),
                   ("gzip-1", {"compression": "gzip", "compression_opts": 1}),
                   ("gzip-1 + shuffle", {"compression": "gzip", "compression_opts": 1,
                                         "shuffle": True})]
        try:
            import hdf5plugin

            options.append(("lz4 (hdf5plugin)", dict(hdf5plugin.LZ4())))
            options.append(("blosc lz4 + shuffle (hdf5plugin)",
                            dict(hdf5plugin.Blosc(cname="lz4", clevel=5,
                                                  shuffle=hdf5plugin.Blosc.SHUFFLE))))
        except ImportError:
            pass
        for label, opts in options:
            path = os.path.join(workdir, "comp.h5")
            t = time.perf_counter()
            with h5py.File(path, "w") as f:
                d = f.create_dataset("x", shape=data.shape, dtype=data.dtype,
                                     chunks=(227, 576), **opts)
                for a in range(0, data.shape[0], 3751):
                    d[a:a + 3751] = data[a:a + 3751]
            write = time.perf_counter() - t
            size = os.path.getsize(path)
            t = time.perf_counter()
            with h5py.File(path, "r") as f:
                d = f["x"]
                for a in range(0, data.shape[0], 3751):
                    d[a:a + 3751]
            read = time.perf_counter() - t
            os.remove(path)
            comp_rows.append({"option": label, "ratio": data.nbytes / size,
                              "write_mb_s": data.nbytes / write / 1e6,
                              "read_mb_s": data.nbytes / read / 1e6})
    out["compression"] = comp_rows
    RESULTS["dump"] = out
    wr, dd = out["writer"], out["dd"]
    table("Writer throughput vs the raw disk (same bytes, same run)",
          ["what", "to page cache", "with fsync / fdatasync"],
          [[f"srdd-dump writer ({wr['rounds']} SmolLM2-shaped scan rounds, "
            f"{wr['bytes'] / 1e9:.2f} GB)", f"{wr['to_page_cache_mb_s']:.0f} MB/s",
            f"{wr['with_fsync_mb_s']:.0f} MB/s"],
           ["dd if=/dev/zero bs=8M", f"{dd['to_page_cache_mb_s']:.0f} MB/s",
            f"{dd['fdatasync_mb_s']:.0f} MB/s"]])
    table("--store (SmolLM2 default scan, 121 tokens)", ["--store", "bytes/sample",
                                                         "scan (forwards)"],
          [[r["store"], f"{r['bytes_per_sample'] / 1e6:.1f} MB", f"{r['scan_forwards']:.2f}"]
           for r in store_rows])
    if comp_rows:
        table("Compression of real hidden states (clean float32 data of a SmolLM2 dump, "
              "h5py, 1 thread)", ["option", "size ratio", "write", "read"],
              [[r["option"], f"{r['ratio']:.3f}", f"{r['write_mb_s']:.0f} MB/s",
                f"{r['read_mb_s']:.0f} MB/s"] for r in comp_rows])


# -- compare -----------------------------------------------------------------------------------


def make_scan_dump(folder: str, samples: int, tokens: int, **config) -> str:
    import torch
    from _models import build, prompts

    model = build("smollm2")
    os.makedirs(folder, exist_ok=True)
    with torch.no_grad():
        elapsed, path = scan_session(model, prompts(model, tokens, samples, seed=2), folder,
                                     **config)
    final = os.path.join(folder, os.path.basename(path))
    os.replace(path, final)
    shutil.rmtree(os.path.dirname(path))
    return final


def replicate(src: str, dst: str, min_bytes: float) -> str:
    """A dump of at least ``min_bytes`` made of the real rounds of ``src`` written again (new
    sample numbers) with the DumpWriter."""
    import h5py

    from srdd_dump.format.reader import DumpReader
    from srdd_dump.format.writer import DumpWriter, Round, Tensor

    os.makedirs(dst, exist_ok=True)
    path = os.path.join(dst, "srdd_rank0_pid1.h5")
    with DumpReader(src) as r, h5py.File(src, "r") as raw:
        data = [(raw["data"][n], raw["data"][n].attrs["dtype"]) for n in sorted(raw["data"])]
        w = DumpWriter(path, r.meta, r.layers, r.sites)
        passes = max(1, math.ceil(min_bytes / os.path.getsize(src)))
        sample = 0
        for _ in range(passes):
            for row in r.rounds:
                recs = r.records[r.records["round"] == row["round"]]
                rnd = Round(sample=sample, step=int(row["step"]), batch=int(row["batch"]),
                            seq=int(row["seq"]), positions=r.positions(row),
                            token_ids=r.token_ids(row).reshape(int(row["batch"]), -1),
                            probe_rows=r.probe_rows(row) if row["prow_len"] else None)
                for rec in recs:
                    ds, dtype = data[int(rec["data"])]
                    stored = ds[int(rec["row0"]): int(rec["row0"]) + int(rec["nrows"])]
                    rnd.tensors.append(Tensor(
                        int(rec["layer"]), stored.reshape(int(rec["batch"]), int(rec["ntok"]),
                                                          int(rec["width"])),
                        str(dtype), kind=int(rec["kind"]), site=int(rec["site"]),
                        probe=int(rec["probe"]), param=float(rec["param"]),
                        seed=int(rec["seed"]), pert_rms=float(rec["pert_rms"]),
                        subset=bool(rec["subset"])))
                w.submit(rnd)
                sample += 1
        w.close({"samples": sample})
    return path


def compare_child(args) -> None:
    """In a child process: run one compare and print its time as JSON (imports excluded)."""
    spec = json.loads(args.run_compare)
    import resource
    import time as _t

    from srdd_dump.runtime.memory import keep_freed_memory

    keep_freed_memory()  # as the srdd-compare entry point does

    cpu0 = _t.process_time()
    if spec["mode"] == "reference-free":
        from srdd_dump.compare import compare_path
        from srdd_dump.report import write_report

        t = _t.perf_counter()
        result = compare_path(spec["dumps"], progress=False, jobs=spec["jobs"])
        if spec.get("output"):
            write_report(result, spec["output"])
        rows = len(result.layers)
    else:
        from srdd_dump.compare import compare_baseline
        from srdd_dump.report import write_report

        t = _t.perf_counter()
        result = compare_baseline(spec["dumps"], spec["baseline"], jobs=spec["jobs"],
                                  progress=False)
        if spec.get("output"):
            write_report(result, spec["output"])
        rows = len(result.table)
    elapsed = _t.perf_counter() - t
    workers = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = _t.process_time() - cpu0 + workers.ru_utime + workers.ru_stime
    print(json.dumps({"seconds": elapsed, "cpu_s": cpu, "rows": rows}))


def run_compare(mode: str, dumps: str, jobs: int, workdir: str, baseline: str | None = None,
                cold: bool = False, label: str = "", tries: int = 1) -> dict:
    """One compare in a child process (``tries`` > 1: the fastest of that many runs, against
    other work on the machine); MB/s over the dump bytes, CPU seconds of all its processes."""
    size = dump_bytes(dumps) + (dump_bytes(baseline) if baseline else 0)
    best = None
    for _ in range(tries):
        for p in (dumps, baseline):
            if p:
                drop_cache(p) if cold else warm_cache(p)
        load = loadavg()
        spec = {"mode": mode, "dumps": dumps, "baseline": baseline, "jobs": jobs,
                "output": os.path.join(workdir, f"report_{mode}_{jobs}.csv")}
        r = run_measured([sys.executable, __file__, "--run-compare", json.dumps(spec)])
        if r.get("returncode") != 0:
            raise RuntimeError(f"compare failed: {r.get('stderr')}")
        r["loadavg_before"] = load
        if best is None or r["seconds"] < best["seconds"]:
            best = r
    best.update({"mode": mode, "dump": label, "jobs": jobs, "cold": cold, "bytes": size,
                 "tries": tries, "mb_per_s": size / best["seconds"] / 1e6,
                 "mb_per_cpu_s": size / best["cpu_s"] / 1e6,
                 "mb_per_s_whole_process": size / best["wall_s"] / 1e6})
    return best


def read_limits(path: str) -> dict:
    """Physical limits of reading ``path``: h5py plain loop over every data set in 4 MB reads,
    and a raw sequential read, from the page cache and cold (evicted with fadvise)."""
    import h5py

    out = {}
    size = os.path.getsize(path)
    for cold in (False, True):
        drop_cache(path) if cold else warm_cache(path)
        t = time.perf_counter()
        total = 0
        with h5py.File(path, "r") as f:
            for name in f["data"]:
                ds = f["data"][name]
                rows = max(1, (4 << 20) // (ds.shape[1] * ds.dtype.itemsize))
                for a in range(0, ds.shape[0], rows):
                    total += ds[a:a + rows].nbytes
        out[f"h5py_{'cold' if cold else 'warm'}_mb_s"] = total / (time.perf_counter() - t) / 1e6
        drop_cache(path) if cold else warm_cache(path)
        t = time.perf_counter()
        with open(path, "rb", buffering=0) as fh:
            while fh.read(16 << 20):
                pass
        out[f"raw_{'cold' if cold else 'warm'}_mb_s"] = size / (time.perf_counter() - t) / 1e6
    return out


def section_compare(args, workdir: str) -> None:
    out: dict = {}
    data = os.path.join(workdir, "data")
    os.makedirs(data, exist_ok=True)
    scale = 1.0 if not args.quick else 0.05
    per_scan = RESULTS.get("capture", {}).get("smollm2", {}).get("scan_bytes_per_sample", 45.8e6)
    per_cap = RESULTS.get("capture", {}).get("smollm2", {}).get("capture_bytes_per_sample",
                                                                8.66e6)
    # 1. a >= 2 GB default-scan dump of SmolLM2, every sample captured for real
    scan_dir = os.path.join(data, "scan2g")
    n_scan = math.ceil(2.0 * GB * scale / per_scan) + 1
    t = time.perf_counter()
    if not (args.keep and os.path.isdir(scan_dir) and dump_bytes(scan_dir) >= 2 * GB * scale):
        shutil.rmtree(scan_dir, ignore_errors=True)
        make_scan_dump(scan_dir, n_scan, args.tokens)
    scan_file = [os.path.join(scan_dir, f) for f in os.listdir(scan_dir)][0]
    RESULTS["_scan_dump"] = scan_file
    out["scan_dump"] = {"bytes": dump_bytes(scan_dir), "samples": n_scan,
                        "make_s": time.perf_counter() - t}
    # 2. >= 5 GB: the real rounds of (1) written again by the writer
    big_dir = os.path.join(data, "big5g")
    if not (args.keep and os.path.isdir(big_dir) and dump_bytes(big_dir) >= 5 * GB * scale):
        shutil.rmtree(big_dir, ignore_errors=True)
        replicate(scan_file, big_dir, 5 * GB * scale)
    out["big_dump"] = {"bytes": dump_bytes(big_dir)}
    # 3. baseline pair: capture-only dumps of the same prompts, golden vs a noisy layer 10
    base = {}
    n_cap = math.ceil(2.0 * GB * scale / per_cap) + 1
    for role, config in (("golden", {}), ("mine", {"inject": ["noise@layer=10,m=0.01"]})):
        d = os.path.join(data, f"base_{role}")
        if not (args.keep and os.path.isdir(d) and dump_bytes(d) >= 2 * GB * scale):
            shutil.rmtree(d, ignore_errors=True)
            make_scan_dump(d, n_cap, args.tokens, probes="none", **config)
        base[role] = d
    out["baseline_dumps"] = {k: dump_bytes(v) for k, v in base.items()}
    out["baseline_samples"] = n_cap
    runs = []
    tries = 1 if args.quick else 2
    for jobs in (1, 2):
        runs.append(run_compare("reference-free", scan_dir, jobs, workdir, label="scan",
                                tries=tries))
    runs.append(run_compare("reference-free", scan_dir, 2, workdir, cold=True, label="scan"))
    for jobs in (1, 2):
        runs.append(run_compare("reference-free", big_dir, jobs, workdir, label="large"))
    for jobs in (1, 2):
        runs.append(run_compare("baseline", base["mine"], jobs, workdir, base["golden"],
                                label="baseline pair", tries=tries))
    runs.append(run_compare("baseline", base["mine"], 2, workdir, base["golden"], cold=True,
                            label="baseline pair"))
    # the whole command as a user runs it
    cli = os.path.join(os.path.dirname(sys.executable), "srdd-compare")
    if os.path.exists(cli):
        for jobs in (2,):
            warm_cache(scan_dir)
            r = run_measured([cli, scan_dir, "-o", os.path.join(workdir, "cli.csv"), "-q",
                              "-j", str(jobs)])
            runs.append({"mode": "reference-free (srdd-compare command)", "jobs": jobs,
                         "dump": "scan", "cold": False, "bytes": dump_bytes(scan_dir),
                         "mb_per_s_whole_process": dump_bytes(scan_dir) / r["wall_s"] / 1e6,
                         **r})
    out["runs"] = runs
    out["limits"] = read_limits(scan_file)
    RESULTS["compare"] = out
    for r in runs:
        if r["mode"] in ("reference-free", "baseline") and r["jobs"] == 2 and not r["cold"] \
                and r["dump"] in ("scan", "baseline pair"):
            target(f"compare {r['mode']} -j 2, {r['bytes'] / GB:.1f} GB of dump (page cache)",
                   r["mb_per_s"] / 1e3, 1.0, ">=", "GB/s")
        if r["dump"] == "large" and r["mode"] == "reference-free":
            target(f"peak RSS, reference-free compare -j {r['jobs']} of a "
                   f"{r['bytes'] / GB:.1f} GB dump (all processes)", r["peak_rss_tree"] / GB,
                   1.0, "<=", "GB")
    table("Dumps used", ["dump", "size", "how"],
          [["default scan, SmolLM2", f"{out['scan_dump']['bytes'] / GB:.2f} GB",
            f"{n_scan} real samples of {args.tokens} tokens"],
           ["large", f"{out['big_dump']['bytes'] / GB:.2f} GB",
            "the rounds of the scan dump written again by the writer"],
           ["baseline golden / mine", f"{out['baseline_dumps']['golden'] / GB:.2f} / "
            f"{out['baseline_dumps']['mine'] / GB:.2f} GB",
            f"capture only, {n_cap} samples; mine with noise@layer=10,m=0.01"]])
    table("Compare throughput (MB of dump read per second; baseline counts both sides)",
          ["mode", "jobs", "cache", "dump", "compare call", "per CPU second", "whole process",
           "peak RSS (all processes)", "largest process", "load before"],
          [[r["mode"], r["jobs"], "cold" if r["cold"] else "page cache",
            f"{r['dump']} {r['bytes'] / GB:.2f} GB",
            f"{r['mb_per_s']:.0f} MB/s" if "mb_per_s" in r else "n/a",
            f"{r['mb_per_cpu_s']:.0f} MB/s" if "mb_per_cpu_s" in r else "n/a",
            f"{r['mb_per_s_whole_process']:.0f} MB/s",
            f"{r['peak_rss_tree'] / 1e6:.0f} MB", f"{r['max_rss_one'] / 1e6:.0f} MB",
            f"{r.get('loadavg_before', float('nan')):.2f}"]
           for r in runs])
    lim = out["limits"]
    table("Reading the same scan dump without computing anything (one process)",
          ["reader", "page cache", "cold"],
          [["h5py, every data set in 4 MB reads", f"{lim['h5py_warm_mb_s']:.0f} MB/s",
            f"{lim['h5py_cold_mb_s']:.0f} MB/s"],
           ["raw sequential read of the file", f"{lim['raw_warm_mb_s']:.0f} MB/s",
            f"{lim['raw_cold_mb_s']:.0f} MB/s"]])


# -- msprobe -----------------------------------------------------------------------------------


def msprobe_python(args) -> str | None:
    if args.msprobe_python and os.path.exists(args.msprobe_python):
        return args.msprobe_python
    try:
        import msprobe  # noqa: F401

        return sys.executable
    except ImportError:
        return None


def section_msprobe(args, workdir: str) -> None:
    py = msprobe_python(args)
    out: dict = {}
    if py is None:
        out["error"] = ("msprobe is not installed: pip install mindstudio-probe into a separate "
                        "environment and pass --msprobe-python")
        RESULTS["msprobe"] = out
        say(f"\nmsprobe: {out['error']}")
        return
    script = os.path.join(HERE, "msprobe_bench.py")
    runs = []
    models = ("smollm2", "qwen05") if not args.quick else ("smollm2",)
    for model in models:
        for mode in ("output", "all"):
            d = os.path.join(workdir, f"msprobe_{model}_{mode}")
            shutil.rmtree(d, ignore_errors=True)
            r = run_measured([py, script, "dump", "--model", model, "--tokens", str(args.tokens),
                              "--repeats", str(args.repeats if model == "smollm2" else 3),
                              "--data-mode", mode, "--out", d])
            r.pop("stderr", None) if r.get("returncode") == 0 else None
            runs.append(r)
            shutil.rmtree(d, ignore_errors=True)
    out["dump"] = runs
    # msprobe compare on its own dumps of the same prompts (golden vs noise at layer 10), and
    # srdd-compare --baseline on srdd-dump captures of the same prompts
    n = 16 if not args.quick else 2
    dirs = {}
    for role, inject in (("golden", None), ("mine", "noise@layer=10,m=0.01")):
        d = os.path.join(workdir, f"msprobe_cmp_{role}")
        shutil.rmtree(d, ignore_errors=True)
        cmd = [py, script, "dump", "--model", "smollm2", "--tokens", str(args.tokens),
               "--samples", str(n), "--out", d]
        if inject:
            cmd += ["--inject", inject]
        run_measured(cmd)
        dirs[role] = d
    cmp_out = os.path.join(workdir, "msprobe_cmp_out")
    shutil.rmtree(cmp_out, ignore_errors=True)
    for d in dirs.values():
        warm_cache(d)
    mc = run_measured([py, script, "compare", "--target", dirs["mine"], "--golden",
                       dirs["golden"], "--out", cmp_out])
    out["compare"] = mc
    srdd = {}
    for role, config in (("golden", {}), ("mine", {"inject": ["noise@layer=10,m=0.01"]})):
        d = os.path.join(workdir, f"srdd_cmp_{role}")
        shutil.rmtree(d, ignore_errors=True)
        make_scan_dump(d, n, args.tokens, probes="none", **config)
        srdd[role] = d
    ours = [run_compare("baseline", srdd["mine"], j, workdir, srdd["golden"]) for j in (1, 2)]
    out["srdd_same_prompts"] = ours
    RESULTS["msprobe"] = out
    cap = RESULTS.get("capture", {})
    rows = []
    for r in runs:
        if r.get("returncode") != 0:
            rows.append([r.get("model", "?"), r.get("data_mode", "?"), "failed", "", "", "", ""])
            continue
        ours_ratio = cap.get(r["model"], {}).get("capture_ratio", float("nan"))
        ours_bytes = cap.get(r["model"], {}).get("capture_bytes_per_sample", float("nan"))
        rows.append([r["model"], r["data_mode"], f"{r['ratio']:.2f}x", f"{ours_ratio:.3f}x",
                     f"{r['bytes_per_forward'] / 1e6:.1f} MB", f"{ours_bytes / 1e6:.1f} MB",
                     f"{r['files_per_forward']:.0f}"])
    table("msprobe tensor dump (L0, list DecoderLayer) vs srdd-dump capture only, per forward",
          ["model", "msprobe data_mode", "msprobe / plain", "srdd-dump / plain",
           "msprobe bytes", "srdd-dump bytes", "msprobe files (srdd-dump: 1 per process)"],
          rows)
    if mc.get("returncode") == 0:
        table(f"Compare of {n} prompts, golden vs noise at layer 10 (MB of both dumps per "
              "second, page cache)", ["tool", "dump bytes", "time", "throughput"],
              [["msprobe compare (one call per step, in one process)",
                f"{mc['bytes'] / 1e6:.0f} MB", f"{mc['seconds']:.1f} s",
                f"{mc['mb_per_s']:.1f} MB/s"]]
              + [[f"srdd-compare --baseline -j {r['jobs']}", f"{r['bytes'] / 1e6:.0f} MB",
                  f"{r['seconds']:.2f} s", f"{r['mb_per_s']:.0f} MB/s"] for r in ours])


# -- main --------------------------------------------------------------------------------------


SECTIONS = ("capture", "scaling", "dump", "compare", "msprobe")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke test, not figures")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--tokens", type=int, default=121)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--workdir", default=None, help="where dumps go (default: a temp folder)")
    ap.add_argument("--keep", action="store_true", help="keep and reuse the compare dumps")
    ap.add_argument("--msprobe-python", default="/tmp/msprobe-venv/bin/python")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "perf.json"))
    ap.add_argument("--run-compare", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run_compare:
        compare_child(args)
        return
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    workdir = args.workdir or tempfile.mkdtemp(prefix="srdd_perf_")
    os.makedirs(workdir, exist_ok=True)
    t0 = time.perf_counter()
    say(f"# srdd-dump performance ({time.strftime('%Y-%m-%d %H:%M')}, "
        f"{'quick' if args.quick else 'full'} run)\n\nCommand: python bench/perf.py "
        + " ".join(a for a in sys.argv[1:]))
    machine()
    try:
        if "capture" in sections:
            section_capture(args, workdir)
        if "scaling" in sections:
            section_scaling(args, workdir)
        if "compare" in sections:
            section_compare(args, workdir)
        if "dump" in sections:
            section_dump(args, workdir)
        if "msprobe" in sections:
            section_msprobe(args, workdir)
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    RESULTS["targets"] = TARGETS
    RESULTS["elapsed_s"] = time.perf_counter() - t0
    RESULTS["loadavg_at_end"] = loadavg()
    RESULTS.pop("_scan_dump", None)
    table("Targets (issue 6)", ["target", "measured", "limit", "met"],
          [[t["target"], f"{t['value']:.3g} {t['unit']}", f"{t['op']} {t['limit']:g} {t['unit']}",
            "yes" if t["met"] else "**no**"] for t in TARGETS])
    say(f"\nTotal {RESULTS['elapsed_s'] / 60:.1f} min; load average at the end "
        f"{RESULTS['loadavg_at_end']:.2f}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(RESULTS, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
