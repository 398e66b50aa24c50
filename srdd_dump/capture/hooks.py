"""The in-code capture API: ``register_hook(model, DumpConfig(...))``.

One idea: a forward pre-hook on the first block opens a *round* (one forward of the model),
a forward hook on every block copies its output hidden state to the host, and the last block's
hook hands the finished round to the writer thread. Hooks only read; they never return a
value, so the user's program computes exactly what it computes without them.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from ..errors import UserError
from ..format import schema
from ..format.coverage import Coverage
from ..format.layer_numbers import site_pattern
from ..format.writer import Round, describe_error
from ..runtime.terminal import LazyBar, say
from ..vocabulary import BLOCK, EXPERTS, ROUTER, sublayer_kind
from . import config as cfg
from . import requests, serving
from .attention_reference import attention_layouts, first_call_padding, one_query_keys
from .compiled import (
    called_from_compiled,
    explain_partial,
    explain_silence,
    opaque,
    opaque_method,
    skip_hook_frames,
)
from .config import DumpConfig
from .discovery import Site, find_blocks
from .diskspace import refuse_a_file
from .dump_file import DumpOutput, FileWatch, dump_meta
from .evidence import expect_sites, levels_of, never_run
from .faults import install_faults
from .history import TokenHistory
from .host import HOOK_TABLES
from .host_weights import HostWeights
from .mlp_reference import MlpReference
from .model_facts import (
    autocast_dtype,
    cached_tokens,
    has_past,
    input_embedding,
    sites_of,
    starts_sequence,
)
from .moe_capture import ExpertCapture
from .option_names import option
from .parallel import TensorParallel, to_local
from .probes import ProbeSpec, first_tensor, module_output
from .replays import Replays
from .roles import INPUT, OUTPUT, PENDING, role_capture
from .rounds import RoundContext, RoundPlanner, drop_misshapen, split_round
from .sinks import make_sink
from .versions import untested_notes

# torch calls a module's hooks as they were when its call began: a hook its session removed
# meanwhile (the session closed inside the call, its last sample done) is then called without
# its keyword arguments, so the last parameter of a with_kwargs hook defaults to this or None
# and the hook does nothing
REMOVED = object()
MAX_NAMED = 20  # sites left out named in the status, at most
# the coverage family of prefills after a cached past that would have taken the probes
CONTINUED = "continued prefill probes"
# forwards that recompute the last prefill with one more token (no KV cache)
NO_CACHE = "decode steps with a KV cache"
# forwards of the model run by other threads than the captured one
OTHER_THREADS = "forwards of other threads"


def _continues(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    """A model call that continues a sequence: its KV cache holds earlier tokens, or it has a
    past whose length cannot be read."""
    past = cached_tokens(module, args, kwargs, read_device=True)
    return bool(past) if past is not None else has_past(args, kwargs)


def _alive(thread: threading.Thread) -> bool:
    try:
        return thread.is_alive()
    except Exception:  # noqa: BLE001 (a foreign thread's record after a fork)
        return False


# Nothing of this module holds a session strongly: a program that drops its model (del model;
# gc.collect()) frees it, the session with it (its hooks are the model's), and the session
# finishes its file then (CaptureSession.__del__).
# id(block) -> the open session whose hooks are on it: one session per block at a time
_open: weakref.WeakValueDictionary[int, CaptureSession] = weakref.WeakValueDictionary()
if hasattr(os, "register_at_fork"):  # a forked child's sessions are its parent's, not open here
    os.register_at_fork(after_in_child=_open.clear)
_unclosed: weakref.WeakSet[CaptureSession] = weakref.WeakSet()  # closed at exit
_dropped: list[CaptureSession] = []  # dropped outside the main thread: closed at exit
if hasattr(os, "register_at_fork"):  # a forked child's sessions are its parent's
    os.register_at_fork(after_in_child=_dropped.clear)


def close_dropped() -> None:
    """Close the sessions dropped outside the main thread (their collection clears every weak
    reference to them: only this list finds them). Called at exit, and by srdd-dump's report
    on the paths that end without the exit handlers (SIGTERM, a forked child's os._exit)."""
    while _dropped:
        _dropped.pop().close()


@atexit.register
def _close_at_exit() -> None:
    # the error that ended the program, if one did: Python keeps the exception it printed
    # (sys.last_exc, 3.12; sys.last_value before) when its exit handlers run; an interactive
    # session keeps an earlier cell's error there too
    interactive = hasattr(sys, "ps1") or "IPython" in sys.modules
    ended = None if interactive else _ended_by(
        getattr(sys, "last_exc", None) or getattr(sys, "last_value", None))
    mark_ended(ended)
    close_dropped()
    for session in list(_unclosed):
        session.close()


def mark_ended(how: str | None) -> None:
    """Every open session's program ends now, ``how`` (its status ``program_error``; None:
    as it should)."""
    for session in [*_unclosed, *_dropped]:
        session.program_error = session.program_error or how


def _ended_by(exc: object) -> str | None:
    """The line a dump keeps of the exception that ended its program (None: none did, or a
    ``sys.exit``, whose exit code the program's caller has)."""
    if isinstance(exc, KeyboardInterrupt):
        return "KeyboardInterrupt (Ctrl-C)"
    if isinstance(exc, BaseException) and not isinstance(exc, (SystemExit, GeneratorExit)):
        return describe_error(exc)
    return None


def _weakly(method: Callable[[], Any]) -> Callable[[], None]:
    """``method`` of an object, called while the object lives (a thread's callback that must
    not keep its session alive)."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()

    return call


@dataclass
class SessionEnd:
    """What a session leaves when it closes, for a report made after it is gone."""

    samples: int = 0
    error: str | None = None
    silence: str | None = None
    blocks_unseen: bool = False  # compiled.Silence.blocks_unseen
    degraded: list[str] = field(default_factory=list)
    version_notes: list[str] = field(default_factory=list)


class AlreadyCaptured(Exception):
    """The model's blocks carry the hooks of another open session (``session``)."""

    def __init__(self, session: CaptureSession):
        super().__init__("its blocks are captured by another open session")
        self.session = session


class InertSession:
    """What ``register_hook`` returns for a model another open session of the program captures
    (an earlier ``register_hook``): it records nothing; that session's file is the dump."""

    error = None
    degraded: list[str] = []
    samples = 0

    def __init__(self, other: CaptureSession):
        self.other = other

    @property
    def path(self) -> str | None:
        return None

    def close(self) -> None:
        return None

    def remove(self) -> None:
        return None

    def remove_faults(self) -> None:
        return None

    @property
    def faults(self) -> list:
        return []

    def __enter__(self) -> InertSession:
        return self

    def __exit__(self, *exc) -> None:
        return None


class CaptureSession:
    """Hooks on one model; a context manager that removes them and finalises the dump.

    ``path`` is the dump file (set when the first sample is captured); closing the session
    prints it on stderr, as srdd-dump does.
    """

    def __init__(self, model: nn.Module, config: DumpConfig):
        with config.naming():  # errors name what the user gave: flags or fields
            self._attach(model, config)

    def _attach(self, model: nn.Module, config: DumpConfig) -> None:
        self.model = model
        self.config = config
        self.options = options = config.parsed()  # the text options, parsed once
        self.blocks = find_blocks(model, config.layers)
        other = next((_open[id(b)] for _, b in self.blocks if id(b) in _open), None)
        if other is not None:
            raise AlreadyCaptured(other)
        self.layer_names = [name for name, _ in self.blocks]
        self.sites = sites_of(model, self.blocks, config)
        self.site_names = [site.name for site in self.sites]
        self.coverage = Coverage()  # which evidence was asked for and which was got
        self._coverage_filed: dict = {}  # its counts when the last file was finished
        expect_sites(self.coverage, self.sites, len(self.blocks), config.granularity)
        self._tp = TensorParallel(model, [m for _, m in self.blocks]
                                  + [site.module for site in self.sites], config.tp_replays)
        self.probe_spec = ProbeSpec.of(config)
        self._rounds = RoundPlanner(config, bool(options.probes) or config.reference == "host")
        # blocks of the (hidden_states, residual) convention; the inputs of modules that may
        # overwrite them (a fused add + norm, an in-place rotary), copied before they run
        # (serving.py)
        self._serving = {id(m) for _, m in self.blocks if serving.is_serving_block(m)}
        self._fused = {id(m) for m in (*(b for _, b in self.blocks),
                                       *(site.module for site in self.sites))
                       if serving.overwrites_inputs(m)}
        self._frozen: dict[int, tuple[tuple, dict]] = {}
        # sites of a module several blocks hold (vLLM's shared rotary embedding): it runs once
        # per layer, and its one site records the round's first call
        held = [{id(m) for m in block.modules()} for _, block in self.blocks]
        self._once = {i for i, site in enumerate(self.sites)
                      if sum(id(site.module) in ids for ids in held) > 1}
        self._seen: set[int] = set()  # the sites of _once recorded this round
        self._pending: list[tuple[int, Site, torch.Tensor, tuple, dict]] = []
        self.records_dropped = 0
        self.dropped_sites: set[int] = set()  # sites whose outputs were left out (their shape)
        self.site_errors = 0
        self._sink = make_sink(options.store, self.probe_spec, config.seed)
        self._moe = ExpertCapture.of(self.sites, self._sink, self.probe_spec)
        self.replays = Replays(
            [m for _, m in self.blocks], self.sites, self.probe_spec, self._sink,
            self.coverage, self._tp, host=config.reference == "host",
            serving_blocks=self._serving, moe=self._moe, levels=levels_of(self.sites),
            attention=attention_layouts(model, [
                s.module for s in self.sites if sublayer_kind(s.role, s.name) == "attention"]),
            mlp=MlpReference([s.module for s in self.sites
                              if sublayer_kind(s.role, s.name) == "mlp"], HostWeights(),
                             getattr(model, "config", None)))
        self.degraded: list[str] = []  # coverage.shortfalls() at close
        self.version_notes = untested_notes()  # libraries outside the tested range
        self.end = SessionEnd(version_notes=self.version_notes)  # filled when it closes
        if self.version_notes and not os.environ.get(cfg.ENV_CONFIG):
            for note in self.version_notes:  # under --exec the command says it once
                say(f"srdd-dump: note: {note}\n")
        self._width = 0
        self._bar = LazyBar(config.samples * len(self.blocks), "srdd-dump", "layer",
                            config.progress)
        self._fault_handles, self.faults = install_faults(model, self.blocks, config.faults())
        self.error: str | None = None
        # the error that ended the program (or the session's with block) while capturing
        self.program_error: str | None = None
        self.silence: str | None = None  # why nothing was captured (compiled.explain_silence)
        self.blocks_unseen = False
        self.model_calls = 0  # forwards of the model and of its first block the hooks saw
        self.failed_calls = 0  # model calls that raised before their round was finished
        self._rounds_written = 0
        # the plan before this model call, the rounds written then and the exception being
        # handled when it began (if any)
        self._call_mark: tuple | None = None
        self._lost: RoundContext | None = None  # the last round whose forward raised
        self.block_calls = 0
        self._fired: set[tuple[int, int]] = set()  # (layer, site) whose hook ran in a round
        # where the folder is when the session opens, whatever the program's later os.chdir
        self.output = DumpOutput(os.path.abspath(config.dump_path))
        self._lock = threading.RLock()  # the hooks' thread and the idle finish
        self._owner: threading.Thread | None = None  # the thread whose forwards are captured
        self._owner_busy = False  # it is inside a model call
        status_dir = os.environ.get(cfg.ENV_STATUS_DIR)
        self._stop_asked = False  # srdd-dump asked this process to finish its file
        self._watch = FileWatch(_weakly(self._finish_idle_file), _weakly(self._finish_asked),
                                status_dir and os.path.join(status_dir, cfg.FINISH_REQUEST))
        self._ctx: RoundContext | None = None  # the round being captured
        self._token_ids: torch.Tensor | None = None
        self._last_prompt: np.ndarray | None = None  # the token ids of the last prefill
        self._continued_waiting = 0  # prefills after a cached past whose probes wait
        self._history = TokenHistory()  # every forward's input ids (history.py)
        self._attention_mask: torch.Tensor | None = None  # (batch, past + seq) of the model call
        self._mask_unread = False  # the model call's mask was of another form
        # the keys a one-token call's 4-D mask attends (a static cache's decode step), 2-D
        self._one_query_keys: torch.Tensor | None = None
        self._autocast: str | None = None  # "" when the first model call ran without autocast
        self._handles: list[Any] = []
        self._copy_said = False
        # set by srdd-dump --exec's watcher on the session it made: a later register_hook of
        # the program takes the model over and is given to it (inject/attach.py)
        self.on_hand_over: Callable[[CaptureSession], None] | None = None
        self._pid = os.getpid()  # a forked child's copy of the session is not its own
        self._closed = True  # until its hooks are all in place (a half-built one is not closed)
        skip_hook_frames()
        self._install()
        self._closed = False
        _open.update((id(b), self) for _, b in self.blocks)
        _unclosed.add(self)

    @property
    def samples(self) -> int:
        """Samples seen so far: prefill forwards, or a serving engine's requests (the first
        --samples of them are captured)."""
        return self._rounds.samples_seen

    # -- hooks ----------------------------------------------------------------------------
    def _install(self) -> None:
        self._handles.append(
            self.model.register_forward_pre_hook(self.on_model_call, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(self._on_model_done,
                                                              always_call=True))
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

    def _elsewhere(self) -> bool:
        """The call runs in another thread than the one whose forwards the session captures:
        it runs uncaptured, since forwards of several threads at once would interleave one
        sample's rounds with another's (``_take_model_call`` moves the capture from thread
        to thread)."""
        me = threading.current_thread()
        if self._owner is me:
            return False
        with self._lock:
            if self._owner is None or not _alive(self._owner):
                self._owner, self._owner_busy = me, False
                return False
        return True

    def _take_model_call(self, module: nn.Module, args: tuple, kwargs: dict) -> bool:
        """A model call: captured when it runs in the captured thread, or starts a sequence
        (no cached past) while that thread is not inside a model call (threads that take turns:
        a server's pool); then its thread is the captured one. Another thread's decode step,
        or any call while the captured thread is inside one, runs uncaptured."""
        me = threading.current_thread()
        if self._owner is me:
            self._owner_busy = True
            return True
        with self._lock:
            owner = self._owner
            if owner is not None and _alive(owner) and (
                    self._owner_busy or _continues(module, args, kwargs)):
                return False
            self._owner, self._owner_busy = me, True
            return True

    @opaque_method
    def _on_model_done(self, module: nn.Module, args: tuple, output: Any = None) -> None:
        if self._owner is not threading.current_thread():
            return
        mark, self._call_mark = self._call_mark, None
        # torch runs this hook with no output inside its handler of the call's exception (one
        # the call did not start inside: a call made in the program's own except block)
        exc = sys.exc_info()[1]
        if (output is None and exc is not None and mark is not None and exc is not mark[2]
                and not (self._closed or self.replays.active)):
            self._forget_failed_call(mark, exc)
        self._owner_busy = False  # after: another thread may start a sequence from here

    def _forget_failed_call(self, mark: tuple, exc: BaseException) -> None:
        """The model call raised (a harness may catch it and go on to its next sample): a
        round it opened and did not finish is dropped, and the call counts as no sample or
        step, so the next forward takes its place and its probes. Never raises, and never
        closes the session: it runs inside torch's handler of the program's exception."""
        try:
            with self._lock:
                if mark[1] != self._rounds_written or self._rounds.requests.requests:
                    return  # a round of it was written (it raised after its last block)
                if self._ctx is None and self._rounds.mark()[:2] == mark[0][:2]:
                    return  # it raised before its blocks ran (in the embedding): nothing to undo
                if self._ctx is not None:  # the close says why nothing was written, if so
                    self._lost, self._ctx.round.tensors, self._ctx.key_mask = self._ctx, [], None
                self._rounds.undo(mark[0])
                self._history.undo(mark[3])
                self._clear_round()  # its kept caches and input copies go now
                self._pending = []
            self.failed_calls += 1
            if self.failed_calls == 1:
                what = str(exc).splitlines()[0][:80] if str(exc) else ""
                say(f"srdd-dump: note: a forward of the model raised ({type(exc).__name__}"
                    f"{': ' + what if what else ''}): its round is not kept and does not "
                    "count as a sample\n")
        except Exception:  # noqa: BLE001 (the program's own exception goes on unchanged)
            pass

    def _clear_round(self, compiled: bool = False) -> None:
        """What a round holds between its hooks' calls, let go: a new round opens, or the
        call of the last one raised."""
        self.replays.open_round(compiled)
        self._ctx = None
        if self._moe is not None:
            self._moe.open_round()
        self._frozen.clear()
        self._seen.clear()

    def _guard(self, fn, *args) -> None:
        if self._closed or self.replays.active:
            return
        try:
            fn(*args)
        except Exception as exc:  # capture must never break the user's program
            if self.config.debug:
                traceback.print_exc()
            self._fail(describe_error(exc))

    @opaque_method
    def _on_embedding(self, module: nn.Module, args: tuple) -> None:
        if self._elsewhere():
            return
        def grab() -> None:
            ids = args[0] if args else None
            if isinstance(ids, torch.Tensor) and not ids.is_floating_point():
                self._token_ids = ids

        self._guard(grab)

    @opaque_method
    def _on_module_call(self, module: nn.Module, args: tuple, kwargs: dict | None = None
                        ) -> None:
        """A decode step that will be probed: keep the layer's KV cache as it is before the
        call updates it, so the replays see what the device saw. (``kwargs`` is None when the
        session closed itself inside this very call: torch then calls the hook without.)"""
        if kwargs is None or self._elsewhere():
            return
        ctx = self._ctx
        if ctx is None or not ctx.probed:
            return
        if id(module) in self._fused:
            self._guard(self._freeze, module, args, kwargs)
        if ctx.step > 0:
            self._guard(self.replays.keep_cache, module, args, kwargs)

    def _freeze(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._frozen[id(module)] = serving.frozen_call(module, args, kwargs)

    @opaque_method
    def on_model_call(self, module: nn.Module, args: tuple, kwargs: dict | None = None
                      ) -> None:
        """The model's own pre-hook (the forward watcher calls it for the call during which
        the session was made): counts the call, keeps its attention mask."""
        if kwargs is None:  # removed inside this very call (REMOVED)
            return
        if module is not self.model and self._a_copy_ran(module):
            return
        if not self._take_model_call(module, args, kwargs):
            if not self._closed:
                self.coverage.expect(OTHER_THREADS)
                self.coverage.failed(OTHER_THREADS, (
                    "the model ran in several threads at once: the forwards of one thread "
                    "at a time are captured (a thread's sample from its prefill on), the "
                    "others ran uncaptured"))
            return
        if not self._closed:
            self.model_calls += 1
            self._call_mark = (self._rounds.mark(), self._rounds_written, sys.exc_info()[1],
                               self._history.mark())

        def grab() -> None:
            mask = kwargs.get("attention_mask")
            if mask is None and len(args) > 1 and isinstance(args[1], torch.Tensor):
                mask = args[1]  # model(input_ids, attention_mask): a CausalLM's order
            self._attention_mask = (
                mask if isinstance(mask, torch.Tensor) and mask.dim() == 2
                else first_call_padding(mask))
            self._one_query_keys = one_query_keys(mask)
            # a mask srdd-dump cannot read the padding of (4-D over several query rows, a dict
            # of masks, a block mask): the reference attention of the round stays off
            self._mask_unread = (mask is not None and self._attention_mask is None
                                 and self._one_query_keys is None)
            if self._autocast is None:
                self._autocast = autocast_dtype(self.model)

        self._guard(grab)

    def _a_copy_ran(self, copy: nn.Module) -> bool:
        """A copy of the model (``copy.deepcopy``) carries the capture hooks' table entries:
        they are taken out of it, so the copy runs uncaptured from this call on, as any model
        after the first (its forwards would otherwise land in this dump as the model's own
        samples), and that is said once. False for a replica sharing the model's tables
        (DataParallel's): it runs as the model, as before."""
        if all(getattr(copy, name, None) is getattr(self.model, name, None)
               for name in HOOK_TABLES):
            return False
        ours = {h.id for h in self._handles}
        for module in copy.modules():
            for name in HOOK_TABLES:
                table = getattr(module, name, None)
                for key in ours.intersection(table or ()):
                    del table[key]
        if not self._copy_said:
            self._copy_said = True
            say(
                f"srdd-dump: note: a copy of the captured model ran ({type(copy).__name__}, "
                f"copy.deepcopy, pid {os.getpid()}): it runs uncaptured; the dump holds the "
                "model capture attached to\n")
        return True

    @opaque_method
    def _on_stack_input(self, module: nn.Module, args: tuple, kwargs: dict | None = None
                        ) -> None:
        if kwargs is None or self._elsewhere():  # removed inside this very call (REMOVED)
            return
        if not (self._closed or self.replays.active):
            self.block_calls += 1
            self._watch.busy()
        with self._lock:
            self._guard(self._open_round, module, args, kwargs)

    def _open_round(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if id(module) in self._serving:
            hidden = serving.stream_input(module, args, kwargs)
        else:
            hidden = first_tensor(args) if args else None
            if hidden is None:
                hidden = kwargs.get("hidden_states")
        token_ids, self._token_ids = self._token_ids, None
        mask, self._attention_mask = self._attention_mask, None
        unread, self._mask_unread = self._mask_unread, False
        self._clear_round(called_from_compiled())
        layout, positions, unsplit = (requests.read_batch(serving.named_input(
            module, args, kwargs, serving.POSITIONS)[0]) if id(module) in self._serving
            else (None, None, None))
        if layout == requests.DUMMY or not isinstance(hidden, torch.Tensor):
            return  # an engine's dummy, profile or warm-up forward is never a sample
        hidden = self._tp.local(hidden, "stack input")
        self._width = int(hidden.shape[-1])
        batch = hidden.shape[0] if hidden.dim() >= 3 else 1
        seq = hidden.shape[-2] if hidden.dim() >= 2 else 1
        if positions is not None and not unsplit:
            self._ctx = self._rounds.open_requests(layout, positions, seq, self._width,
                                                   token_ids, self._sink.round_rows)
            calls, self._rounds.request_calls = self._rounds.request_calls, []
            for why in calls:
                self.coverage.expect("request samples")
                if why is None:
                    self.coverage.ran("request samples")
                else:
                    self.coverage.failed("request samples", why)
            if self._ctx is RoundPlanner.DONE:
                self._ctx = None
                self.close()  # the first --samples requests are done: stop paying for hooks
                return
        else:
            if unsplit:  # a serving batch written as one sample
                self.coverage.expect("request samples")
                self.coverage.failed("request samples", unsplit)
            # a one-token prompt: its attention mask, if any, spans that token alone (a
            # decoding loop that dropped its cache still spans the earlier ones) and its cache
            # is empty
            spans_one = mask.shape[-1] == 1 if mask is not None else not unread
            starts = seq == 1 and spans_one and starts_sequence(module, args, kwargs)
            past = self._past(module, args, kwargs, seq, mask)
            # a sample that had no decode step, then its ids and one more, with no cache (or
            # an empty one: transformers 5 makes one for a plain model(ids) call)
            if (seq > 1 and not past and self._rounds.step == 0
                    and self._recomputes(token_ids)):
                self.coverage.expect(NO_CACHE)
                self.coverage.failed(NO_CACHE, (
                    "each new token recomputed the whole sequence (no KV cache: generate("
                    "use_cache=False)?): each such forward is counted as a sample and no "
                    "decode step is captured"))
            if not self._rounds.advance(seq, starts, continues=bool(past)):
                self.close()  # everything asked for is captured: stop paying for hooks
                return
            if self._rounds.step == 0:
                self._history.start()
            if self._rounds.step <= self._rounds.options.last_step:  # none recorded after
                self._history.add(token_ids)
            self._ctx = self._rounds.open(batch, seq, self._width, token_ids, mask,
                                          self._sink.round_rows)
            if self._ctx is not None:
                self._history.record(self._ctx.sample, self._ctx.step)
            if self._rounds.unprobed_continuation:
                self.coverage.expect(CONTINUED)
                self.coverage.failed(CONTINUED, (
                    f"a forward of {seq} tokens after {past} cached ones (a later chat turn, a "
                    "speculative or prompt-lookup verification) is captured without probes, "
                    "and no later prompt took them"))
                self._continued_waiting += 1
            elif (self._continued_waiting and self._ctx is not None and self._ctx.probed
                  and self._rounds.step == 0):
                self.coverage.ran(CONTINUED)  # a later prompt took the probes it passed on
                self._continued_waiting -= 1
        if self._ctx is None:
            return
        self._ctx.mask_unread = unread
        keys, self._one_query_keys = self._one_query_keys, None
        if keys is not None and self._ctx.key_mask is None:
            self._ctx.key_mask = keys.expand(batch, -1) if keys.shape[0] == 1 else keys
        self._sink.open_round(self._ctx)
        self._add(schema.STACK_INPUT, schema.BLOCK_SITE, hidden)
        self._finish_site(schema.STACK_INPUT, schema.BLOCK_SITE)
        self._add_pending()

    @staticmethod
    def _past(module: nn.Module, args: tuple, kwargs: dict, seq: int,
              mask: torch.Tensor | None) -> int | None:
        """Earlier tokens a forward of several tokens attends through its KV cache: the
        cache's own length, else (a length kept on the device) what the 2-D attention mask
        spans beyond the call or where the call's positions start; None without a cache (or
        for one token)."""
        if seq < 2:
            return None
        if mask is not None and mask.shape[-1] > seq:
            return int(mask.shape[-1] - seq)
        return cached_tokens(module, args, kwargs, read_device=True)

    def _recomputes(self, token_ids: torch.Tensor | None) -> bool:
        """This prefill's token ids are the last prefill's and one more token in every row
        (a generation that keeps no KV cache)."""
        if token_ids is None or token_ids.dim() != 2:
            return False
        ids, last = token_ids.detach().to("cpu").numpy(), self._last_prompt
        self._last_prompt = ids
        return (last is not None and ids.shape == (last.shape[0], last.shape[1] + 1)
                and bool((ids[:, :-1] == last).all()))

    def _output_hook(self, layer: int, site: int, last: bool):
        @opaque
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any = REMOVED) -> None:
            if self._ctx is None or output is REMOVED or self._elsewhere():
                return
            if not self.replays.active:
                self._fired.add((layer, site))
            if site == schema.BLOCK_SITE:
                self._guard(self._on_output, module, layer, site, args, kwargs, output, last)
            elif site not in self._once:
                self._guard(self._site_guarded, module, layer, site, args, kwargs, output)
            elif site in self._seen or self.replays.active or self._ctx is None:
                self._frozen.pop(id(module), None)  # a later layer's call of a shared module
            else:
                self._seen.add(site)
                self._guard(self._site_guarded, module, layer, site, args, kwargs, output)

        return hook

    def _site_guarded(self, module, layer, site, args, kwargs, output) -> None:
        """A sub-layer or operator: one that cannot be captured (an error in its replay, an
        output not shaped like the round's tokens) is skipped and counted; the blocks and
        the rest of the session go on."""
        try:
            self._on_output(module, layer, site, args, kwargs, output, False)
        except Exception:  # noqa: BLE001 (counted in the dump's status)
            self.site_errors += 1

    def _input_hook(self, layer: int, site: int):
        @opaque
        def hook(module: nn.Module, args: tuple, kwargs: dict | None = None) -> None:
            if self._ctx is not None and kwargs is not None and not self._elsewhere():
                if not self.replays.active:
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
                self.dropped_sites.add(site)

    def _pending_hook(self, index: int):
        @opaque
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any = REMOVED) -> None:
            if output is REMOVED or self._elsewhere():
                return

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
            shaped = self._ctx.round_shaped(out)
            if shaped is None:
                continue  # a table for other positions than this round's: not comparable
            self._add(site.layer, index, shaped)
            if self.replays.host and self._ctx.probed:
                self.replays.host_record(site.module, site.layer, index, args, kwargs, None,
                                         self._ctx, rows=None)
            self._finish_site(site.layer, index)

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
            self.dropped_sites.add(site)
            return
        self._add(layer, site, hidden)
        try:
            self.replays.replay(module, layer, site, args, kwargs, hidden, self._ctx)
        finally:
            if not self.replays.finishes_later(layer, site):
                self._finish_site(layer, site)
        if site == schema.BLOCK_SITE and self._ctx.step == 0:
            self._bar.update(1)
        if last:
            self._submit()

    # -- rounds ---------------------------------------------------------------------------
    def _add(self, layer: int, site: int, hidden: torch.Tensor) -> None:
        self._sink.clean(self._ctx, layer, site, hidden)

    def _finish_site(self, layer: int, site: int) -> None:
        if self._ctx is not None:
            self._sink.finish_site(self._ctx, layer, site)

    def _submit(self) -> None:
        with self._lock:
            ctx, self._ctx = self._ctx, None
            # its round is done: another thread may start a sequence even if this call's end
            # is never seen (a KeyboardInterrupt skips the model's always_call hook)
            self._owner_busy = False
            if self._closed:
                return  # closed by the file watch while the round ran
            self._rounds_written += 1
            self._submit_round(ctx)
        if ctx.segments:
            self._watch.touch()
        else:
            self._watch.start()

    def _submit_round(self, ctx: RoundContext) -> None:
        r = ctx.round
        self.records_dropped += drop_misshapen(r)
        for part in (split_round(r, ctx.segments) if ctx.segments
                     else [r]):
            if not self._closed:
                self._write(part)

    def _write(self, r: Round) -> None:
        error = self.output.submit(
            r, lambda: dump_meta(self.model, self.layer_names, self.blocks[0][1], self.config,
                                 r, width=self._width, autocast=self._autocast,
                                 sites=self.sites, faults=self.faults,
                                 tensor_parallel=self._tp.meta()),
            self.layer_names, self.site_names, self._sink.stat_columns)
        if error:
            self._fail(error)

    def _finish_idle_file(self) -> None:
        """The serving engine has been idle: finish the file (dump_file.FileWatch)."""
        with self._lock:
            if self._closed or self._ctx is not None or self.output.writer is None:
                return
            try:
                error = self.output.finish_file(self._status())
                if not error:  # the next file's status counts its own evidence
                    self._coverage_filed = self.coverage.snapshot()
            except Exception as exc:  # noqa: BLE001 (a thread of the user's process)
                error = describe_error(exc)
            if error and not self.error:
                self.error = error

    def _status(self) -> dict:
        silent = never_run(self.layer_names, self.sites, self._fired)
        partial = explain_partial(silent, len(self.blocks) + len(self.sites))
        return {
            "error": self.error, "program_error": self.program_error,
            "samples": self.samples, "failed_calls": self.failed_calls,
            "histories": self._history.as_list(),
            "requests": self._rounds.requests.requests,
            **self.replays.status(), "records_dropped": self.records_dropped,
            "records_dropped_sites": sorted(
                {site_pattern(self.sites[i].name) for i in self.dropped_sites})[:MAX_NAMED],
            "site_errors": self.site_errors + self.replays.site_errors, **self._tp.status(),
            "sites_never_run": len(silent) if partial else 0,
            "coverage": self.coverage.since(self._coverage_filed),
            "untested_versions": self.version_notes,
            **self._sink.status(),
        }

    @property
    def path(self) -> str | None:
        """The dump file (None until the first round is captured)."""
        return self.output.path

    # -- lifecycle ------------------------------------------------------------------------
    def _fail(self, reason: str) -> None:
        self.error = reason
        say(f"srdd-dump: warning: capture turned off: {reason}\n")
        self.close()

    def remove(self) -> None:
        """Remove the capture hooks (injected faults stay until ``remove_faults``/exit)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        opaque_method.forget(self)  # the hooks' functions hold the session: freed at once
        for _, block in self.blocks:
            if _open.get(id(block)) is self:
                del _open[id(block)]

    def abandon(self) -> None:
        """In a forked child: the hooks, the injected faults and the file are the parent's;
        stop without writing (keep the session referenced: nothing of it may be freed)."""
        self._closed = True
        self.on_hand_over = None
        self.output.forget_after_fork()
        self.remove()
        self.remove_faults()
        _unclosed.discard(self)

    def remove_faults(self) -> None:
        for h in self._fault_handles:
            h.remove()
        self._fault_handles.clear()

    def _finish_asked(self) -> None:
        """srdd-dump was sent a signal and asks every capturing process to finish its file
        (the request says why: how the program ends)."""
        try:
            with open(self._watch.request or "") as fh:
                why = fh.read(200).strip()
        except OSError:
            why = ""
        self.program_error = self.program_error or why or None
        self.stop_asked()
        self.close()

    def stop_asked(self) -> None:
        """The close to come ends the run from outside (a signal, srdd-dump's request): a
        round cut by it was stopped, not left unfinished by the program."""
        self._stop_asked = True

    def close(self) -> str | None:
        """Remove the hooks and finalise the dump file. Returns its path (None if empty)."""
        with self._lock:
            return self._close()

    def wait_closed(self) -> None:
        """Return once no close is under way in another thread."""
        with self._lock:
            pass

    def busy_here(self) -> bool:
        """This thread is inside the session's hooks or close (it holds the session's lock): a
        close from another thread would wait for it."""
        owned = getattr(self._lock, "_is_owned", None)
        return bool(owned is not None and owned())

    def _close(self) -> str | None:
        if self._closed:
            return self.path
        self._closed = True
        try:
            return self._finish()
        finally:  # what the status at exit reads, also when a message could not be written
            _unclosed.discard(self)
            self.end.samples, self.end.error = self.samples, self.error
            self.end.silence, self.end.degraded = self.silence, self.degraded
            self.end.blocks_unseen = self.blocks_unseen

    def _finish(self) -> str | None:
        # a round under way in the hooks' thread (closed from another one), or one whose
        # forward raised
        cut = self._ctx if self._ctx is not None else self._lost
        self._watch.stop()
        self.remove()
        self._pending = []  # device tensors of a model-level operator
        self._frozen.clear()  # and copies kept for the replays of an unfinished round
        self.replays.close()  # kept KV caches, the references' reused weight buffers
        self._bar.close()
        if self.output.writer is not None:
            silent = never_run(self.layer_names, self.sites, self._fired)
            partial = explain_partial(silent, len(self.blocks) + len(self.sites))
            try:
                status = self._status()
            except Exception as exc:  # noqa: BLE001 (runs at exit and in a thread too)
                status = {"error": describe_error(exc), "samples": self.samples}
            error = self.output.close(status)
            if error and not self.error:
                self.error = error
                say(f"srdd-dump: warning: capture stopped: {self.error}\n")
            elif self.path and not os.environ.get(cfg.ENV_CONFIG):
                # under `srdd-dump --exec` the command itself lists every process's file
                say(f"srdd-dump: wrote {self.path}\n")
            if partial:
                say(f"srdd-dump: warning: {partial}\n")
            self.degraded = self.coverage.shortfalls()
            if not os.environ.get(cfg.ENV_CONFIG):  # under --exec the command says it once
                for line in self.degraded:
                    say(f"srdd-dump: warning: evidence missing: {line}\n")
        elif not self.error:
            with self.config.naming():
                silence = explain_silence(self.model, self.model_calls, self.block_calls)
                tokens, steps = option("tokens"), option("steps")
            if silence:
                self.silence, self.blocks_unseen = silence
            seen = self._rounds.last_step_seen
            if not self.silence and seen >= 0 and not self._rounds.step_opened:
                why = (": each new token recomputed the whole sequence (no KV cache: generate("
                       "use_cache=False)?), so every forward is a prefill, step 0"
                       if NO_CACHE in self.coverage.families else
                       f" (step 0 is a prompt's prefill; the longest generation seen reached "
                       f"step {seen})")
                self.silence = f"{steps} {self.config.steps} selects no step of the forwards " \
                               f"seen{why}"
            if not self.silence and self._rounds.no_kept_position:
                self.silence = (f"{tokens} {self.config.tokens} keeps no position of the "
                                f"forwards seen (the longest had "
                                f"{self._rounds.no_kept_position} tokens)")
            if not self.silence and cut is not None:
                self.silence = _cut_first_round(cut, len(self.blocks), self._stop_asked)
            in_code = not os.environ.get(cfg.ENV_CONFIG)  # --exec says its own end
            if in_code and not self.silence and not self.model_calls and not self.block_calls \
                    and os.getpid() == self._pid:
                self.silence = (f"the model given to register_hook "
                                f"({type(self.model).__name__}) never ran a forward while the "
                                "session was open (a copy of it, or a model built after the "
                                "hook, runs uncaptured: hook the model that runs)")
            if self.silence and in_code:
                say(f"srdd-dump: warning: nothing captured: {self.silence}\n")
        return self.path

    def __del__(self) -> None:
        # the program dropped the model: it, its hooks and this session are freed together
        # (never at exit: the sessions still open then were closed first); the file is
        # finished now. A collection in another thread (the writer's own, whose queue the
        # close waits on) keeps the session, model included, for the exit instead.
        if getattr(self, "_closed", True):
            return
        if threading.current_thread() is not threading.main_thread():
            _dropped.append(self)
            return
        try:
            self.close()
        except Exception:  # noqa: BLE001 (a file that cannot be finished: the .partial stays)
            pass

    def __enter__(self) -> CaptureSession:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        left_by = _ended_by(exc)
        self.program_error = self.program_error or (left_by and schema.WITH_BLOCK_LEFT + left_by)
        self.close()
        self.remove_faults()


def _take_over(ours: CaptureSession, model: nn.Module, config: DumpConfig) -> CaptureSession:
    """``srdd-dump --exec`` attached its session at a forward before the program's own
    register_hook (a warm-up call): the program's session takes over, as it does when it comes
    first; srdd-dump's is closed with what it captured so far (its file is listed too)."""
    path = ours.close()
    ours.remove_faults()  # srdd-dump's --inject: the program's options apply, as when it is first
    session = CaptureSession(model, config)
    ours.on_hand_over(session)
    kept = f"{path} keeps its {ours.samples} earlier sample{'s' if ours.samples != 1 else ''}" \
        if path else "it had captured nothing"
    say(f"srdd-dump: note: the program captures its model itself (register_hook) from here "
        f"on: its own options apply in pid {os.getpid()}; srdd-dump's session, begun at an "
        f"earlier forward, is closed ({kept})\n")
    return session


def _cut_first_round(ctx: RoundContext, layers: int, asked: bool) -> str:
    """Why nothing was written when the session closed inside its first round: srdd-dump was
    sent a signal (``asked``) while the program's first captured forward ran, or that forward
    never finished (it raised, or the program ended inside it)."""
    what = f"sample {ctx.sample + 1}'s " + ("prefill" if ctx.step == 0 else
                                           f"decode step {ctx.step}")
    probes = (", being probed: each layer is replayed several times, a cost of several "
              "forwards" if ctx.probed else "")
    if not asked:
        return (f"the first round ({what} over {layers} layers{probes}) never finished: the "
                "program's forward raised, or the program ended inside it, so no round was "
                "written")
    return (f"the capture was stopped inside its first round ({what} over {layers} layers"
            f"{probes}), so no round was finished and none was written; stop the command "
            f"later to keep the rounds finished by then")


def register_hook(model: nn.Module, config: DumpConfig | None = None
                  ) -> CaptureSession | InertSession:
    """Start capturing ``model`` (msit style). Use the result as a context manager, or call
    ``.close()``, to remove the hooks and finish the dump file. A model another open session
    captures (an earlier ``register_hook`` not yet closed) is not captured twice: one warning,
    and an InertSession that records nothing; ``srdd-dump --exec``'s session, attached at an
    earlier forward, hands the model over to this one (``_take_over``). A Hugging Face
    pipeline is taken for its ``.model``; anything else that is not a torch module, and a
    ``dump_path`` naming a file, are refused (UserError)."""
    config = DumpConfig() if config is None else config
    if not isinstance(config, DumpConfig):
        example = ("DumpConfig(**options)" if isinstance(config, dict) else
                   f"DumpConfig(dump_path={config!r})" if isinstance(config, (str, os.PathLike))
                   else "DumpConfig(dump_path=...)")
        raise UserError(f"register_hook: the config must be a DumpConfig (got "
                        f"{type(config).__name__}): register_hook(model, {example})")
    if not isinstance(model, nn.Module):
        inner = getattr(model, "model", None)
        if not isinstance(inner, nn.Module):
            raise UserError(f"register_hook: expected the model (a torch.nn.Module), got a "
                            f"{type(model).__name__}")
        model = inner  # a pipeline: its model
    refuse_a_file(config.dump_path, f"register_hook: dump_path {config.dump_path}")
    made = not os.path.isdir(config.dump_path)
    try:  # as msit does: a folder that cannot be made is said here, not at the first forward
        os.makedirs(config.dump_path, exist_ok=True)
    except OSError as exc:
        raise UserError(f"register_hook: dump_path {config.dump_path}: cannot create the folder "
                        f"({exc.strerror or exc})") from None
    try:
        return CaptureSession(model, config)
    except AlreadyCaptured as exc:
        if exc.session.on_hand_over is not None:  # srdd-dump --exec's own session
            return _take_over(exc.session, model, config)
        if made:  # this session records nothing: no empty folder of it is left
            with contextlib.suppress(OSError):
                os.rmdir(config.dump_path)
        where = exc.session.config.dump_path
        say("srdd-dump: warning: register_hook: the model is already captured by "
                         f"another open session (dump folder {where}); this one records "
                         "nothing\n")
        return InertSession(exc.session)
