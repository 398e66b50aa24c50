"""Scan cost and dump size per layer on the shapes of Qwen2.5-0.5B, 1.5B and 7B, measured, for the
projection to 7B and 70B runs (issue 29): random-weight bf16 models of each shape with a few
decoder layers, plain and under capture, in one process, interleaved, medians.

    python bench/projection.py                       # the full run (about 20 min on 2 cores)
    python bench/projection.py --quick               # a smoke test (one shape, short prompts)
    python bench/projection.py --shapes 0.5b 7b --tokens 64 256 --repeats 3 --layers 7b=2
    python bench/projection.py --device cuda --threads 16 ...   # the layers on a GPU (the
                                                              # float64 references on the host)

What one *sample* is: a prompt of TOKENS random token ids (batch 1) and greedy decoding of 8
tokens as explicit forwards with a KV cache (what ``model.generate(max_new_tokens=8,
do_sample=False)`` runs): the prefill (step 0) and decode steps 1 to 7. The default scan captures
steps 0, 1, 2 and 7 of 8 samples and probes steps 0 and 1 of the first ``probe_samples``
(srdd_dump/capture/config.py: 1). Each captured configuration here is one session of 2 samples
with ``probe_samples=1``: sample 0 is a probed sample, sample 1 an unprobed one; every other
option is the default. A default run of 8 samples is then ``probe_samples`` probed samples and
the rest unprobed (``--probed N`` composes another count, e.g. 4 as before issue 29).

Configurations (each timed per forward, the session's close timed apart):

- ``plain``: no capture; the decoder stack is timed by two hooks (the first layer's pre-hook,
  the last layer's hook), which gives the plain time per layer.
- ``default``: ``DumpConfig()`` (``--store sample:32768``).
- ``stats``: ``--store stats``.
- ``tp8-rank``: the default options as one rank of a tensor-parallel run does them: modules
  holding a weight matrix (blocks, attention, MLP) are not replayed, as ``--tp-replays skip``
  does for modules with distributed parameters (capture/parallel.py); the norms still are. It
  runs on the whole (unsharded) layer: what a rank records and replays is full width at the
  default granularity, only the rank's own compute is 1/8.
- ``tp8-rank stats``: the same with ``--store stats``.
- ``no references`` (only when named in ``--configs``): the default without the float64
  references of the attention, MLP and norms (``probes="gain,dc,repeat,scale,causal"``): the
  share of the scan that runs on the host in float64.
- ``full`` (``--full-size``): ``--store full``, for its dump size (timed once, not repeated).

Dump sizes are read from the written files: every record's bytes by sample, layer and kind,
and the file sizes.

Writes bench/results/projection_issue29.json (``--out``) with the machine (CPU model, cores,
versions, ``uptime`` before and after).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

DEVICE = "cpu"  # where the layers run (--device); timings wait for the device's queue


def sync() -> None:
    """Wait for the device's queued work (a GPU's forward returns before it is done)."""
    if DEVICE != "cpu":
        import torch

        getattr(torch, DEVICE.split(":")[0]).synchronize(DEVICE)

# The shapes of the models' config.json (Qwen2.5-0.5B, -1.5B, -7B); "layers" is the real depth.
SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                 num_key_value_heads=2, head_dim=64, vocab_size=151936, rope_theta=1000000.0,
                 rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=True,
                 layers=24),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                 num_key_value_heads=2, head_dim=128, vocab_size=151936, rope_theta=1000000.0,
                 rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=True,
                 layers=28),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
               num_key_value_heads=4, head_dim=128, vocab_size=152064, rope_theta=1000000.0,
               rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False,
               layers=28),
}
# layers built per shape, and the vocabulary used (the 7B shape's 152064 x 3584 embedding and
# untied head would be 2.2 GB of bf16 for nothing the per-layer figures use)
LAYERS = {"0.5b": 4, "1.5b": 4, "7b": 2}
VOCAB = {"7b": 32768}
TOKENS = {"0.5b": [64, 256, 1024], "1.5b": [64, 256, 1024], "7b": [64, 256]}
NEW_TOKENS = 8  # steps 0..7: the default --steps 0-2,7 and --probe-steps 0,1 all occur
CONFIGS = ("plain", "default", "stats", "tp8-rank", "tp8-rank stats", "no references")
DEFAULT_CONFIGS = CONFIGS[1:5]


def machine() -> dict:
    cpu = "unknown"
    with open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = 0
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) * 1024
    import h5py
    import torch
    import transformers

    accelerator = torch.cuda.get_device_name(DEVICE) if DEVICE.startswith("cuda") else DEVICE
    return {"cpu": cpu, "device": DEVICE, "accelerator": accelerator, "cores": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)), "mem_bytes": mem,
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "h5py": h5py.__version__,
            "torch_threads": torch.get_num_threads(), "platform": platform.platform()}


def git_state() -> dict:
    """The commit measured, and srdd_dump's uncommitted changes (others edit it meanwhile)."""
    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], capture_output=True, text=True,
                                  cwd=os.path.join(HERE, "..")).stdout.strip()
        except OSError:
            return ""

    return {"head": git("rev-parse", "HEAD"),
            "srdd_dump_changes": git("status", "--short", "--", "srdd_dump")}


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        with open("/proc/loadavg") as fh:
            return fh.read().strip()


class Tee(io.TextIOBase):
    """stderr as it is, and a copy of it (the capture's notes and warnings)."""

    def __init__(self, target):
        self.target, self.lines = target, []

    def write(self, text: str) -> int:
        self.lines.append(text)
        return self.target.write(text)

    def flush(self) -> None:
        self.target.flush()


def build(shape: str, layers: int):
    import torch
    import transformers as tf

    cfg = {k: v for k, v in SHAPES[shape].items() if k != "layers"}
    cfg["vocab_size"] = VOCAB.get(shape, cfg["vocab_size"])
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # initialised in bf16: half the memory
    try:
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**cfg, num_hidden_layers=layers))
    finally:
        torch.set_default_dtype(old)
    return model.to(torch.bfloat16).to(DEVICE).eval(), cfg


class StackTimer:
    """The decoder stack's time of each forward: first layer's pre-hook to last layer's hook."""

    def __init__(self, model):
        layers = model.model.layers
        self.times: list[float] = []
        self.cpu: list[float] = []
        self._t0 = self._c0 = 0.0
        self.handles = [layers[0].register_forward_pre_hook(self._start),
                        layers[-1].register_forward_hook(self._stop)]

    def _start(self, *_):
        sync()
        self._t0, self._c0 = time.perf_counter(), time.thread_time()

    def _stop(self, *_):
        sync()
        self.times.append(time.perf_counter() - self._t0)
        self.cpu.append(time.thread_time() - self._c0)

    def remove(self):
        for h in self.handles:
            h.remove()


def cache_keyword() -> str:
    """The forward's KV-cache keyword: ``cache`` in newer transformers 5 releases,
    ``past_key_values`` before (an older release takes ``cache=`` as an unknown keyword and
    runs every step without the past: the decode steps then see one token and no cache)."""
    import inspect

    import transformers as tf

    return ("cache" if "cache" in inspect.signature(tf.Qwen2ForCausalLM.forward).parameters
            else "past_key_values")


CACHE_KEYWORD = "past_key_values"  # set in main()


def run_sample(model, ids, new_tokens: int) -> tuple[list[float], list[float]]:
    """Greedy decoding as generate() runs it: the prefill, then new_tokens - 1 decode steps;
    the wall time and the main thread's CPU time of each forward (torch runs on the main
    thread alone with --threads 1; the dump writer's thread is not in it)."""
    import torch
    from transformers import DynamicCache

    times, cpu = [], []
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        mask = torch.ones_like(ids)
        x = ids
        for _ in range(new_tokens):
            sync()
            t, c = time.perf_counter(), time.thread_time()
            out = model(input_ids=x, attention_mask=mask, **{CACHE_KEYWORD: cache},
                        use_cache=True, logits_to_keep=1)
            x = out.logits[:, -1].argmax(-1, keepdim=True)
            sync()
            times.append(time.perf_counter() - t)
            cpu.append(time.thread_time() - c)
            mask = torch.cat([mask, torch.ones_like(x)], dim=1)
    return times, cpu


@contextlib.contextmanager
def tp_rank_emulation():
    """--tp-replays skip as a tensor-parallel rank applies it: a module holding a weight matrix
    (what tp_plan shards: blocks, attention, MLP) is neither replayed nor host-replayed."""
    from srdd_dump.capture import parallel

    cls = parallel.TensorParallel
    saved = cls.may_replay, cls.may_host_replay

    def holds_matrix(module) -> bool:
        return any(p.dim() >= 2 for p in module.parameters())

    def may_replay(self, module):
        if holds_matrix(module):
            self.replays_skipped += 1
            return False
        return True

    def may_host_replay(self, module):
        if holds_matrix(module):
            self.host_replays_skipped += 1
            return False
        return True

    cls.may_replay, cls.may_host_replay = may_replay, may_host_replay
    try:
        yield
    finally:
        cls.may_replay, cls.may_host_replay = saved


def dump_sizes(folder: str) -> dict:
    """Bytes of the dump file(s) under folder, and the payload by (sample, layer part, kind)."""
    import h5py
    import numpy as np

    files = [os.path.join(r, n) for r, _, ns in os.walk(folder) for n in ns]
    out = {"files": len(files), "file_bytes": sum(os.path.getsize(f) for f in files),
           "names": [os.path.basename(f) for f in files]}
    by: dict[str, int] = {}
    counts: dict[str, int] = {}

    def add(key: str, nbytes: int) -> None:
        by[key] = by.get(key, 0) + int(nbytes)
        counts[key] = counts.get(key, 0) + 1

    for path in files:
        if not path.endswith(".h5"):
            continue
        with h5py.File(path, "r") as f:
            out["complete"] = int(f.attrs.get("complete", -1))
            out["status"] = json.loads(f.attrs.get("status", "{}"))
            sites = [s.decode() if isinstance(s, bytes) else str(s) for s in f["sites"][()]]
            rounds = f["rounds"][()]
            sample_of = {int(r["round"]): int(r["sample"]) for r in rounds}
            step_of = {int(r["round"]): int(r["step"]) for r in rounds}
            out["rounds"] = [[int(r["sample"]), int(r["step"]), int(r["seq"]), int(r["ntok"]),
                              int(r["prow_len"])] for r in rounds]
            names = sorted(f["data"].keys())
            item = [f["data"][n].dtype.itemsize for n in names]
            recs = f["records"][()]
            for r in recs:
                nbytes = int(r["nrows"]) * int(r["width"]) * item[int(r["data"])]
                part = "layer" if r["layer"] >= 0 else "model"
                site = int(r["site"])
                where = "block" if site < 0 else ("norm" if "norm" in sites[site] else "sublayer")
                kind = "clean" if r["kind"] == 0 else "probe"
                phase = "prefill" if step_of[int(r["round"])] == 0 else "decode"
                add(f"s{sample_of[int(r['round'])]}/{part}/{phase}/{kind}/{where}", nbytes)
            if "stats" in f:
                index = f["stats/index"][()]
                row = f["stats/values"].shape[1] * 8 + index.dtype.itemsize
                for r in index:
                    part = "layer" if r["layer"] >= 0 else "model"
                    phase = "prefill" if step_of[int(r["round"])] == 0 else "decode"
                    add(f"s{sample_of[int(r['round'])]}/{part}/{phase}/stats/all", row)
            out["index_bytes"] = sum(int(f[n].id.get_storage_size()) for n in
                                     ("rounds", "records", "token_ids", "positions",
                                      "probe_rows") if n in f)
            out["data_storage_bytes"] = int(sum(f["data"][n].id.get_storage_size()
                                                for n in names))
            out["widths"] = sorted({int(w) for w in np.unique(recs["width"])}) if len(recs) else []
    out["payload"] = dict(sorted(by.items()))
    out["payload_records"] = dict(sorted(counts.items()))
    return out


def measure(shape: str, layers: int, tokens: list[int], repeats: int, configs: list[str],
            full_size: bool, log) -> dict:
    import torch

    from srdd_dump import DumpConfig, register_hook

    t = time.perf_counter()
    model, cfg = build(shape, layers)
    build_s = time.perf_counter() - t
    params = sum(p.numel() for p in model.model.layers.parameters())
    log(f"== {shape}: {layers} layers built in {build_s:.1f} s, {params / 1e6:.1f} M layer "
        f"parameters (vocabulary {cfg['vocab_size']})")
    options = {"default": {}, "stats": {"store": "stats"}, "tp8-rank": {},
               "tp8-rank stats": {"store": "stats"}, "full": {"store": "full"},
               "no references": {"probes": "gain,dc,repeat,scale,causal"}}
    result = {"shape": shape, "layers_run": layers, "layers_real": SHAPES[shape]["layers"],
              "config": cfg, "layer_params": params, "build_s": build_s, "tokens": {}}
    for n in tokens:
        g = torch.Generator().manual_seed(n)
        prompts = [torch.randint(0, cfg["vocab_size"], (1, n), generator=g).to(DEVICE)
                   for _ in range(2)]
        timer = StackTimer(model)
        run_sample(model, prompts[0], NEW_TOKENS)  # warm-up
        timer.times.clear()
        timer.remove()
        rows: dict[str, list[dict]] = {c: [] for c in configs}
        sizes: dict[str, dict] = {}
        notes: dict[str, list[str]] = {}
        order = list(configs)
        for rep in range(repeats):
            for name in order:
                gc.collect()
                row = {"repeat": rep}
                if name == "plain":
                    timer = StackTimer(model)
                    cpu = time.process_time()
                    got = [run_sample(model, p, NEW_TOKENS) for p in prompts]
                    row["cpu_s"] = time.process_time() - cpu
                    row["samples"] = [w for w, _ in got]
                    row["samples_cpu"] = [c for _, c in got]
                    k = NEW_TOKENS
                    row["stack"] = [timer.times[i * k:(i + 1) * k] for i in range(len(prompts))]
                    row["stack_cpu"] = [timer.cpu[i * k:(i + 1) * k] for i in range(len(prompts))]
                    timer.remove()
                    row["close_s"] = 0.0
                else:
                    row.update(captured(model, prompts, options[name], name, sizes, notes,
                                        rep == 0, register_hook, DumpConfig))
                rows[name].append(row)
                s = row["samples"]
                log(f"{shape} {n:5d} tok  rep {rep}  {name:14s} prefill {s[0][0]:7.3f} / "
                    f"{s[1][0]:7.3f} s, decode {sum(s[0][1:]):6.3f} / {sum(s[1][1:]):6.3f} s, "
                    f"close {row['close_s']:5.2f} s")
            order = order[1:] + order[:1]  # rotate: no configuration always runs first
        if full_size:
            row = captured(model, prompts, options["full"], "full", sizes, notes, True,
                           register_hook, DumpConfig)
            rows["full"] = [row]
            log(f"{shape} {n:5d} tok  full store (size run): "
                f"{sizes['full']['file_bytes'] / 1e6:.1f} MB")
        result["tokens"][str(n)] = {"rows": rows, "sizes": sizes, "notes": notes,
                                    "summary": summarize(rows, sizes, layers)}
        print_summary(shape, n, layers, result["tokens"][str(n)]["summary"], log)
    del model
    gc.collect()
    return result


def captured(model, prompts, options: dict, name: str, sizes: dict, notes: dict, keep: bool,
             register_hook, DumpConfig) -> dict:
    tmp = tempfile.mkdtemp(prefix="srdd-projection-")
    tee = Tee(sys.stderr)
    emulate = tp_rank_emulation() if name.startswith("tp8") else contextlib.nullcontext()
    try:
        with contextlib.redirect_stderr(tee), emulate:
            cpu = time.process_time()
            session = register_hook(model, DumpConfig(dump_path=tmp, samples=len(prompts),
                                                      probe_samples=1, progress=False,
                                                      **options))
            with session:
                got = [run_sample(model, p, NEW_TOKENS) for p in prompts]
                t = time.perf_counter()
            close_s = time.perf_counter() - t
            cpu_s = time.process_time() - cpu
        text = "".join(line for line in "".join(tee.lines).splitlines(keepends=True)
                       if not line.startswith("srdd-dump: wrote ")).strip()
        if text:
            notes.setdefault(name, [])
            if text not in notes[name]:
                notes[name].append(text)
        if keep:
            sizes[name] = dump_sizes(tmp)
        return {"samples": [w for w, _ in got], "samples_cpu": [c for _, c in got],
                "close_s": close_s, "cpu_s": cpu_s}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


PROBED = 1  # probed samples of a default run of 8 (DumpConfig.probe_samples; --probed)


def timing(rows: dict, layers: int, clock: str) -> dict:
    """Medians over repeats, per layer, on one clock ("wall" or "cpu": the main thread's CPU
    time): plain time, capture overhead and ratio for a probed sample's prefill and decode
    steps and for an unprobed sample."""
    med = statistics.median
    key, stack = ("samples", "stack") if clock == "wall" else ("samples_cpu", "stack_cpu")
    plain = rows["plain"]
    out: dict = {}
    # plain per layer, from the stack timer (the embedding, final norm and head left out)
    p_prefill = med(r[stack][0][0] for r in plain) / layers
    p_decode = med(med(r[stack][0][1:]) for r in plain) / layers
    p_sample = p_prefill + (NEW_TOKENS - 1) * p_decode
    out["plain_layer_prefill_s"] = p_prefill
    out["plain_layer_decode_step_s"] = p_decode
    out["plain_forward_prefill_s"] = med(r[key][0][0] for r in plain)
    out["plain_sample_s"] = med(sum(r[key][0]) for r in plain)
    steps = {"prefill": [0], "probed decode (1, 7)": [1, 7], "captured decode (2)": [2],
             "uncaptured decode (3-6)": [3, 4, 5, 6]}
    for name, rs in rows.items():
        if name in ("plain", "full"):
            continue
        c: dict = {}
        for sample, label in ((0, "probed"), (1, "unprobed")):
            for what, idx in steps.items():
                # against the plain run of the same repeat (interleaved): its forwards
                over = [(sum(r[key][sample][i] for i in idx) - sum(q[key][sample][i] for i in idx))
                        / len(idx) / layers for r, q in zip(rs, plain)]
                base = p_prefill if what == "prefill" else p_decode
                c[f"{label} {what}"] = {"overhead_layer_s": med(over),
                                        "x_plain_layer": (base + med(over)) / base}
            # the whole sample (8 forwards), per layer: plain stack time + overhead
            over = [(sum(r[key][sample]) - sum(q[key][sample])) / layers
                    for r, q in zip(rs, plain)]
            c[f"{label} sample"] = {"overhead_layer_s": med(over),
                                    "x_plain_layer": (p_sample + med(over)) / p_sample}
        close = med(r["close_s"] for r in rs) / layers if clock == "wall" else 0.0
        run = (PROBED * c["probed sample"]["overhead_layer_s"]
               + (8 - PROBED) * c["unprobed sample"]["overhead_layer_s"] + close)
        c["default run of 8 samples"] = {"overhead_layer_s": run / 8,
                                         "x_plain_layer": (8 * p_sample + run) / (8 * p_sample),
                                         "close_layer_s": close}
        out[name] = c
    return out


def summarize(rows: dict, sizes: dict, layers: int) -> dict:
    """Timings on both clocks, and bytes per layer per sample of every store measured."""
    out: dict = {"wall": timing(rows, layers, "wall"), "cpu": timing(rows, layers, "cpu")}
    for name, s in sizes.items():
        pay = s["payload"]
        per: dict = {}
        for sample, label in ((0, "probed"), (1, "unprobed")):
            lay = {k: v for k, v in pay.items() if k.startswith(f"s{sample}/layer/")}
            per[f"{label} sample, bytes per layer"] = sum(lay.values()) / layers
            for kind in ("clean", "probe", "stats"):
                per[f"{label} sample, {kind} bytes per layer"] = sum(
                    v for k, v in lay.items() if f"/{kind}/" in k) / layers
            per[f"{label} sample, model-level bytes"] = sum(
                v for k, v in pay.items() if k.startswith(f"s{sample}/model/"))
        payload = sum(pay.values())
        per["file_bytes"] = s["file_bytes"]
        per["payload_bytes"] = payload
        per["file_over_payload"] = s["file_bytes"] / payload if payload else None
        out[f"size {name}"] = per
    return out


def print_summary(shape: str, n: int, layers: int, s: dict, log) -> None:
    for clock in ("cpu", "wall"):
        t = s[clock]
        log(f"-- {shape}, {n} tokens, {layers} layers, {clock} clock: plain per layer prefill "
            f"{t['plain_layer_prefill_s'] * 1e3:.1f} ms, decode step "
            f"{t['plain_layer_decode_step_s'] * 1e3:.2f} ms")
        for name in CONFIGS[1:]:
            if name not in t:
                continue
            c = t[name]
            log(f"   {name:14s} probed prefill x{c['probed prefill']['x_plain_layer']:.2f}, "
                f"probed decode x{c['probed probed decode (1, 7)']['x_plain_layer']:.2f}, "
                f"unprobed prefill x{c['unprobed prefill']['x_plain_layer']:.2f}, "
                f"probed sample x{c['probed sample']['x_plain_layer']:.2f}, unprobed sample "
                f"x{c['unprobed sample']['x_plain_layer']:.2f}, run of 8 "
                f"x{c['default run of 8 samples']['x_plain_layer']:.2f}")
    for name in ("default", "stats", "tp8-rank", "tp8-rank stats", "no references", "full"):
        z = s.get(f"size {name}")
        if z:
            log(f"   size {name:14s} probed sample {z['probed sample, bytes per layer'] / 1e6:8.3f}"
                f" MB/layer, unprobed {z['unprobed sample, bytes per layer'] / 1e6:8.3f} "
                f"MB/layer; file {z['file_bytes'] / 1e6:.2f} MB "
                f"(x{z['file_over_payload'] or 0:.3f} the payload)")


# The projection's targets: (name, hidden width, layers, query heads, KV heads, parameters of
# one layer). Qwen2.5-7B's config.json; Llama-3-70B's: hidden 8192, intermediate 28672, 64 heads,
# 8 KV heads, 80 layers.
def layer_params(hidden: int, inter: int, heads: int, kv: int, head_dim: int,
                 bias: bool) -> int:
    attn = hidden * heads * head_dim * 2 + hidden * kv * head_dim * 2
    if bias:
        attn += heads * head_dim + 2 * kv * head_dim
    return attn + 3 * hidden * inter + 2 * hidden


TARGETS = {
    # 28 query heads: TP-8 cannot split them; 8 cards run it as 2 replicas of TP-4
    "7B (Qwen2.5-7B)": dict(width=3584, layers=28, heads=28, kv=4, tp=4,
                            cards="8 as 2 x TP-4",
                            params=layer_params(3584, 18944, 28, 4, 128, True)),
    "70B (Llama-3-70B)": dict(width=8192, layers=80, heads=64, kv=8, tp=8, cards="8, TP-8",
                              params=layer_params(8192, 28672, 64, 8, 128, False)),
}
PROBE_ELEMENTS = 32768  # the default --store sample:32768
DECODE_ROUNDS = 3  # captured decode steps per sample (1, 2, 7)


def kept_rows(store: str, tokens: int) -> int:
    """Prefill rows of each clean record of a layer: every token, or the stats store's 2."""
    return min(tokens, 2) if "stats" in store else tokens


def probe_rows(store: str, tokens: int, width: int) -> int:
    """Prefill rows of each probe record: every row (full), about 32768 elements' worth of
    rows (the default sample:32768), none (stats: reduced, no records)."""
    if "stats" in store:
        return 0
    if store == "full":
        return tokens
    return min(tokens, -(-PROBE_ELEMENTS // width))


def coefficients(entry: dict, store: str, width: int, tokens: int, layers: int) -> dict:
    """A store's record structure per layer and per sample, in rows of ``width`` bf16 values
    (independent of the width and the prompt length): read from one measured file."""
    size = entry["sizes"][store]
    pay = size["payload"]
    prow = next(r[4] for r in size["rounds"] if r[0] == 0 and r[1] == 0)
    row = width * 2

    def part(sample: int, where: str, phase: str, kind: str) -> float:
        prefix = f"s{sample}/{where}/{phase}/{kind}/"
        return sum(v for k, v in pay.items() if k.startswith(prefix)) / (
            layers if where == "layer" else 1)

    co = {}
    for where in ("layer", "model"):
        co[where] = {
            "clean_pre": part(1, where, "prefill", "clean") / row / kept_rows(store, tokens),
            "clean_dec": part(1, where, "decode", "clean") / row,
            "probe_pre": part(0, where, "prefill", "probe") / row / prow if prow else 0.0,
            "probe_dec": part(0, where, "decode", "probe") / row,
            "stats_probed": sum(part(0, where, ph, "stats") for ph in ("prefill", "decode")),
            "stats": sum(part(1, where, ph, "stats") for ph in ("prefill", "decode")),
        }
    return co


def predict(co: dict, store: str, width: int, tokens: int, layers: int) -> dict:
    """Bytes of a probed and of an unprobed sample: per layer and for the whole model."""
    row = width * 2
    out = {}
    for where in ("layer", "model"):
        c = co[where]
        clean = row * (c["clean_pre"] * kept_rows(store, tokens) + c["clean_dec"])
        probe = row * (c["probe_pre"] * probe_rows(store, tokens, width) + c["probe_dec"])
        out[where] = {"probed": clean + probe + c["stats_probed"],
                      "unprobed": clean + c["stats"]}
    return {k: {"per_layer": out["layer"][k],
                "sample": layers * out["layer"][k] + out["model"][k]}
            for k in ("probed", "unprobed")}


def project(data: dict, base: str = "7b") -> str:
    """The projection tables (markdown) from a measurement: dump sizes by exact arithmetic on
    the measured record structure, time ratios from the measured per-layer ratios."""
    lines: list[str] = []
    shapes = {e["shape"]: e for e in data["shapes"]}
    if base not in shapes:
        base = list(shapes)[-1]
    ref = shapes[base]
    stores = ("default", "stats", "full", "tp8-rank", "tp8-rank stats")
    # the structure read from the base shape's longest prompt; checked on every measured file
    t_ref = max(int(t) for t in ref["tokens"])
    entry = ref["tokens"][str(t_ref)]
    width = ref["config"]["hidden_size"]
    cos = {st: coefficients(entry, st, width, t_ref, ref["layers_run"])
           for st in stores if st in entry["sizes"]}
    worst = 0.0
    for e in data["shapes"]:
        for t, te in e["tokens"].items():
            for st, co in cos.items():
                if st not in te["sizes"]:
                    continue
                got = predict(co, st, e["config"]["hidden_size"], int(t), e["layers_run"])
                meas = te["summary"][f"size {st}"]
                for k in ("probed", "unprobed"):
                    m = meas[f"{k} sample, bytes per layer"]
                    worst = max(worst, abs(got[k]["per_layer"] - m) / m)
    lines.append(f"record structure from {base} at {t_ref} tokens; largest error of the size "
                 f"model on the measured files (every shape, length and store): {worst:.2%}")
    lines.append("")
    lines.append("| target | cards | prompt tokens | default store: probed sample, unprobed "
                 "sample, 8-sample run | stats store: a sample, 8-sample run | full store: "
                 "8-sample run | default scan, x plain | stats scan, x plain |")
    lines.append("|---|---|---|---|---|---|---|---|")
    b_width = ref["config"]["hidden_size"]
    b_params = ref["layer_params"] / ref["layers_run"]

    def mb(v: float) -> str:
        return f"{v / 1e9:,.2f} GB" if v >= 1e9 else f"{v / 1e6:,.1f} MB"

    for name, tg in TARGETS.items():
        tp = tg["tp"]
        for cards, stores in (("1", ("default", "stats", "full")),
                              (f"{tg['cards']}, per rank", ("tp8-rank", "tp8-rank stats"))):
            for t in (64, 256, 1024):
                cells, ratios = [], []
                for st in stores:
                    if st not in cos:
                        cells.append("-")
                        continue
                    got = predict(cos[st], st, tg["width"], t, tg["layers"])
                    run = (PROBED * got["probed"]["sample"]
                           + (8 - PROBED) * got["unprobed"]["sample"])
                    if "stats" in st:
                        cells.append(f"{mb(got['probed']['sample'])}, {mb(run)}")
                    elif st == "full":
                        cells.append(mb(run))
                    else:
                        cells.append(f"{mb(got['probed']['sample'])}, "
                                     f"{mb(got['unprobed']['sample'])}, **{mb(run)}**")
                    te = ref["tokens"].get(str(t))
                    if st == "full":
                        continue
                    if not te or st not in te["summary"]["cpu"]:
                        ratios.append("not measured")
                        continue
                    c = te["summary"]["cpu"]
                    if cards == "1":
                        x = c[st]["default run of 8 samples"]["x_plain_layer"]
                    else:
                        p = c["plain_layer_prefill_s"] + (NEW_TOKENS - 1) * c[
                            "plain_layer_decode_step_s"]
                        o = c[st]["default run of 8 samples"]["overhead_layer_s"]
                        # a rank computes 1/tp of the layer; its capture does what one card
                        # does minus the skipped replays (full-width records), scaled from the
                        # measured width and layer size to the target's
                        scale = (tg["width"] / b_width) / (tg["params"] / b_params)
                        x = 1 + tp * o / p * scale
                    ratios.append(f"{x:.2f}x" if x >= 1 else "1.00x (overhead measured <= 0)")
                if cards != "1":
                    cells.insert(2, "-")  # no full-store run of the rank
                lines.append(f"| {name} | {cards} | {t} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def measured_table(data: dict) -> str:
    """The measured table (markdown), main-thread CPU clock."""
    lines = ["| shape | layers run | tokens | plain per layer: prefill, decode step | "
             "default: probed prefill, probed decode step, unprobed sample, 8-sample run | "
             "stats: 8-sample run | TP rank emulated: 8-sample run (default, stats) | "
             "bytes per layer, probed sample: default / full / stats | unprobed sample: "
             "default / stats |", "|---|---|---|---|---|---|---|---|---|"]
    for e in data["shapes"]:
        for t, te in e["tokens"].items():
            s = te["summary"]
            c = s["cpu"]

            def x(name: str, what: str, c: dict = c) -> str:
                return f"{c[name][what]['x_plain_layer']:.2f}x" if name in c else "-"

            def mb(name: str, what: str, s: dict = s) -> str:
                z = s.get(f"size {name}")
                return f"{z[what] / 1e6:.3g} MB" if z else "-"

            lines.append(
                f"| {e['shape']} | {e['layers_run']} of {e['layers_real']} | {t} | "
                f"{c['plain_layer_prefill_s'] * 1e3:.1f} ms, "
                f"{c['plain_layer_decode_step_s'] * 1e3:.2f} ms | "
                f"{x('default', 'probed prefill')}, {x('default', 'probed probed decode (1, 7)')}, "
                f"{x('default', 'unprobed sample')}, **{x('default', 'default run of 8 samples')}**"
                f" | {x('stats', 'default run of 8 samples')} | "
                f"{x('tp8-rank', 'default run of 8 samples')}, "
                f"{x('tp8-rank stats', 'default run of 8 samples')} | "
                f"{mb('default', 'probed sample, bytes per layer')} / "
                f"{mb('full', 'probed sample, bytes per layer')} / "
                f"{mb('stats', 'probed sample, bytes per layer')} | "
                f"{mb('default', 'unprobed sample, bytes per layer')} / "
                f"{mb('stats', 'unprobed sample, bytes per layer')} |")
    return "\n".join(lines)


def main() -> None:
    global PROBED
    ap = argparse.ArgumentParser(description="Scan cost and dump size per layer, for the 7B "
                                 "and 70B projection (issue 29).",
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="*", type=int,
                    help="prompt lengths for every shape (default: 64 256 1024; 7b: 64 256)")
    ap.add_argument("--layers", nargs="*", default=[],
                    help="layers built per shape, e.g. 7b=2 0.5b=24 (default 0.5b=4 1.5b=4 7b=2)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", nargs="*", default=list(DEFAULT_CONFIGS),
                    choices=list(CONFIGS[1:]), help="captured configurations (plain always)")
    ap.add_argument("--no-full-size", dest="full_size", action="store_false",
                    help="skip the --store full size run")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--device", default="cpu", help="where the layers run: cpu, cuda, npu")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: 0.5b, 2 layers, 32 tokens, 1 repeat")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "projection_issue29.json"))
    ap.add_argument("--project", metavar="JSON",
                    help="measure nothing: print the tables and the projection of a result file "
                         "(its summaries recomputed from its raw rows)")
    ap.add_argument("--probed", type=int, default=PROBED,
                    help=f"probed samples of an 8-sample run (default {PROBED}, as DumpConfig)")
    args = ap.parse_args()
    PROBED = args.probed
    if args.project:
        with open(args.project) as fh:
            data = json.load(fh)
        for e in data["shapes"]:
            for te in e["tokens"].values():
                te["summary"] = summarize(te["rows"], te["sizes"], e["layers_run"])
        print(measured_table(data))
        print()
        print(project(data))
        return
    if args.quick:
        args.shapes, args.tokens, args.repeats = ["0.5b"], [32], 1
        args.layers = args.layers or ["0.5b=2"]
        if args.out == ap.get_default("out"):
            args.out = os.path.join(tempfile.gettempdir(), "projection_quick.json")
    layers = dict(LAYERS)
    for item in args.layers:
        k, _, v = item.partition("=")
        if k not in SHAPES or not v.isdigit():
            ap.error(f"bad --layers {item!r}: use e.g. 7b=2")
        layers[k] = int(v)
    import torch

    global DEVICE, CACHE_KEYWORD
    DEVICE = args.device
    CACHE_KEYWORD = cache_keyword()
    if DEVICE.startswith("npu"):
        import torch_npu  # noqa: F401  (registers the npu device)
    torch.set_num_threads(args.threads)
    started = time.time()
    lines: list[str] = []

    def log(text: str) -> None:
        lines.append(text)
        print(text, flush=True)

    result = {"command": " ".join(["python", "bench/projection.py", *sys.argv[1:]]),
              "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "machine": machine(), "git": git_state(), "uptime_before": uptime(),
              "new_tokens": NEW_TOKENS,
              "threads": args.threads, "repeats": args.repeats, "shapes": []}
    log(f"machine: {result['machine']}")
    log(f"uptime before: {result['uptime_before']}")
    for shape in args.shapes:
        tokens = args.tokens or TOKENS[shape]
        result["shapes"].append(measure(shape, layers[shape], tokens, args.repeats,
                                        ["plain", *args.configs], args.full_size, log))
        result["uptime_during"] = result.get("uptime_during", []) + [uptime()]
    result["uptime_after"] = uptime()
    result["wall_s"] = time.time() - started
    result["log"] = lines
    log(f"uptime after: {result['uptime_after']}; {result['wall_s'] / 60:.1f} min")
    log(measured_table(result))
    log(project(result))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
