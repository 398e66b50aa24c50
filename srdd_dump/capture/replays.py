"""The replays of a captured round: each site re-run on its own recorded call, perturbed (the
probes), and with ``--reference host`` in float64 on the host. How a site is replayed follows
its role (roles.py): the whole module, its probe rows alone (row-wise operators), each expert
through the fused call, or not at all. The outputs go to the round's record sink (sinks.py);
what was asked for and what ran goes to the coverage (format/coverage.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, Callable

import torch
from torch import nn

from ..format import schema
from ..format.coverage import Coverage
from ..runtime.terminal import say
from ..vocabulary import BLOCK, EXPERTS, LINEAR, NORM, ROTARY, ROUTER, SUBLAYER
from . import serving
from .attention_reference import (
    AttentionLayout,
    PastKV,
    find_cache,
    past_kv,
    reference_rows,
    rotary_agrees,
    row_positions,
)
from .compiled import EAGER_HINT
from .discovery import Site
from .evidence import family
from .host import host_replay
from .host_weights import HostWeights
from .identities import causal_cut, is_causal, scale_replays
from .mlp_reference import NOT_GATED, SILENT, MlpReference
from .model_facts import has_past
from .moe_capture import ExpertCapture
from .parallel import TensorParallel, to_local
from .probes import (
    FrozenCache,
    ProbeSpec,
    first_tensor,
    layer_index,
    other_kernels,
    outside_output_recording,
    preserved_rng,
    probe_seed,
    repeat_call,
    run_probes,
    snapshot_cache,
    static_after_prefill,
)
from .roles import EXPERT_CALLS, NO_REPLAY, ROLE_CAPTURE, ROWS, WHOLE
from .rounds import RoundContext
from .shared_repeats import SharedRepeats, Waiting
from .sinks import RecordSink
from .tensors import kept

Replay = Callable[..., None]
# a row-wise MLP is replayed on its probe rows alone when they are at most this share of its
# call's rows: below it the whole call costs at most twice as much and keeps the call's shapes
ROW_WISE_SHARE = 0.5


class Replays:
    """The replays of one session's blocks and sites."""

    def __init__(self, blocks: list[nn.Module], sites: list[Site], spec: ProbeSpec,
                 sink: RecordSink, coverage: Coverage, tp: TensorParallel, *, host: bool,
                 serving_blocks: set[int], moe: ExpertCapture | None, levels: dict[int, str],
                 attention: dict[int, AttentionLayout | str] | None = None,
                 mlp: MlpReference | None = None):
        self.sites, self.spec, self.sink, self.coverage, self.tp = sites, spec, sink, coverage, tp
        # id(attention module) -> its layout for the reference attention, or why there is none
        self.attention = attention or {}
        # the cache layers a reference reads (their past is kept when the replays' is not)
        self._referenced = {v.layer for v in self.attention.values() if not isinstance(v, str)}
        self.mlp = mlp  # the reference MLPs (mlp_reference.py)
        # the host weights shared by both references
        self.weights = mlp.weights if mlp is not None else HostWeights()
        self.host, self.serving, self.moe, self.levels = host, serving_blocks, moe, levels
        self.causal = causal_modules(blocks, sites)
        self.blocks = blocks
        # sub-layers and fused experts inside their layer's block: their repeats (the
        # experts': their slots') come from the block's
        self.shared = SharedRepeats(spec.repeats)
        self._nested = {i for i, s in enumerate(sites) if s.role in (SUBLAYER, EXPERTS) and any(
            m is s.module for m in blocks[s.layer].modules())}
        self.active = False  # a replay is running: the session's hooks ignore its calls
        self.compiled_round = False  # this round runs as torch.compile'd code
        # cache layer -> its KV cache before this decode step, or why it could not be kept
        self.caches: dict[int, FrozenCache | str] = {}
        self.pasts: dict[int, PastKV | str | None] = {}  # the same, for the reference attention
        self._cache_layer: dict[int, int | None] = {}  # id(module) -> the cache layer it uses
        self.batched = self.sequential = 0
        self.decode_skipped = 0
        self.site_errors = 0  # sub-layers whose own repeat failed (shared_repeats.py)
        self.host_done = self.host_failed = 0
        self.compiled_dropped = 0
        self._by_kind: dict[str, Replay] = {
            WHOLE: self._whole, ROWS: self._rows, EXPERT_CALLS: self._experts,
            NO_REPLAY: lambda *_: None,
        }

    def status(self) -> dict:
        return {"batched_replays": self.batched, "sequential_replays": self.sequential,
                "repeats_from_blocks": self.shared.taken,
                "decode_replays_skipped": self.decode_skipped, "host_replays": self.host_done,
                "host_replays_failed": self.host_failed,
                "compiled_probes_dropped": self.compiled_dropped,
                "assumed_activations": self.mlp.assumed if self.mlp is not None else []}

    def open_round(self, compiled: bool) -> None:
        self.caches.clear()
        self.pasts.clear()
        self.shared.clear()
        self.compiled_round = compiled

    def close(self) -> None:
        """The session is closed: the kept caches and the references' host weights go."""
        self.open_round(False)
        self.weights.release()

    @contextmanager
    def running(self) -> Iterator[None]:
        """The session's own hooks ignore the calls made inside."""
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def keep_cache(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Before a decode step's call updates it: the KV cache the module reads (one copy for
        a block and its attention), so that its replays see what the device saw."""
        idx = self._layer_of(module)
        if idx is not None and idx not in self.caches:
            self.caches[idx] = frozen = snapshot_cache(idx, args, kwargs)
            if isinstance(frozen, FrozenCache):
                n = frozen.get_seq_length()  # a static cache's buffer: its first n written
                self.pasts[idx] = PastKV(frozen.keys[..., :n, :], frozen.values[..., :n, :],
                                         0, n)
            elif idx in self._referenced:
                # a cache the replays cannot take (a sliding window), for the reference
                self.pasts[idx] = past_kv(find_cache(args, kwargs), idx, copy=True)

    def _layer_of(self, module: nn.Module) -> int | None:
        key = id(module)
        if key not in self._cache_layer:
            self._cache_layer[key] = layer_index(module)
        return self._cache_layer[key]

    def replay(self, module: nn.Module, layer: int, site: int, args: tuple, kwargs: dict,
               hidden: torch.Tensor, ctx: RoundContext) -> None:
        """The replays of a site's call of this round, by its role; a fused experts call
        records its slots and routing even when the round is not probed."""
        role = self.sites[site].role if site >= 0 else BLOCK
        kind = ROLE_CAPTURE[role].replay
        if not ctx.probed and kind != EXPERT_CALLS:
            return
        with outside_output_recording(module):
            try:
                self._by_kind[kind](module, layer, site, role, args, kwargs, hidden, ctx)
            finally:
                if site == schema.BLOCK_SITE:
                    self._finish_waiting(layer, ctx)

    def finishes_later(self, layer: int, site: int) -> bool:
        """The site's records are completed by its block's replay (shared_repeats.py)."""
        return self.shared.deferred(layer, site)

    def _shares_repeats(self, module: nn.Module, layer: int, site: int, spec: ProbeSpec
                        ) -> bool:
        """A sub-layer whose repeats its block's repeats can give."""
        if site not in self._nested or not spec.repeats:
            return False
        block = self.blocks[layer]
        return (id(block) not in self.serving and not serving.overwrites_inputs(module)
                and not serving.replays_alone(module) and self.tp.may_replay(block)
                and self.tp.batched(block) == self.tp.batched(module))

    def _defer(self, module: nn.Module, layer: int, site: int, x: torch.Tensor,
               again: Callable[[], torch.Tensor], outputs: list, hidden: torch.Tensor,
               ctx: RoundContext, family: str, cut_already: bool = False) -> None:
        """A sub-layer waits for its block's repeats holding copies of what it will hand on
        (its outputs cut to the stored rows, unless ``cut_already``: replayed on those rows
        alone; the stats store's clean entry): the block may change the sub-layer's tensors
        in place meanwhile (Falcon adds the attention into the MLP's output)."""
        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else ctx.probe_rows(t)

        held = outputs if cut_already else [
            dataclasses.replace(p, output=cut(p.output), perturbation=cut(p.perturbation))
            for p in outputs]
        recorded = cut(hidden)
        self.sink.hold(ctx, layer, site)

        def emit(outputs: list) -> None:
            if self._keep_probes(module, outputs, recorded):
                self.sink.probe_outputs(ctx, layer, site, outputs)
            self.sink.finish_site(ctx, layer, site)

        def alone() -> torch.Tensor:  # routing held, as in the block's run
            with self.moe.pinned() if self.moe is not None else nullcontext():
                return cut(again())

        self.shared.defer(layer, Waiting(module, site, x, alone, held, emit, family=family))

    def _finish_waiting(self, layer: int, ctx: RoundContext) -> None:
        if not self.shared.waiting.get(layer):
            return
        with self.running():
            failed = self.shared.finish(layer)
        for waiting, exc in failed:  # its clean record is kept, as for any failed replay
            self.coverage.retract(waiting.family, f"{type(exc).__name__}: {exc}")
            if ctx.step == 0:
                self.site_errors += 1
            else:
                self.decode_skipped += 1
            try:
                self.sink.finish_site(ctx, layer, waiting.site)
            except Exception:  # noqa: BLE001 (its hand-over failed half-way: counted above)
                pass

    def _family(self, ctx: RoundContext, site: int, what: str) -> str:
        return family(ctx.probed_phase, self.levels[site], what)

    def _whole(self, module, layer, site, role, args, kwargs, hidden, ctx) -> None:
        """The module re-run on its whole recorded call (a decode step with its KV cache as it
        was before the call)."""
        if not self.tp.may_replay(module):
            return  # its replay could communicate (tensor parallel): parallel.py says why
        spec = self._spec(module)
        decode = ctx.step > 0
        idx = self._layer_of(module) if decode else None
        kept_cache = self.caches.get(idx) if idx is not None else None
        cache = kept_cache if isinstance(kept_cache, FrozenCache) else None
        if not decode:  # a static cache's prefill: the replays attend its whole buffer
            cache = static_after_prefill(self._layer_of(module), args, kwargs,
                                         int(hidden.shape[-2]) if hidden.dim() >= 2 else 1)
        cut = stop = None
        if spec.causal and not decode and self.causal.get(id(module)):
            cut, stop = self._cut(hidden, ctx)
        probes = self._family(ctx, site, "probes") if (
            spec.sigmas or spec.dc or spec.repeats or cut is not None) else None
        host = self.host and self.tp.may_host_replay(module)
        # the reference attention reads the cache as the call left it: it needs no snapshot
        referenced = (id(module) in self.attention and (spec.attention or host)
                      and self.attention_record(module, layer, site, args, kwargs, hidden, ctx))
        if (not referenced and self.mlp is not None and spec.mlp
                and self.mlp.layouts.get(id(module), NOT_GATED) not in SILENT):
            referenced = self.mlp_record(module, layer, site, args, kwargs, hidden, ctx)
        host = host and not referenced
        if decode and cache is None and has_past(args, kwargs):
            # a decode step whose past cannot be reproduced: no replay, clean data only
            self.decode_skipped += 1
            for name in filter(None, (probes, host and self._family(ctx, site, "host replays"))):
                self.coverage.expect(name)
                why = kept_cache or "a cache layout srdd-dump does not know"
                self.coverage.failed(name, f"the KV cache of {type(module).__name__} could "
                                     f"not be copied: {why}")
            return
        if probes:
            share = self._shares_repeats(module, layer, site, spec)
            around = None
            if site == schema.BLOCK_SITE and self.shared.waiting.get(layer):
                def around(t: int, layer=layer, ctx=ctx):
                    return self.shared.around(layer, t, ctx.probe_rows)
            # a row-wise MLP whose probe rows are a small part of its call: perturbed on
            # those rows alone (its repeats re-run the whole call)
            rows_only = not decode and cut is None and self._row_wise(
                module, role, args, kwargs, hidden, ctx)
            recorded = ctx.probe_rows(hidden) if rows_only else hidden
            try:
                with self.running(), self.coverage.attempt(probes), (
                        self.moe.pinned() if self.moe is not None else nullcontext()):
                    outputs, batched = run_probes(
                        module, args, kwargs, recorded,
                        dataclasses.replace(spec, repeats=0) if share else spec,
                        ctx.seeds(layer, site), cache, cut, stream=id(module) in self.serving,
                        causal_stop=stop, around_repeat=around,
                        rows=ctx.probe_rows if rows_only else None)
                    if share:
                        x, again = repeat_call(module, args, kwargs, cache)
            except Exception:
                if not decode:
                    raise
                # a decode replay this module refuses (a cache layout not reproduced): its
                # clean data is kept, the step is not probed (and coverage says so)
                self.decode_skipped += 1
                return
            if batched:
                self.batched += 1
            else:
                self.sequential += 1
            if share:
                self._defer(module, layer, site, x, again, outputs, hidden, ctx, probes,
                            cut_already=rows_only)
            elif self._keep_probes(module, outputs, recorded):  # rows_only: cut already
                self.sink.probe_outputs(ctx, layer, site, outputs,
                                        None if rows_only else (ctx.positions, ctx.rows))
        if host:
            self.host_record(module, layer, site, args, kwargs, cache, ctx)

    def _row_wise(self, module: nn.Module, role: str, args: tuple, kwargs: dict,
                  hidden: torch.Tensor, ctx: RoundContext) -> bool:
        """The probes of this call may run on its probe rows alone: a gated MLP of the Hugging
        Face kind (``down(act(gate(x)) * up(x))``: each output row depends on its input row
        only) called on the round's tokens alone, whose probe rows are at most
        ROW_WISE_SHARE of the call's rows (a long prompt). Its perturbed inputs are those of
        a whole-call replay; a per-call statistic of the device (a range, a quantisation
        scale) then spans the probe rows, not the whole call."""
        if (role != SUBLAYER or self.mlp is None or ctx.rows is None
                or ctx.segments is not None or id(module) in self.serving
                or not self.tp.batched(module)):
            return False
        layout = self.mlp.layouts.get(id(module))  # the reference MLP's recognised layout
        x = args[0] if len(args) == 1 and not kwargs else None
        return (layout is not None and not isinstance(layout, str)
                and isinstance(x, torch.Tensor) and x.dim() == 3
                and x.shape[:-1] == hidden.shape[:-1]
                and len(ctx.rows) <= ROW_WISE_SHARE * x.shape[0] * x.shape[1])

    def attention_record(self, module: nn.Module, layer: int, site: int, args: tuple,
                         kwargs: dict, hidden: torch.Tensor, ctx: RoundContext) -> bool:
        """The reference attention of the probe rows (attention_reference.py) as a KIND_HOST
        record: the module's host reference, by srdd-dump's own attention. False when
        there is none (the coverage says why)."""
        name = self._family(ctx, site, "references")
        self.coverage.expect(name)
        layout = self.attention[id(module)]
        x = first_tensor(args) if args else kwargs.get("hidden_states")
        why = layout if isinstance(layout, str) else None
        if why is None and (ctx.segments is not None or not isinstance(x, torch.Tensor)
                            or x.dim() != 3 or hidden.shape[:2] != x.shape[:2]):
            why = "a call that is not one (batch, tokens, hidden) forward"
        if why is None and ctx.mask_unread:
            why = "an attention mask that is not a 2-D tensor (its padding cannot be read)"
        cache = None
        if why is None:  # the past as kept before a decode step, else read after the call
            cache = (self.pasts[layout.layer] if layout.layer in self.pasts
                     else past_kv(find_cache(args, kwargs), layout.layer, x.shape[1]))
        if isinstance(cache, str):
            why = cache
        if why is None:
            positions = row_positions(kwargs, x.shape[1], cache)
            table = kwargs.get("position_embeddings")
            if ctx.step == 0 and not rotary_agrees(layout, table, positions):
                # the model's rotary convention is not the one recognised, or its rotary
                # module is outside what was captured: no reference
                self.attention[id(module)] = why = (
                    "a rotary table of another convention" if layout.rotary is not None else
                    "its rotary table is made outside what was captured (register_hook was "
                    "given the layers, not the model?)")
        if why is not None:
            self.coverage.failed(name, f"{type(module).__name__}: {why}")
            return False
        n_kept = x.shape[1] if ctx.positions is None else len(ctx.positions)
        kept_at = (torch.arange(x.shape[1]) if ctx.positions is None
                   else ctx.positions.cpu())
        rows = [(int(r) // n_kept, int(kept_at[int(r) % n_kept])) for r in ctx.rows.tolist()]
        device = kept(hidden, ctx.positions, ctx.rows)[0]
        return self._reference(module, layer, site, ctx, name, lambda: reference_rows(
            layout, x, rows, positions, cache, ctx.key_mask, device, self.weights))

    def mlp_record(self, module: nn.Module, layer: int, site: int, args: tuple,
                   kwargs: dict, hidden: torch.Tensor, ctx: RoundContext) -> bool:
        """The reference MLP of the probe rows (mlp_reference.py) as a KIND_HOST record, or
        why a gated MLP has none (its layout's reason)."""
        x = first_tensor(args) if args else kwargs.get("hidden_states")
        layout = self.mlp.layouts[id(module)]
        if not isinstance(layout, str) and (not isinstance(x, torch.Tensor)
                                            or x.shape[:-1] != hidden.shape[:-1]):
            return False
        name = self._family(ctx, site, "references")
        self.coverage.expect(name)
        return self._reference(module, layer, site, ctx, name, lambda: layout if isinstance(
            layout, str) else self.mlp.rows(module, kept(x, ctx.positions, ctx.rows)[0]))

    def _reference(self, module: nn.Module, layer: int, site: int, ctx: RoundContext,
                   name: str, compute: Callable[[], torch.Tensor | str]) -> bool:
        """A reference's rows (or why none: a string) as the site's KIND_HOST record of the
        probe rows, counted in coverage family ``name``; an error is counted, never raised
        (the site's probes go on). A module whose weights are split over tensor-parallel
        ranks (replayed with ``--tp-replays lockstep``) has none: it needs the whole weights."""
        if self.tp.sharded(module):
            self.coverage.failed(name, f"{type(module).__name__}: its weights are split over "
                                 "the tensor-parallel ranks (a reference needs them "
                                 "whole)")
            return False
        try:
            with torch.no_grad():
                out = compute()
        except Exception as exc:  # noqa: BLE001 (a module of an unexpected shape)
            out = f"{type(exc).__name__}: {exc}"
        if isinstance(out, str):
            self.coverage.failed(name, f"{type(module).__name__}: {out}")
            return False
        self.coverage.ran(name)
        self.host_done += 1
        self.sink.probe(ctx, layer, site, out.unsqueeze(0), schema.KIND_HOST, subset=True)
        return True

    @staticmethod
    def _cut(hidden: torch.Tensor, ctx: RoundContext) -> tuple[int | None, int | None]:
        """The causality probe's first perturbed row, and the row it stops at: in a serving
        engine's flat batch, inside the last captured prefill (the other requests' rows stay
        as they were: a change there would test batch independence, not causality)."""
        seed = probe_seed(ctx.seed, ctx.sample, 0xCA05A1)
        if ctx.segments is None:
            return causal_cut(hidden.shape[-2] if hidden.dim() >= 2 else 1, seed), None
        prefills = [s for s in ctx.segments
                    if s.step == 0 and s.probed and s.stop - s.start >= 2]
        if not prefills:
            return None, None
        seg = prefills[-1]
        return seg.start + causal_cut(seg.stop - seg.start, seed), seg.stop

    def _rows(self, module, layer, site, role, args, kwargs, hidden, ctx) -> None:
        """A row-wise operator (linear, norm, activation) re-run on the probe rows of its input
        alone: each output row depends on its input row only."""
        if not self.tp.may_replay(module):
            return
        spec = self._spec(module)
        x = to_local(first_tensor(args) if args else kwargs.get("hidden_states"))
        if isinstance(x, torch.Tensor) and role == ROUTER:
            x = ctx.as_round(x)
        if not isinstance(x, torch.Tensor) or x.shape[:-1] != hidden.shape[:-1]:
            name = self._family(ctx, site, "probes")
            self.coverage.expect(name)
            self.coverage.failed(name, f"the input of {type(module).__name__} is not shaped "
                                 "like its output's tokens")
            return
        # a tensor-parallel module is replayed on its whole recorded input (an all-reduce's
        # rounding depends on the buffer's shape), the probe rows taken from its outputs
        rows = (ctx.positions, ctx.rows) if not self.tp.batched(module) else None
        x_rows = x if rows else kept(x, ctx.positions, ctx.rows)
        recorded = hidden if rows else kept(hidden, ctx.positions, ctx.rows)
        extra = {}
        residual, _ = serving.named_input(module, args, kwargs, serving.RESIDUAL)
        if residual is not None and residual.shape == x.shape:  # a fused add + norm
            extra[serving.RESIDUAL] = (residual if rows
                                       else kept(residual, ctx.positions, ctx.rows))
        with self.running():
            if spec.sigmas or spec.dc or spec.repeats:
                with self.coverage.attempt(self._family(ctx, site, "probes")):
                    outputs, _ = run_probes(module, (x_rows,), extra, recorded, spec,
                                            ctx.seeds(layer, site),
                                            fused_add=bool(extra) and role == NORM)
                if self._keep_probes(module, outputs, recorded):
                    self.sink.probe_outputs(ctx, layer, site, outputs, rows)
            if spec.scale and role == LINEAR:
                with torch.no_grad(), preserved_rng(x.device):
                    for k, y in scale_replays(module, x_rows):
                        y = kept(y, *rows) if rows else y
                        self.sink.probe(ctx, layer, site, y, schema.KIND_SCALE,
                                        probe=k, param=k)
        # a norm's float64 replay is its reference (the probe word "norm"): a few rows of a
        # row-wise map, cheap enough for the default scan
        reference = spec.norm and role == NORM
        if (self.host or reference) and self.tp.may_host_replay(module):
            self.host_record(module, layer, site, (x_rows,), extra, None, ctx, rows=None,
                             what="host replays" if self.host else "references")

    def _experts(self, module, layer, site, role, args, kwargs, hidden, ctx) -> None:
        """A fused experts call: the routing, each token slot's own expert output and, on the
        probe rows, each expert probed on its own (moe_capture.py). The experts module's own
        records are complete first (the sum within its MLP block is probed there). In a
        block the slots wait for the block's repeats: where the block's experts call
        reproduces the recorded one, no slots call is re-run for a repeat."""
        self.sink.finish_site(ctx, layer, site)
        spec = self.spec
        probed = ctx.probed and bool(spec.sigmas or spec.dc or spec.repeats)
        name = self._family(ctx, site, "probes")
        share = probed and self._shares_repeats(module, layer, site, spec)
        with (self.coverage.attempt(name) if probed else nullcontext()), self.running():
            pending = self.moe.record(module, layer, site, args, kwargs, hidden, ctx, share)
        if pending is not None:  # its slots' repeats from the block's (shared_repeats.py)
            self.shared.defer(layer, Waiting(module, pending.site, pending.x, pending.again,
                                             pending.outputs, pending.emit, family=name,
                                             repeat_from=pending.repeat_from))

    def _spec(self, module: nn.Module) -> ProbeSpec:
        """A tensor-parallel module whose replays cannot be batched runs them one by one."""
        if self.tp.batched(module):
            return self.spec
        return dataclasses.replace(self.spec, batched=False)

    def _keep_probes(self, module, outputs, recorded) -> bool:
        """In a round run as compiled code the replays run eagerly: a module's probe records
        are left out when its eager re-runs agree with each other but not with its recorded
        output (fused inductor kernels; the eager and aot_eager backends reproduce it): every
        comparison with the recorded output would measure the compiler, not the device.
        Re-runs that differ from each other are run-to-run noise, a finding: kept."""
        if not self.compiled_round or not other_kernels(outputs, recorded):
            return True
        if not self.compiled_dropped:
            say(
                f"srdd-dump: note: {type(module).__name__} runs as torch.compile'd code that an "
                "eager replay does not reproduce bit for bit: such modules are captured without "
                f"probes; for the probes {EAGER_HINT}\n")
        self.compiled_dropped += 1
        return False

    def host_record(self, module: nn.Module, layer: int, site: int, args: tuple, kwargs: dict,
                    cache: Any, ctx: RoundContext, rows: str | None = "round",
                    what: str = "host replays") -> None:
        """The float64 host replay of ``module`` on its recorded input, as a KIND_HOST record
        of the round's probe rows (``rows=None``: the input already holds only those rows, or
        a model-level operator whose every kept row is stored). A module the host cannot
        replay is counted, never fatal."""
        try:
            with self.coverage.attempt(self._family(ctx, site, what)):
                out = host_replay(module, args, kwargs, cache)
        except Exception:  # noqa: BLE001 (a device-only module, a cache layout not known)
            self.host_failed += 1
            return
        self.host_done += 1
        role = self.sites[site].role if site >= 0 else BLOCK
        if rows == "round":
            out = kept(out, ctx.positions, ctx.rows)
            subset = True
        elif role == ROTARY:
            out = ctx.round_shaped(out)
            if out is None:
                return
            out, subset = kept(out, ctx.positions), False
        else:
            out, subset = kept(out, None), True
        self.sink.probe(ctx, layer, site, out, schema.KIND_HOST, subset=subset)


def causal_modules(blocks: list[nn.Module], sites: list[Site]) -> dict[int, bool]:
    """id(module) -> whether its replays may be held to bit-exact causality. A block or
    sub-block with fused experts is not: a grouped expert GEMM's rounding of a row depends on
    its place in its expert's group (its attention still is)."""
    causal = {id(m): is_causal(m) for m in blocks}
    causal.update({id(site.module): is_causal(site.module) for site in sites})
    for site in sites:
        if site.role == EXPERTS:
            around = [blocks[site.layer]] + [
                other.module for other in sites if other.layer == site.layer]
            for module in around:
                if any(m is site.module for m in module.modules()):
                    causal[id(module)] = False
    return causal
