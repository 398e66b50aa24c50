"""The in-code capture API: ``register_hook(model, DumpConfig(...))``.

One idea: a forward pre-hook on the first block opens a *round* (one forward of the model),
a forward hook on every block copies its output hidden state to the host, and the last block's
hook hands the finished round to the writer thread. Hooks only read; they never return a
value, so the user's program computes exactly what it computes without them.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import socket
import sys
import time
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np
import torch
from torch import nn

from ..format import schema
from ..format.coverage import Coverage
from ..format.writer import DumpWriter, Round, describe_error
from ..version import __version__
from ..vocabulary import BLOCK
from . import config as cfg
from . import serving
from .compiled import (
    EAGER_HINT,
    called_from_compiled,
    explain_partial,
    explain_silence,
    opaque,
    skip_hook_frames,
)
from .config import DumpConfig
from .discovery import (
    ATTENTION_NAMES,
    EXPERT,
    EXPERT_SLOTS,
    EXPERTS,
    LINEAR,
    MLP_NAMES,
    ROTARY,
    ROUTER,
    ROW_WISE,
    SUBLAYER,
    Site,
    find_blocks,
)
from .faults import install_faults
from .host import host_replay
from .identities import causal_cut, is_causal, scale_replays
from .model_facts import autocast_dtype, float32_matmul, has_past, input_embedding, sites_of
from .moe_capture import ExpertCapture
from .parallel import TensorParallel, env_rank, to_local
from .probes import (
    ProbeSpec,
    first_tensor,
    layer_index,
    module_output,
    other_kernels,
    outside_output_recording,
    preserved_rng,
    probe_seed,
    run_probes,
    snapshot_cache,
)
from .roles import INPUT, OUTPUT, PENDING, ROLE_CAPTURE, ROWS, WHOLE, role_capture
from .rounds import RoundContext
from .sinks import make_sink
from .tensors import kept
from .versions import loaded_version, untested_notes


def dump_file_name(dump_path: str) -> str:
    rank = env_rank()
    base = os.path.join(dump_path, f"srdd_rank{rank}_pid{os.getpid()}")
    path, n = base + schema.FILE_SUFFIX, 1
    while os.path.exists(path) or os.path.exists(path + schema.PARTIAL_SUFFIX):
        path, n = f"{base}_{n}{schema.FILE_SUFFIX}", n + 1
    return path


class CaptureSession:
    """Hooks on one model; a context manager that removes them and finalises the dump.

    ``path`` is the dump file (set when the first sample is captured); closing the session
    prints it on stderr, as srdd-dump does.
    """

    def __init__(self, model: nn.Module, config: DumpConfig):
        self.model = model
        self.config = config
        self.blocks = find_blocks(model, config.layers)
        self.layer_names = [name for name, _ in self.blocks]
        self.sites = sites_of(model, self.blocks, config)
        self.site_names = [site.name for site in self.sites]
        self.coverage = Coverage()  # which evidence was asked for and which was got
        self._levels = {-1: "block", **{i: evidence_level(site)
                                        for i, site in enumerate(self.sites)}}
        self._expect_sites(config.granularity)
        self._tp = TensorParallel(model, [m for _, m in self.blocks]
                                  + [site.module for site in self.sites], config.tp_replays)
        self.options = options = config.parsed()  # the text options, parsed once
        probes = options.probes
        self.probe_spec = ProbeSpec(
            sigmas=tuple(config.sigmas) if "gain" in probes else (),
            draws=config.draws,
            dc=tuple(config.dc) if "dc" in probes else (),
            repeats=config.repeats if "repeat" in probes else 0,
            batched=config.batch_probes,
            scale="scale" in probes,
            causal="causal" in probes,
        )
        self._host = config.reference == "host"
        self._probing = bool(probes) or self._host
        self._causal = {id(m): is_causal(m) for _, m in self.blocks}
        self._causal.update({id(site.module): is_causal(site.module) for site in self.sites})
        # a block or sub-block with fused experts is not held to bit-exact causality: a
        # grouped expert GEMM's rounding of a row depends on its place in its expert's group
        # (its attention still is)
        for site in self.sites:
            if site.role == EXPERTS:
                around = [self.blocks[site.layer][1]] + [
                    other.module for other in self.sites if other.layer == site.layer]
                for module in around:
                    if any(m is site.module for m in module.modules()):
                        self._causal[id(module)] = False
        # blocks of the (hidden_states, residual) convention; the inputs of modules that may
        # overwrite them (a fused add + norm), copied before they run (serving.py)
        self._serving = {id(m) for _, m in self.blocks if serving.is_serving_block(m)}
        self._fused = {id(m) for m in (*(b for _, b in self.blocks),
                                       *(site.module for site in self.sites))
                       if serving.fuses_residual(m)}
        self._frozen: dict[int, tuple[tuple, dict]] = {}
        self._pending: list[tuple[int, Site, torch.Tensor, tuple, dict]] = []
        self.host_replays = 0
        self.host_replays_failed = 0
        self.records_dropped = 0
        self.site_errors = 0
        self._store = options.store
        self._sink = make_sink(self._store, self.probe_spec, config.seed)
        self._moe = (ExpertCapture(self.sites, self._sink, self.probe_spec)
                     if any(s.role == EXPERTS for s in self.sites) else None)
        if self._moe is not None and len(self._moe.sites) < len(self._moe.modules):
            sys.stderr.write("srdd-dump: note: experts split over ranks (expert parallelism): "
                             "each MoE layer's experts are captured as their sum only\n")
        self.batched_replays = 0
        self.compiled_probes_dropped = 0
        self._compiled_round = False  # this round runs as torch.compile'd code
        self.decode_replays_skipped = 0
        self.degraded: list[str] = []  # coverage.shortfalls() at close
        self.version_notes = untested_notes()  # libraries outside the tested range
        if self.version_notes and not os.environ.get(cfg.ENV_CONFIG):
            for note in self.version_notes:  # under --exec the command says it once
                sys.stderr.write(f"srdd-dump: note: {note}\n")
        self.sequential_replays = 0
        self._replaying = False
        self._width = 0
        self._bar = None
        self._fault_handles, self.faults = install_faults(
            model, self.blocks, config.faults()
        )
        self._steps = options.steps
        self._probe_steps = options.probe_steps
        self._last_step = options.last_step
        self._tokens = options.tokens
        self.sample = -1
        self.step = 0
        self.error: str | None = None
        self.silence: str | None = None  # why nothing was captured (compiled.explain_silence)
        self.model_calls = 0  # forwards of the model and of its first block the hooks saw
        self.block_calls = 0
        self._fired: set[tuple[int, int]] = set()  # (layer, site) whose hook ran in a round
        self.path: str | None = None
        self.writer: DumpWriter | None = None
        self._ctx: RoundContext | None = None  # the round being captured
        self._token_ids: torch.Tensor | None = None
        self._attention_mask: torch.Tensor | None = None  # (batch, past + seq) of the model call
        # cache layer -> its KV cache before this decode step (one copy for the block and its
        # attention), and id(module) -> the cache layer it uses
        self._caches: dict[int, Any] = {}
        self._cache_layer: dict[int, int | None] = {}
        self._autocast: str | None = None  # "" when the first model call ran without autocast
        self._handles: list[Any] = []
        self._closed = False
        skip_hook_frames()
        self._install()
        atexit.register(self.close)

    def _expect_sites(self, granularity: str) -> None:
        """A granularity asked for that found no module to capture is evidence missing."""
        levels = {"sublayer": ("sub-layer sites", lambda s: s.role == SUBLAYER,
                               "no attention or MLP module found inside the blocks"),
                  "op": ("operator sites", lambda s: s.role in ROW_WISE,
                         "no linear, norm or activation module found inside the blocks")}
        wanted = ["sublayer"] + (["op"] if granularity == "op" else [])
        for level in wanted if granularity != "block" else []:
            family, is_level, why = levels[level]
            self.coverage.expect(family, len(self.blocks))
            found = {s.layer for s in self.sites if is_level(s)}
            for _ in found:
                self.coverage.ran(family)
            if not found:
                self.coverage.failed(family, why)

    @property
    def _round(self) -> Round | None:
        return self._ctx.round if self._ctx is not None else None

    @property
    def _positions(self) -> torch.Tensor | None:
        return self._ctx.positions if self._ctx is not None else None

    @property
    def _rows(self) -> torch.Tensor | None:
        return self._ctx.rows if self._ctx is not None else None

    # -- hooks ----------------------------------------------------------------------------
    def _install(self) -> None:
        self._handles.append(
            self.model.register_forward_pre_hook(self.on_model_call, with_kwargs=True))
        embed = input_embedding(self.model)
        if embed is not None:
            self._handles.append(embed.register_forward_pre_hook(self._on_embedding))
        first = self.blocks[0][1]
        self._handles.append(
            first.register_forward_pre_hook(self._on_stack_input, with_kwargs=True)
        )
        for index, (_, block) in enumerate(self.blocks):
            hook = self._output_hook(index, schema.BLOCK_SITE, index == len(self.blocks) - 1)
            self._handles.append(block.register_forward_hook(hook, with_kwargs=True))
            self._handles.append(
                block.register_forward_pre_hook(self._on_module_call, with_kwargs=True))
        for index, site in enumerate(self.sites):
            how = role_capture(site.role, site.name.startswith(
                self.layer_names[site.layer] + "."))
            module = site.module
            if how.hook == INPUT:  # the attention core: its output projection's input
                self._handles.append(module.register_forward_pre_hook(
                    self._input_hook(site.layer, index), with_kwargs=True))
            elif how.hook == PENDING:
                self._handles.append(module.register_forward_hook(
                    self._pending_hook(index), with_kwargs=True))
            elif how.hook == OUTPUT:
                hook = self._output_hook(site.layer, index, False)
                self._handles.append(module.register_forward_hook(hook, with_kwargs=True))
                if how.pre_call or id(module) in self._fused:
                    self._handles.append(module.register_forward_pre_hook(
                        self._on_module_call, with_kwargs=True))

    def _guard(self, fn, *args) -> None:
        if self._closed or self._replaying:
            return
        try:
            fn(*args)
        except Exception as exc:  # capture must never break the user's program
            self._fail(describe_error(exc))

    @opaque
    def _on_embedding(self, module: nn.Module, args: tuple) -> None:
        def grab() -> None:
            ids = args[0] if args else None
            if isinstance(ids, torch.Tensor) and not ids.is_floating_point():
                self._token_ids = ids

        self._guard(grab)

    @opaque
    def _on_module_call(self, module: nn.Module, args: tuple, kwargs: dict | None = None
                        ) -> None:
        """A decode step that will be probed: keep the layer's KV cache as it is before the
        call updates it, so the replays see what the device saw. (``kwargs`` is None when the
        session closed itself inside this very call: torch then calls the hook without.)"""
        if self._round is None or self._rows is None or kwargs is None:
            return
        if id(module) in self._fused:
            self._guard(self._freeze, module, args, kwargs)
        if self.step > 0:
            self._guard(self._snapshot, module, args, kwargs)

    def _freeze(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._frozen[id(module)] = serving.frozen_call(module, args, kwargs)

    def _snapshot(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        idx = self._layer_of(module)
        if idx is not None and idx not in self._caches:
            self._caches[idx] = snapshot_cache(idx, args, kwargs)

    def _layer_of(self, module: nn.Module) -> int | None:
        key = id(module)
        if key not in self._cache_layer:
            self._cache_layer[key] = layer_index(module)
        return self._cache_layer[key]

    @opaque
    def on_model_call(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """The model's own pre-hook (the forward watcher calls it for the call during which
        the session was made): counts the call, keeps its attention mask."""
        if not self._closed:
            self.model_calls += 1

        def grab() -> None:
            mask = kwargs.get("attention_mask")
            self._attention_mask = (
                mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None)
            if self._autocast is None:
                self._autocast = autocast_dtype(self.model)

        self._guard(grab)

    @opaque
    def _on_stack_input(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not (self._closed or self._replaying):
            self.block_calls += 1
        self._guard(self._open_round, module, args, kwargs)

    def _open_round(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if id(module) in self._serving:
            hidden = serving.stream_input(module, args, kwargs)
        else:
            hidden = first_tensor(args) if args else None
            if hidden is None:
                hidden = kwargs.get("hidden_states")
        token_ids, self._token_ids = self._token_ids, None
        self._compiled_round = called_from_compiled()
        self._ctx = None
        self._caches.clear()
        if self._moe is not None:
            self._moe.open_round()
        self._frozen.clear()
        if not isinstance(hidden, torch.Tensor):
            return
        hidden = self._tp.local(hidden, "stack input")
        self._width = int(hidden.shape[-1])
        batch = hidden.shape[0] if hidden.dim() >= 3 else 1
        seq = hidden.shape[-2] if hidden.dim() >= 2 else 1
        if seq > 1:
            self.sample += 1
            self.step = 0
        elif self.sample >= 0:
            self.step += 1
        if self.sample >= self.config.samples or (
            self.sample == self.config.samples - 1 and self.step > self._last_step
        ):
            self.close()  # everything asked for is captured: stop paying for hooks
            return
        if self.sample < 0 or not cfg.step_selected(self._steps, self.step):
            return
        positions = cfg.token_positions(self._tokens, seq)
        if not positions:
            return
        ids = None
        if token_ids is not None and token_ids.shape[-1] == seq:
            ids = token_ids.detach().to("cpu").reshape(batch, seq).numpy()
        keep = self._kept_rows(batch, seq, positions)
        probe_rows = self._choose_probe_rows(batch, len(positions), hidden.shape[-1], keep)
        self._ctx = RoundContext(
            round=Round(
                sample=self.sample, step=self.step, batch=batch, seq=seq,
                positions=np.asarray(positions), token_ids=ids, time=time.time(),
                probe_rows=self._sink.round_rows(probe_rows, keep, batch, len(positions),
                                                 self.sample, self.step),
            ),
            positions=(None if len(positions) == seq
                       else torch.tensor(positions, dtype=torch.long)),
            rows=None if probe_rows is None else torch.from_numpy(probe_rows.astype(np.int64)),
            seed=self.config.seed,
        )
        self._sink.open_round(self._ctx, keep)
        self._add(schema.STACK_INPUT, schema.BLOCK_SITE, hidden)
        self._finish_site(schema.STACK_INPUT, schema.BLOCK_SITE)
        self._add_pending()

    def _kept_rows(self, batch: int, seq: int, positions: list[int]) -> np.ndarray | None:
        """(batch, kept positions): False where the model call's 2-D attention mask excludes
        the row (padding); None when every kept row is attended."""
        mask, self._attention_mask = self._attention_mask, None
        if mask is None or mask.shape[0] != batch or mask.shape[-1] < seq:
            return None
        keep = (mask[:, -seq:].detach().to("cpu")[:, positions] != 0).numpy()
        return None if keep.all() else keep

    def _choose_probe_rows(self, batch: int, ntok: int, width: int,
                           keep: np.ndarray | None = None) -> np.ndarray | None:
        """Rows kept for the probe records of a prefill round (None: no probes this round):
        the first attended token of every sequence, where attention-sink tokens carry the
        largest activations (and range faults act first), and seeded-random other attended
        rows (``keep``: the attention mask's rows; padding is never chosen while attended rows
        are left). A decode step is probed whole (one token per sequence)."""
        if (not self._probing or self.sample >= self.config.probe_samples
                or not cfg.step_selected(self._probe_steps, self.step)):
            return None
        n_rows = batch * ntok
        if self._store.elements is None:
            return np.arange(n_rows)
        k = min(n_rows, -(-self._store.elements // max(1, width)))
        attended = np.ones(n_rows, dtype=bool) if keep is None else keep.reshape(-1)
        starts = np.arange(batch) * ntok
        offset = np.argmax(attended.reshape(batch, ntok), axis=1)  # first attended row
        first = (starts + offset)[attended.reshape(batch, ntok).any(axis=1)]
        rest = np.setdiff1d(np.arange(n_rows), first)
        rest = np.concatenate([rest[attended[rest]], rest[~attended[rest]]])  # padding last
        rng = np.random.default_rng(probe_seed(self.config.seed, self.sample, 0x5EED))
        n_extra = max(0, k - min(k, first.size))
        n_live = int(attended[rest].sum())
        live = rng.choice(rest[:n_live], size=min(n_extra, n_live), replace=False)
        pad = rest[n_live:][: n_extra - live.size]
        return np.sort(np.concatenate([first[:k], live, pad]))

    def _output_hook(self, layer: int, site: int, last: bool):
        @opaque
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self._round is None:
                return
            if not self._replaying:
                self._fired.add((layer, site))
            if site == schema.BLOCK_SITE:
                self._guard(self._on_output, module, layer, site, args, kwargs, output, last)
            else:
                self._guard(self._site_guarded, module, layer, site, args, kwargs, output)

        return hook

    def _site_guarded(self, module, layer, site, args, kwargs, output) -> None:
        """A sub-layer or operator: one that cannot be captured (an error in its replay, an
        output not shaped like the round's tokens) is skipped and counted; the blocks and
        the rest of the session go on."""
        try:
            self._on_output(module, layer, site, args, kwargs, output, False)
        except Exception:  # noqa: BLE001 (counted in the dump's status)
            self._replaying = False
            self.site_errors += 1

    def _input_hook(self, layer: int, site: int):
        @opaque
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self._round is not None:
                if not self._replaying:
                    self._fired.add((layer, site))
                self._guard(self._on_input, layer, site, args, kwargs)

        return hook

    def _on_input(self, layer: int, site: int, args: tuple, kwargs: dict) -> None:
        hidden = first_tensor(args) if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor):
            s = self.sites[site]
            hidden = self._tp.local(hidden, s.name, s.role, s.module, self._width)
            if self._ctx.token_shaped(hidden):
                self._add(layer, site, hidden)
                self._finish_site(layer, site)
            else:
                self.records_dropped += 1

    def _pending_hook(self, index: int):
        @opaque
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            def keep() -> None:
                out = to_local(first_tensor(output))
                if isinstance(out, torch.Tensor):
                    self._pending = [(index, self.sites[index], out, args, kwargs)]

            self._guard(keep)

        return hook

    def _add_pending(self) -> None:
        """Model-level operators that ran before the first block (a shared rotary embedding):
        their output, and with --reference host its float64 replay, over every kept row."""
        pending, self._pending = self._pending, []
        for index, site, out, args, kwargs in pending:
            shaped = self._round_shaped(out)
            if shaped is None:
                continue  # a table for other positions than this round's: not comparable
            self._add(site.layer, index, shaped)
            if self._host and self._rows is not None:
                self._host_record(site.module, site.layer, index, args, kwargs, None,
                                  rows=None)
            self._finish_site(site.layer, index)

    def _round_shaped(self, t: torch.Tensor) -> torch.Tensor | None:
        """A model-level table (batch 1 or the round's, the round's tokens) as the round's
        (batch, seq, width): a batch-1 table (position ids shared by the batch) is repeated, as
        every record of a round has its shape (docs/dump-format.md)."""
        r = self._round
        if t.dim() != 3 or t.shape[1] != r.seq or t.shape[0] not in (1, r.batch):
            return None
        return t.expand(r.batch, -1, -1) if t.shape[0] != r.batch else t

    def _on_output(self, module, layer, site, args, kwargs, output, last) -> None:
        hidden = module_output(module, output) if id(module) in self._serving \
            else first_tensor(output)
        args, kwargs = self._frozen.pop(id(module), (args, kwargs))
        if hidden is None:
            raise TypeError(f"{type(module).__name__} of layer {layer} returned no tensor")
        if site == schema.BLOCK_SITE:
            hidden = self._tp.local(hidden, self.layer_names[layer])
        else:
            s = self.sites[site]
            hidden = self._tp.local(hidden, s.name, s.role, s.module, self._width)
        role = self.sites[site].role if site >= 0 else BLOCK
        if role in (EXPERTS, ROUTER):
            if role == ROUTER and self._moe is not None:
                self._moe.router_output(module, hidden)
            hidden = self._ctx.as_round(hidden)
        if site != schema.BLOCK_SITE and not self._ctx.token_shaped(hidden):
            self.records_dropped += 1
            return
        self._add(layer, site, hidden)
        try:
            if self._rows is not None:
                with outside_output_recording():
                    self._probe(module, layer, site, args, kwargs, hidden)
        finally:
            self._finish_site(layer, site)
        if role == EXPERTS:
            spec = self.probe_spec
            probed = self._rows is not None and bool(spec.sigmas or spec.dc or spec.repeats)
            with (self.coverage.attempt(self._family(site, "probes")) if probed
                  else nullcontext()), outside_output_recording(), self._replays():
                self._moe.record(module, layer, site, args, kwargs, self._ctx)
        if site == schema.BLOCK_SITE and self.step == 0:
            self._progress()
        if last:
            self._submit()

    def _probe(self, module, layer, site, args, kwargs, hidden) -> None:
        if not self._tp.may_replay(module):
            return  # its replay could communicate (tensor parallel): parallel.py says why
        spec = self.probe_spec
        if not self._tp.batched(module):
            spec = dataclasses.replace(spec, batched=False)
        role = self.sites[site].role if site >= 0 else BLOCK
        replay = ROLE_CAPTURE[role].replay
        if replay == ROWS:
            self._probe_rows(module, layer, site, role, args, kwargs, hidden, spec)
            return
        if replay != WHOLE:
            # experts: each expert is probed on its own (moe_capture), the sum within its
            # MLP block
            return
        idx = self._layer_of(module) if self.step > 0 else None
        cache = self._caches.get(idx) if idx is not None else None
        cut = None
        if self.probe_spec.causal and self.step == 0 and self._causal.get(id(module)):
            cut = causal_cut(hidden.shape[-2] if hidden.dim() >= 2 else 1,
                             probe_seed(self.config.seed, self.sample, 0xCA05A1))
        families = [self._family(site, "probes")] if (
            spec.sigmas or spec.dc or spec.repeats or cut is not None) else []
        host = self._host and self._tp.may_host_replay(module)
        families += [self._family(site, "host replays")] if host else []
        if self.step > 0 and cache is None and has_past(args, kwargs):
            # a decode step whose past cannot be reproduced: no replay, clean data only
            self.decode_replays_skipped += 1
            for family in families:
                self.coverage.expect(family)
                self.coverage.failed(family, f"the KV cache of {type(module).__name__} could "
                                     "not be copied (a cache layout srdd-dump does not know)")
            return
        if families and families[0].endswith(" probes"):
            try:
                with self._replays(), self.coverage.attempt(families[0]), (
                        self._moe.pinned() if self._moe is not None else nullcontext()):
                    outputs, batched = run_probes(module, args, kwargs, hidden, spec,
                                                  self._ctx.seeds(layer, site), cache, cut,
                                                  stream=id(module) in self._serving)
            except Exception:
                if self.step == 0:
                    raise
                # a decode replay this module refuses (a cache layout not reproduced): its
                # clean data is kept, the step is not probed (and coverage says so)
                self.decode_replays_skipped += 1
                return
            if batched:
                self.batched_replays += 1
            else:
                self.sequential_replays += 1
            if self._keep_probes(module, outputs, hidden):
                self._sink.probe_outputs(self._ctx, layer, site, outputs,
                                         (self._positions, self._rows))
        if host:
            self._host_record(module, layer, site, args, kwargs, cache)

    @contextmanager
    def _replays(self):
        """The session's own hooks ignore the calls made inside (replays)."""
        self._replaying = True
        try:
            yield
        finally:
            self._replaying = False

    def _family(self, site: int, what: str) -> str:
        """The coverage family of a site's evidence in this round: "decode block probes",
        "prefill operator host replays"..."""
        return f"{'prefill' if self.step == 0 else 'decode'} {self._levels[site]} {what}"

    def _probe_rows(self, module, layer, site, role, args, kwargs, hidden, spec) -> None:
        """A row-wise operator (linear, norm, activation) is probed on the probe rows of its
        input alone: each output row depends on its input row only."""
        x = to_local(first_tensor(args) if args else kwargs.get("hidden_states"))
        if isinstance(x, torch.Tensor) and role == ROUTER:
            x = self._ctx.as_round(x)
        if not isinstance(x, torch.Tensor) or x.shape[:-1] != hidden.shape[:-1]:
            family = self._family(site, "probes")
            self.coverage.expect(family)
            self.coverage.failed(family, f"the input of {type(module).__name__} is not shaped "
                                 "like its output's tokens")
            return
        # a tensor-parallel module is replayed on its whole recorded input (an all-reduce's
        # rounding depends on the buffer's shape), the probe rows taken from its outputs
        rows = (self._positions, self._rows) if not self._tp.batched(module) else None
        x_rows = x if rows else kept(x, self._positions, self._rows)
        recorded = hidden if rows else kept(hidden, self._positions, self._rows)
        extra = {}
        residual, _ = serving.named_input(module, args, kwargs, serving.RESIDUAL)
        if residual is not None and residual.shape == x.shape:  # a fused add + norm
            extra[serving.RESIDUAL] = (residual if rows
                                       else kept(residual, self._positions, self._rows))
        with self._replays():
            if spec.sigmas or spec.dc or spec.repeats:
                with self.coverage.attempt(self._family(site, "probes")):
                    outputs, batched = run_probes(module, (x_rows,), extra, recorded, spec,
                                                  self._ctx.seeds(layer, site))
                if self._keep_probes(module, outputs, recorded):
                    self._sink.probe_outputs(self._ctx, layer, site, outputs, rows)
            if spec.scale and role == LINEAR:
                with torch.no_grad(), preserved_rng(x.device):
                    for k, y in scale_replays(module, x_rows):
                        y = kept(y, *rows) if rows else y
                        self._sink.probe(self._ctx, layer, site, y, schema.KIND_SCALE,
                                         probe=k, param=k)
        if self._host and self._tp.may_host_replay(module):
            self._host_record(module, layer, site, (x_rows,), extra, None, rows=None)

    def _keep_probes(self, module, outputs, recorded) -> bool:
        """In a round run as compiled code the replays run eagerly: a module's probe records
        are left out when its eager re-runs agree with each other but not with its recorded
        output (fused inductor kernels; the eager and aot_eager backends reproduce it): every
        comparison with the recorded output would measure the compiler, not the device.
        Re-runs that differ from each other are run-to-run noise, a finding: kept."""
        if not self._compiled_round or not other_kernels(outputs, recorded):
            return True
        if not self.compiled_probes_dropped:
            sys.stderr.write(
                f"srdd-dump: note: {type(module).__name__} runs as torch.compile'd code that an "
                "eager replay does not reproduce bit for bit: such modules are captured without "
                f"probes; for the probes {EAGER_HINT}\n")
        self.compiled_probes_dropped += 1
        return False

    def _host_record(self, module, layer, site, args, kwargs, cache, rows="round") -> None:
        """The float64 host replay of ``module`` on its recorded input, as a KIND_HOST record
        of the round's probe rows (``rows=None``: the input already holds only those rows, or
        a model-level operator whose every kept row is stored). A module the host cannot
        replay is counted, never fatal."""
        try:
            with self.coverage.attempt(self._family(site, "host replays")):
                out = host_replay(module, args, kwargs, cache)
        except Exception:  # noqa: BLE001 (a device-only module, a cache layout not known)
            self.host_replays_failed += 1
            return
        self.host_replays += 1
        site_role = self.sites[site].role if site >= 0 else BLOCK
        if rows == "round":
            out = kept(out, self._positions, self._rows)
            subset = True
        elif site_role == ROTARY:
            out = self._round_shaped(out)
            if out is None:
                return
            out, subset = kept(out, self._positions), False
        else:
            out, subset = kept(out, None), True
        self._sink.probe(self._ctx, layer, site, out, schema.KIND_HOST, subset=subset)

    def _progress(self) -> None:
        if self._bar is None:
            if not (self.config.progress and sys.stderr.isatty()):
                return
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.config.samples * len(self.blocks), desc="srdd-dump", unit="layer",
                file=sys.stderr, leave=False,
            )
        self._bar.update(1)

    # -- rounds ---------------------------------------------------------------------------
    def _add(self, layer: int, site: int, hidden: torch.Tensor) -> None:
        self._sink.clean(self._ctx, layer, site, hidden)

    def _finish_site(self, layer: int, site: int) -> None:
        if self._ctx is not None:
            self._sink.finish_site(self._ctx, layer, site)

    def _submit(self) -> None:
        r, self._ctx = self._ctx.round, None
        self._drop_misshapen(r)
        if self.writer is None:
            self.path = dump_file_name(self.config.dump_path)
            self.writer = DumpWriter(
                self.path, self._meta(r), self.layer_names, self.site_names,
                stat_columns=self._sink.stat_columns)
        if self.writer.error:
            self._fail(f"cannot write {self.writer.path}: {self.writer.error}")
            return
        self.writer.submit(r)

    def _drop_misshapen(self, r: Round) -> None:
        """Every record of a round has the round's shape (readers reject a file otherwise):
        an output of another shape (a module called on other rows) is left out and counted."""
        ntok = len(r.positions)
        rows = None if r.probe_rows is None else len(r.probe_rows)
        keep = []
        for t in r.tensors:
            want = (1, rows) if t.subset else (r.batch, ntok)
            if t.array.ndim == 3 and t.array.shape[:2] == want:
                keep.append(t)
            else:
                self.records_dropped += 1
        r.tensors = keep

    def _meta(self, first: Round) -> dict:
        param = next(self.model.parameters(), None)
        model_config = getattr(self.model, "config", None)
        to_dict = getattr(model_config, "to_dict", None)
        tf_version = loaded_version("transformers")  # never imported here: not the user's
        dtypes = {t.layer: t.dtype for t in first.tensors}
        for row in first.stats:
            dtypes.setdefault(row.layer, schema.DTYPE_CODES[row.dtype])
        return {
            "tool": "srdd-dump",
            "tool_version": __version__,
            "model_class": f"{type(self.model).__module__}.{type(self.model).__qualname__}",
            "layers": self.layer_names,
            "block_class": type(self.blocks[0][1]).__name__,
            "param_dtype": str(param.dtype).replace("torch.", "") if param is not None else None,
            "hidden_dtype": dtypes.get(0),
            # torch.autocast around the model: the precision the matmuls ran in, below the
            # dtype of the recorded tensors (the compare judges rounding by it)
            "autocast_dtype": self._autocast or None,
            # fp32 matmuls in a shorter format (TF32 / HF32 / bf16 passes): the compare judges
            # rounding by it
            "float32_matmul": float32_matmul(param.device.type if param is not None else "cpu"),
            "hidden_width": self._width,
            "device": str(param.device) if param is not None else "cpu",
            "torch_version": torch.__version__,
            "transformers_version": tf_version,
            "python_version": sys.version.split()[0],
            "host": socket.gethostname(),
            "rank": env_rank(),
            "local_rank": os.environ.get("LOCAL_RANK"),
            "world_size": os.environ.get("WORLD_SIZE"),
            "pid": os.getpid(),
            "command": self.config.command or " ".join(sys.argv),
            "seed": self.config.seed,
            "torch_initial_seed": int(torch.initial_seed()),
            "dump_config": vars(self.config),
            "sites": self.site_names,
            "site_roles": [site.role for site in self.sites],
            "injected_faults": self.faults,
            "tensor_parallel": self._tp.meta(),
            "model_config": to_dict() if callable(to_dict) else None,
            "started": time.time(),
        }

    # -- lifecycle ------------------------------------------------------------------------
    def _fail(self, reason: str) -> None:
        self.error = reason
        sys.stderr.write(f"srdd-dump: warning: capture turned off: {reason}\n")
        self.close()

    def remove(self) -> None:
        """Remove the capture hooks (injected faults stay until ``remove_faults``/exit)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def abandon(self) -> None:
        """In a forked child: the hooks, the injected faults and the file are the parent's;
        stop without writing (keep the session referenced: nothing of it may be freed)."""
        self._closed = True
        if self.writer is not None:
            self.writer.forget_after_fork()
        self.remove()
        self.remove_faults()
        atexit.unregister(self.close)

    def remove_faults(self) -> None:
        for h in self._fault_handles:
            h.remove()
        self._fault_handles.clear()

    def close(self) -> str | None:
        """Remove the hooks and finalise the dump file. Returns its path (None if empty)."""
        if self._closed:
            return self.path
        self._closed = True
        self.remove()
        self._pending = []  # device tensors of a model-level operator
        if self._bar is not None:
            self._bar.close()
        if self.writer is not None:
            silent = self._silent_sites()
            partial = explain_partial(silent, len(self.blocks) + len(self.sites))
            try:
                self.path = self.writer.close({
                    "error": self.error, "samples": self.sample + 1,
                    "batched_replays": self.batched_replays,
                    "sequential_replays": self.sequential_replays,
                    "decode_replays_skipped": self.decode_replays_skipped,
                    "host_replays": self.host_replays,
                    "host_replays_failed": self.host_replays_failed,
                    "records_dropped": self.records_dropped,
                    "site_errors": self.site_errors,
                    **self._tp.status(),
                    "sites_never_run": len(silent) if partial else 0,
                    "compiled_probes_dropped": self.compiled_probes_dropped,
                    "coverage": self.coverage.as_dict(),
                    "untested_versions": self.version_notes,
                    **self._sink.status(),
                })
            except Exception as exc:  # runs at exit too: never a traceback in the user's program
                self.path = self.writer.partial_path
                self.writer.error = self.writer.error or describe_error(exc)
            if self.writer.error and not self.error:
                self.error = f"cannot write {self.path}: {self.writer.error}"
                sys.stderr.write(f"srdd-dump: warning: capture stopped: {self.error}\n")
            elif self.path and not os.environ.get(cfg.ENV_CONFIG):
                # under `srdd-dump --exec` the command itself lists every process's file
                sys.stderr.write(f"srdd-dump: wrote {self.path}\n")
            if partial:
                sys.stderr.write(f"srdd-dump: warning: {partial}\n")
            self.degraded = self.coverage.shortfalls()
            if not os.environ.get(cfg.ENV_CONFIG):  # under --exec the command says it once
                for line in self.degraded:
                    sys.stderr.write(f"srdd-dump: warning: evidence missing: {line}\n")
        elif not self.error:
            self.silence = explain_silence(self.model, self.model_calls, self.block_calls)
            if self.silence and not os.environ.get(cfg.ENV_CONFIG):
                sys.stderr.write(f"srdd-dump: warning: nothing captured: {self.silence}\n")
        atexit.unregister(self.close)
        return self.path

    def _silent_sites(self) -> list[str]:
        """Blocks and sites whose hooks never ran in a captured round."""
        blocks = [name for i, name in enumerate(self.layer_names)
                  if (i, schema.BLOCK_SITE) not in self._fired]
        # a model-level rotary and the experts' slots and expert sites have no hook of their own
        return blocks + [site.name for i, site in enumerate(self.sites)
                         if site.role not in (ROTARY, EXPERT_SLOTS, EXPERT)
                         and (site.layer, i) not in self._fired]

    def __enter__(self) -> CaptureSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        self.remove_faults()


def evidence_level(site: Site) -> str:
    """What a site is, in the coverage families' words: attention, MLP, operator, expert..."""
    if site.role == EXPERTS:
        return "expert"
    if site.role in ROW_WISE:
        return "operator"
    last = site.name.rsplit(".", 1)[-1]
    if site.role == SUBLAYER and last in ATTENTION_NAMES:
        return "attention"
    if site.role == SUBLAYER and last in MLP_NAMES:
        return "MLP"
    return "sub-layer"


def register_hook(model: nn.Module, config: DumpConfig | None = None) -> CaptureSession:
    """Start capturing ``model`` (msit style). Use the result as a context manager, or call
    ``.close()``, to remove the hooks and finish the dump file."""
    return CaptureSession(model, config or DumpConfig())
