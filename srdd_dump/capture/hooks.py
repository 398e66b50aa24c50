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

from .. import config as cfg
from ..config import DumpConfig
from ..format import schema
from ..format.writer import DumpWriter, Round, Tensor
from ..version import __version__
from .discovery import find_blocks

_TORCH_TO_LOGICAL = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
}


def first_tensor(value: Any) -> torch.Tensor | None:
    """The hidden state in a block's input or output: a tensor, or the first tensor of a
    tuple/list/ModelOutput."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        for item in value:
            if isinstance(item, torch.Tensor):
                return item
    return None


def to_host(t: torch.Tensor, positions: torch.Tensor | None) -> tuple[np.ndarray, str]:
    """Copy (batch, seq, width) hidden states of the kept positions to a numpy array in storage
    dtype. Always a copy: the user's tensor may be changed in place later."""
    t = t.detach()
    if t.dim() == 2:
        t = t.unsqueeze(0)
    elif t.dim() != 3:
        t = t.reshape(t.shape[0], -1, t.shape[-1])
    if positions is not None:
        t = t.index_select(-2, positions.to(t.device))
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
    """Hooks on one model; a context manager that removes them and finalises the dump."""

    def __init__(self, model: nn.Module, config: DumpConfig):
        self.model = model
        self.config = config
        self.blocks = find_blocks(model, config.layers)
        self.layer_names = [name for name, _ in self.blocks]
        self._steps = cfg.parse_steps(config.steps)
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
        self._handles: list[Any] = []
        self._closed = False
        self._install()
        atexit.register(self.close)

    # -- hooks ----------------------------------------------------------------------------
    def _install(self) -> None:
        embed = _input_embedding(self.model)
        if embed is not None:
            self._handles.append(embed.register_forward_pre_hook(self._on_embedding))
        first = self.blocks[0][1]
        self._handles.append(
            first.register_forward_pre_hook(self._on_stack_input, with_kwargs=True)
        )
        for index, (_, block) in enumerate(self.blocks):
            self._handles.append(block.register_forward_hook(self._output_hook(index)))

    def _guard(self, fn, *args) -> None:
        if self._closed:
            return
        try:
            fn(*args)
        except Exception as exc:  # capture must never break the user's program
            self._fail(f"{type(exc).__name__}: {exc}")

    def _on_embedding(self, module: nn.Module, args: tuple) -> None:
        def grab() -> None:
            ids = args[0] if args else None
            if isinstance(ids, torch.Tensor) and not ids.is_floating_point():
                self._token_ids = ids

        self._guard(grab)

    def _on_stack_input(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._guard(self._open_round, args, kwargs)

    def _open_round(self, args: tuple, kwargs: dict) -> None:
        hidden = first_tensor(args) if args else None
        if hidden is None:
            hidden = kwargs.get("hidden_states")
        token_ids, self._token_ids = self._token_ids, None
        self._round = None
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
        self._round = Round(
            sample=self.sample, step=self.step, batch=batch, seq=seq,
            positions=np.asarray(positions), token_ids=ids, time=time.time(),
        )
        self._add(schema.STACK_INPUT, hidden)

    def _output_hook(self, index: int):
        last = index == len(self.blocks) - 1

        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if self._round is not None:
                self._guard(self._on_output, index, output, last)

        return hook

    def _on_output(self, index: int, output: Any, last: bool) -> None:
        hidden = first_tensor(output)
        if hidden is None:
            raise TypeError(f"block {self.layer_names[index]} returned no tensor")
        self._add(index, hidden)
        if last:
            self._submit()

    # -- rounds ---------------------------------------------------------------------------
    def _add(self, layer: int, hidden: torch.Tensor) -> None:
        array, logical = to_host(hidden, self._positions)
        self._round.tensors.append(Tensor(layer=layer, array=array, dtype=logical))

    def _submit(self) -> None:
        r, self._round = self._round, None
        if self.writer is None:
            self.path = dump_file_name(self.config.dump_path)
            self.writer = DumpWriter(self.path, self._meta(r), self.layer_names)
        if self.writer.error:
            raise OSError(f"writing {self.writer.partial_path} failed: {self.writer.error}")
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
            "model_config": to_dict() if callable(to_dict) else None,
            "started": time.time(),
        }

    # -- lifecycle ------------------------------------------------------------------------
    def _fail(self, reason: str) -> None:
        self.error = reason
        sys.stderr.write(f"srdd-dump: warning: capture turned off: {reason}\n")
        self.close()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def close(self) -> str | None:
        """Remove the hooks and finalise the dump file. Returns its path (None if empty)."""
        if self._closed:
            return self.path
        self._closed = True
        self.remove()
        if self.writer is not None:
            self.path = self.writer.close({"error": self.error, "samples": self.sample + 1})
            if self.writer.error and not self.error:
                self.error = f"writing {self.path} failed: {self.writer.error}"
        atexit.unregister(self.close)
        return self.path

    def __enter__(self) -> CaptureSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
