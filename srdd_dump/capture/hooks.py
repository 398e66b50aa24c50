"""The in-code capture API: ``register_hook(model, DumpConfig(...))``.

One idea: a forward pre-hook on the first block opens a *round* (one forward of the model),
a forward hook on every block copies its output hidden state to the host, and the last block's
hook hands the finished round to the writer thread. Hooks only read; they never return a
value, so the user's program computes exactly what it computes without them.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from ..format import schema
from ..format.writer import DumpWriter, Round, Tensor, describe_error
from ..version import __version__
from . import config as cfg
from .config import DumpConfig
from .discovery import find_blocks, find_sites
from .faults import install_faults
from .probes import (
    ProbeSpec,
    first_tensor,
    is_cache,
    layer_index,
    probe_seed,
    run_probes,
    snapshot_cache,
)

_TORCH_TO_LOGICAL = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
}


def kept(
    t: torch.Tensor, positions: torch.Tensor | None, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """(batch, ntok, width) view of the kept token positions; with ``rows``, (1, rows, width)
    of those rows of the flattened (batch * ntok, width) tensor."""
    t = t.detach()
    if t.dim() == 2:
        t = t.unsqueeze(0)
    elif t.dim() != 3:
        t = t.reshape(t.shape[0], -1, t.shape[-1])
    if positions is not None:
        t = t.index_select(-2, positions.to(t.device))
    if rows is not None:
        t = t.reshape(-1, t.shape[-1]).index_select(0, rows.to(t.device)).unsqueeze(0)
    return t


def to_host(
    t: torch.Tensor, positions: torch.Tensor | None, rows: torch.Tensor | None = None
) -> tuple[np.ndarray, str]:
    """Copy the kept part of a hidden state to a numpy array in storage dtype. Always a copy:
    the user's tensor may be changed in place later."""
    t = kept(t, positions, rows)
    logical = _TORCH_TO_LOGICAL.get(t.dtype)
    if logical is None:
        t, logical = t.float(), "float32"
    host = t.to("cpu", copy=True)
    if logical == "bfloat16":
        return host.view(torch.int16).numpy().view(np.uint16), logical
    return host.numpy(), logical


def dump_file_name(dump_path: str) -> str:
    rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
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
        self.sites = (
            find_sites(self.blocks, config.sublayers) if config.granularity == "sublayer" else []
        )
        self.site_names = [name for _, name, _ in self.sites]
        probes = cfg.parse_probes(config.probes)
        self.probe_spec = ProbeSpec(
            sigmas=tuple(config.sigmas) if "gain" in probes else (),
            draws=config.draws,
            dc=tuple(config.dc) if "dc" in probes else (),
            repeats=config.repeats if "repeat" in probes else 0,
            batched=config.batch_probes,
        )
        self._probing = bool(probes)
        self._store = cfg.parse_store(config.store)
        self.batched_replays = 0
        self.decode_replays_skipped = 0
        self.sequential_replays = 0
        self._replaying = False
        self._rows: torch.Tensor | None = None
        self._bar = None
        self._fault_handles, self.faults = install_faults(
            model, self.blocks, config.faults()
        )
        self._steps = cfg.parse_steps(config.steps)
        self._probe_steps = cfg.parse_steps(config.probe_steps)
        self._last_step = cfg.last_step(self._steps)
        self._tokens = cfg.parse_tokens(config.tokens)
        self.sample = -1
        self.step = 0
        self.error: str | None = None
        self.path: str | None = None
        self.writer: DumpWriter | None = None
        self._round: Round | None = None
        self._positions: torch.Tensor | None = None
        self._token_ids: torch.Tensor | None = None
        self._attention_mask: torch.Tensor | None = None  # (batch, past + seq) of the model call
        # cache layer -> its KV cache before this decode step (one copy for the block and its
        # attention), and id(module) -> the cache layer it uses
        self._caches: dict[int, Any] = {}
        self._cache_layer: dict[int, int | None] = {}
        self._autocast: str | None = None  # "" when the first model call ran without autocast
        self._handles: list[Any] = []
        self._closed = False
        self._install()
        atexit.register(self.close)

    # -- hooks ----------------------------------------------------------------------------
    def _install(self) -> None:
        self._handles.append(
            self.model.register_forward_pre_hook(self._on_model_call, with_kwargs=True))
        embed = _input_embedding(self.model)
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
        for site, (layer, _, module) in enumerate(self.sites):
            hook = self._output_hook(layer, site, False)
            self._handles.append(module.register_forward_hook(hook, with_kwargs=True))
            self._handles.append(
                module.register_forward_pre_hook(self._on_module_call, with_kwargs=True))

    def _guard(self, fn, *args) -> None:
        if self._closed or self._replaying:
            return
        try:
            fn(*args)
        except Exception as exc:  # capture must never break the user's program
            self._fail(describe_error(exc))

    def _on_embedding(self, module: nn.Module, args: tuple) -> None:
        def grab() -> None:
            ids = args[0] if args else None
            if isinstance(ids, torch.Tensor) and not ids.is_floating_point():
                self._token_ids = ids

        self._guard(grab)

    def _on_module_call(self, module: nn.Module, args: tuple, kwargs: dict | None = None
                        ) -> None:
        """A decode step that will be probed: keep the layer's KV cache as it is before the
        call updates it, so the replays see what the device saw. (``kwargs`` is None when the
        session closed itself inside this very call: torch then calls the hook without.)"""
        if self._round is None or self._rows is None or self.step == 0 or kwargs is None:
            return
        self._guard(self._snapshot, module, args, kwargs)

    def _snapshot(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        idx = self._layer_of(module)
        if idx is not None and idx not in self._caches:
            self._caches[idx] = snapshot_cache(idx, args, kwargs)

    def _layer_of(self, module: nn.Module) -> int | None:
        key = id(module)
        if key not in self._cache_layer:
            self._cache_layer[key] = layer_index(module)
        return self._cache_layer[key]

    def _on_model_call(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        def grab() -> None:
            mask = kwargs.get("attention_mask")
            self._attention_mask = (
                mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None)
            if self._autocast is None:
                self._autocast = _autocast_dtype(self.model)

        self._guard(grab)

    def _on_stack_input(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._guard(self._open_round, args, kwargs)

    def _open_round(self, args: tuple, kwargs: dict) -> None:
        hidden = first_tensor(args) if args else None
        if hidden is None:
            hidden = kwargs.get("hidden_states")
        token_ids, self._token_ids = self._token_ids, None
        self._round = None
        self._caches.clear()
        if not isinstance(hidden, torch.Tensor):
            return
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
        self._positions = (
            None if len(positions) == seq else torch.tensor(positions, dtype=torch.long)
        )
        ids = None
        if token_ids is not None and token_ids.shape[-1] == seq:
            ids = token_ids.detach().to("cpu").reshape(batch, seq).numpy()
        keep = self._kept_rows(batch, seq, positions)
        probe_rows = self._choose_probe_rows(batch, len(positions), hidden.shape[-1], keep)
        self._round = Round(
            sample=self.sample, step=self.step, batch=batch, seq=seq,
            positions=np.asarray(positions), token_ids=ids, time=time.time(),
            probe_rows=probe_rows,
        )
        self._rows = None if probe_rows is None else torch.from_numpy(probe_rows.astype(np.int64))
        self._add(schema.STACK_INPUT, schema.BLOCK_SITE, hidden)
        if keep is not None:
            self._add_mask(keep)

    def _kept_rows(self, batch: int, seq: int, positions: list[int]) -> np.ndarray | None:
        """(batch, kept positions): False where the model call's 2-D attention mask excludes
        the row (padding); None when every kept row is attended."""
        mask, self._attention_mask = self._attention_mask, None
        if mask is None or mask.shape[0] != batch or mask.shape[-1] < seq:
            return None
        keep = (mask[:, -seq:].detach().to("cpu")[:, positions] != 0).numpy()
        return None if keep.all() else keep

    def _add_mask(self, keep: np.ndarray) -> None:
        """The excluded rows as a KIND_MASK record (docs/dump-format.md)."""
        array = keep.astype(np.float32).reshape(*keep.shape, 1)
        self._round.tensors.append(Tensor(layer=schema.STACK_INPUT, site=schema.BLOCK_SITE,
                                          array=array, dtype="float32", kind=schema.KIND_MASK))

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
        if self._store is None:
            return np.arange(n_rows)
        k = min(n_rows, -(-self._store // max(1, width)))
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
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self._round is not None:
                self._guard(self._on_output, module, layer, site, args, kwargs, output, last)

        return hook

    def _on_output(self, module, layer, site, args, kwargs, output, last) -> None:
        hidden = first_tensor(output)
        if hidden is None:
            raise TypeError(f"{type(module).__name__} of layer {layer} returned no tensor")
        self._add(layer, site, hidden)
        if self._rows is not None:
            self._probe(module, layer, site, args, kwargs, hidden)
        if site == schema.BLOCK_SITE and self.step == 0:
            self._progress()
        if last:
            self._submit()

    def _probe(self, module, layer, site, args, kwargs, hidden) -> None:
        def seeds(kind: int, probe: int) -> int:
            return probe_seed(self.config.seed, self.sample, layer + 1, site + 1, kind, probe)

        idx = self._layer_of(module) if self.step > 0 else None
        cache = self._caches.get(idx) if idx is not None else None
        if self.step > 0 and cache is None and _has_past(args, kwargs):
            return  # a decode step whose past cannot be reproduced: no replay, clean data only
        self._replaying = True
        try:
            outputs, batched = run_probes(module, args, kwargs, hidden, self.probe_spec, seeds,
                                          cache)
        except Exception:
            if self.step == 0:
                raise
            # a decode replay this module refuses (a cache layout not reproduced): its clean
            # data is kept, the step is not probed
            self.decode_replays_skipped += 1
            return
        finally:
            self._replaying = False
        if batched:
            self.batched_replays += 1
        else:
            self.sequential_replays += 1
        for p in outputs:
            array, logical = to_host(p.output, self._positions, self._rows)
            rms = 0.0
            if p.perturbation is not None:
                d = kept(p.perturbation, self._positions, self._rows).double()
                rms = float(d.pow(2).mean().sqrt())
            self._round.tensors.append(Tensor(
                layer=layer, site=site, array=array, dtype=logical, kind=p.kind, probe=p.probe,
                param=p.param, seed=p.seed, pert_rms=rms, subset=True,
            ))

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
        array, logical = to_host(hidden, self._positions)
        self._round.tensors.append(Tensor(layer=layer, site=site, array=array, dtype=logical))

    def _submit(self) -> None:
        r, self._round = self._round, None
        if self.writer is None:
            self.path = dump_file_name(self.config.dump_path)
            self.writer = DumpWriter(self.path, self._meta(r), self.layer_names, self.site_names)
        if self.writer.error:
            self._fail(f"cannot write {self.writer.path}: {self.writer.error}")
            return
        self.writer.submit(r)

    def _meta(self, first: Round) -> dict:
        param = next(self.model.parameters(), None)
        model_config = getattr(self.model, "config", None)
        to_dict = getattr(model_config, "to_dict", None)
        try:
            import transformers

            tf_version = transformers.__version__
        except Exception:
            tf_version = None
        dtypes = {t.layer: t.dtype for t in first.tensors}
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
            "hidden_width": int(first.tensors[0].array.shape[-1]),
            "device": str(param.device) if param is not None else "cpu",
            "torch_version": torch.__version__,
            "transformers_version": tf_version,
            "python_version": sys.version.split()[0],
            "host": socket.gethostname(),
            "rank": int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0),
            "local_rank": os.environ.get("LOCAL_RANK"),
            "world_size": os.environ.get("WORLD_SIZE"),
            "pid": os.getpid(),
            "command": self.config.command or " ".join(sys.argv),
            "seed": self.config.seed,
            "torch_initial_seed": int(torch.initial_seed()),
            "dump_config": vars(self.config),
            "sites": self.site_names,
            "injected_faults": self.faults,
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
        if self._bar is not None:
            self._bar.close()
        if self.writer is not None:
            try:
                self.path = self.writer.close({
                    "error": self.error, "samples": self.sample + 1,
                    "batched_replays": self.batched_replays,
                    "sequential_replays": self.sequential_replays,
                    "decode_replays_skipped": self.decode_replays_skipped,
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
        atexit.unregister(self.close)
        return self.path

    def __enter__(self) -> CaptureSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        self.remove_faults()


def _has_past(args: tuple, kwargs: dict) -> bool:
    """The call carries a KV cache: a Cache object, or a legacy tuple cache argument."""
    if any(is_cache(v) for v in (*args, *kwargs.values())):
        return True
    return any(v is not None and ("past_key_value" in k or k == "layer_past")
               for k, v in kwargs.items())


def _autocast_dtype(model: nn.Module) -> str:
    """The autocast dtype in force for the model's device type ("" when autocast is off)."""
    param = next(model.parameters(), None)
    device = param.device.type if param is not None else "cpu"
    try:
        if not torch.is_autocast_enabled(device):
            return ""
        return str(torch.get_autocast_dtype(device)).replace("torch.", "")
    except (TypeError, RuntimeError, AttributeError):  # torch < 2.4 has no device argument
        return ""


def _input_embedding(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            module = get()
            if isinstance(module, nn.Module):
                return module
        except Exception:
            pass
    return next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)


def register_hook(model: nn.Module, config: DumpConfig | None = None) -> CaptureSession:
    """Start capturing ``model`` (msit style). Use the result as a context manager, or call
    ``.close()``, to remove the hooks and finish the dump file."""
    return CaptureSession(model, config or DumpConfig())
