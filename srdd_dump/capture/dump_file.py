"""A session's dump file: its name (rank and process), its meta (the model, the libraries, the
precision the matmuls ran in, the capture options), the writer behind it, and its closing."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import Callable

import torch
from torch import nn

from ..format import schema
from ..format.writer import DumpWriter, Round, describe_error
from ..runtime.terminal import say
from ..version import __version__
from .config import DumpConfig
from .model_facts import float32_matmul
from .parallel import env_rank
from .versions import loaded_version

_finished: list[str] = []  # every dump file this process finished, by any session
os.register_at_fork(after_in_child=_finished.clear)


def finished_files() -> list[str]:
    """The dump files this process has finished (or set aside), in order: the sessions of
    srdd-dump and of the program's own register_hook alike."""
    return list(_finished)


class DumpOutput:
    """The file a session writes, opened with its first captured round."""

    def __init__(self, dump_path: str):
        self.dump_path = dump_path
        self.path: str | None = None
        self.writer: DumpWriter | None = None
        self._folder = ""  # the file's folder, absolute when it was opened (a program may cd)

    def submit(self, r: Round, meta, layer_names: list[str], site_names: list[str],
               stat_columns: list[str] | None) -> str | None:
        """Queue a finished round; ``meta()`` gives the file's meta when the first opens it.
        Returns why the file cannot be written (None: queued)."""
        if self.writer is None:
            path = dump_file_name(self.dump_path)
            self._folder = os.path.dirname(os.path.abspath(path))
            self.writer = DumpWriter(path, meta(), layer_names, site_names,
                                     stat_columns=stat_columns)
            self.path = path  # only a file that was opened
        if self.writer.error:
            return f"cannot write {self.writer.path}: {self.writer.error}"
        self.writer.submit(r)
        return None

    def close(self, status: dict) -> str | None:
        """Finish the file with the session's status. Returns why it was not finished (its
        data is then kept in ``path``, the ``.partial`` file), or None."""
        try:
            self.path = self.writer.close(status)
        except Exception as exc:  # runs at exit too: never a traceback in the user's program
            self.path = self.writer.partial_path
            self.writer.error = self.writer.error or describe_error(exc)
        if self.path:
            _finished.append(os.path.join(self._folder, os.path.basename(self.path)))
        return f"cannot write {self.path}: {self.writer.error}" if self.writer.error else None

    def finish_file(self, status: dict) -> str | None:
        """Finish the file now; the next round opens a new one. Returns close's answer."""
        error = self.close(status)
        if not error:
            self.writer = None
        return error

    def forget_after_fork(self) -> None:
        if self.writer is not None:
            self.writer.forget_after_fork()


# A serving engine is stopped by killing its workers (vLLM: SIGKILL to the process tree), so a
# file still open then would never be finished: after this long without a forward, the file is
# finished, and a later request starts the next one. Long enough that a stall of a busy host
# between two decode steps does not split the requests under way between two files (2 s did,
# on a loaded 2-core machine, and their halves could not be compared).
IDLE_FINISH_SECONDS = 10.0


class FileWatch:
    """A thread of the capturing process that finishes its file: ``idle()`` once the engine
    has been idle ``seconds`` after the last ``touch``, ``now()`` as soon as srdd-dump asks
    (``request``: a file that appears when srdd-dump is sent SIGINT or SIGTERM)."""

    def __init__(self, idle: Callable[[], None], now: Callable[[], None],
                 request: str | None, seconds: float = IDLE_FINISH_SECONDS):
        self.idle, self.now, self.request, self.seconds = idle, now, request, seconds
        self._last: float | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="srdd-file-watch",
                                            daemon=True)
            self._thread.start()

    def touch(self) -> None:
        self._last = time.monotonic()
        self.start()

    def busy(self) -> None:
        """The engine ran a forward (captured or not: a chunk of a long prefill): an idle wait
        under way starts again."""
        if self._last is not None:
            self._last = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        try:
            while not self._stop.wait(0.2):
                if self.request and os.path.exists(self.request):
                    self.now()
                    return
                last = self._last
                if last is not None and time.monotonic() - last >= self.seconds:
                    self._last = None
                    self.idle()
        except Exception as exc:  # noqa: BLE001 (a thread in the user's program: never a
            # traceback; the file stays .partial, which srdd-dump and srdd-compare report)
            say(f"srdd-dump: warning: cannot finish the dump file: "
                             f"{describe_error(exc)}\n")


def dump_file_name(dump_path: str) -> str:
    """A new file in ``dump_path`` named by this process's rank and pid."""
    rank = env_rank()
    base = os.path.join(dump_path, f"srdd_rank{rank}_pid{os.getpid()}")
    path, n = base + schema.FILE_SUFFIX, 1
    while os.path.exists(path) or os.path.exists(path + schema.PARTIAL_SUFFIX):
        path, n = f"{base}_{n}{schema.FILE_SUFFIX}", n + 1
    return path


def dump_meta(model: nn.Module, layer_names: list[str], block: nn.Module, config: DumpConfig,
              first: Round, *, width: int, autocast: str | None, sites: list, faults: list,
              tensor_parallel: dict) -> dict:
    """The file's meta (docs/dump-format.md), from the model and the first captured round."""
    param = next(model.parameters(), None)
    model_config = getattr(model, "config", None)
    to_dict = getattr(model_config, "to_dict", None)
    dtypes = {t.layer: t.dtype for t in first.tensors}
    for row in first.stats:
        dtypes.setdefault(row.layer, schema.DTYPE_CODES[row.dtype])
    return {
        "tool": "srdd-dump",
        "tool_version": __version__,
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "layers": layer_names,
        "block_class": type(block).__name__,
        "param_dtype": str(param.dtype).replace("torch.", "") if param is not None else None,
        "hidden_dtype": dtypes.get(0),
        # torch.autocast around the model: the precision the matmuls ran in, below the dtype
        # of the recorded tensors (the compare judges rounding by it)
        "autocast_dtype": autocast or None,
        # fp32 matmuls in a shorter format (TF32 / HF32 / bf16 passes): the compare judges
        # rounding by it
        "float32_matmul": float32_matmul(param.device.type if param is not None else "cpu"),
        "hidden_width": width,
        "device": str(param.device) if param is not None else "cpu",
        "torch_version": torch.__version__,
        "transformers_version": loaded_version("transformers"),  # never imported here
        "python_version": sys.version.split()[0],
        "host": socket.gethostname(),
        "rank": env_rank(),
        "local_rank": os.environ.get("LOCAL_RANK"),
        "world_size": os.environ.get("WORLD_SIZE"),
        "pid": os.getpid(),
        "command": config.command or " ".join(sys.argv),
        "seed": config.seed,
        "torch_initial_seed": int(torch.initial_seed()),
        "dump_config": vars(config),
        "sites": [site.name for site in sites],
        "site_roles": [site.role for site in sites],
        "injected_faults": faults,
        "tensor_parallel": tensor_parallel,
        "model_config": to_dict() if callable(to_dict) else None,
        "started": time.time(),
    }
