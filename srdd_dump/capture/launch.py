"""Run the user's command with capture injected (``srdd-dump --exec``). No torch here."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field, replace

from ..errors import UserError
from ..format import schema
from ..format.coverage import shortfall_lines, summed
from ..runtime.terminal import terminal_delivers_to_child
from .config import (
    ENV_CONFIG,
    ENV_STATUS_DIR,
    EXIT_BAD_OPTIONS,
    FINISH_REQUEST,
    DumpConfig,
)
from .diskspace import MIN_FREE_GB, check_free_space, refuse_a_file

EXIT_CAPTURE_FAILED = 3

# Variables srdd-dump sets for the child (documented in docs/cli.md).
CHILD_ENV = (ENV_CONFIG, ENV_STATUS_DIR, "PYTHONPATH")
# --eager: torch.compile returns what it is given, so every block runs eagerly where the hooks
# see it (torch/_dynamo/eval_frame.py reads it at each torch.compile call). vLLM ahead-of-time
# compiles its model by default (torch >= 2.10), which fails on an uncompiled callable: it is
# told not to (vllm/envs.py, VLLM_USE_AOT_COMPILE); other programs ignore the variable.
EAGER_ENV = {"TORCHDYNAMO_DISABLE": "1", "VLLM_USE_AOT_COMPILE": "0"}


@dataclass
class ExecResult:
    returncode: int  # the command's own exit code
    run_dir: str = ""  # the run's own folder under -o
    files: list[str] = field(default_factory=list)
    # files a process left unfinished (killed) that hold rounds srdd-compare reads
    partials: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # why capture failed, one line each
    # evidence the options asked for that some process did not get (coverage.py), one line each
    degraded: list[str] = field(default_factory=list)
    untested_versions: list[str] = field(default_factory=list)  # capture/versions.py
    requests: int = 0  # a serving engine's requests the files say were seen
    # options that did not fit the model: the command was stopped when the model first ran
    refused: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        if self.refused:
            return EXIT_BAD_OPTIONS
        if self.returncode < 0:  # killed by a signal: the shell's convention, 128 + signal
            return 128 - self.returncode
        if self.returncode != 0:
            return self.returncode
        return EXIT_CAPTURE_FAILED if self.problems else 0

    def folders(self) -> dict[str, list[str]]:
        """The files by the folder to compare: the run folder, and the folders the program's
        own register_hook sessions wrote in (a file of a process's own folder in the run
        folder counts as the run's)."""
        out: dict[str, list[str]] = {}
        run = os.path.abspath(self.run_dir) if self.run_dir else None
        for path in self.files + self.partials:
            folder = os.path.dirname(os.path.abspath(path))
            inside = run is not None and (folder == run or folder.startswith(run + os.sep))
            out.setdefault(self.run_dir if inside else folder, []).append(path)
        return out

    def requests_line(self, samples: int) -> str | None:
        """What the serving engine's requests came to (None: no engine ran). Capture, and
        its count of requests, stop once ``samples`` requests are captured."""
        if self.requests > samples:
            first = ("the first captured as one sample" if samples == 1 else
                     f"the first {samples} captured, one sample each")
            return (f"more than {samples} request{'s' if samples > 1 else ''} seen by the "
                    f"serving engine; {first} (the later ones were not counted)")
        if self.requests == 1:
            return "1 request seen by the serving engine, captured as one sample"
        if self.requests:
            return (f"{self.requests} requests seen by the serving engine, each captured as "
                    "one sample")
        return None

    def describe_exit(self) -> str | None:
        """How the command ended, when it did not succeed (for itself: not stopped by
        srdd-dump for options that do not fit)."""
        if self.refused:
            return None
        if self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            return f"the command was killed by {name} (exit code {self.exit_code})"
        if self.returncode != 0:
            return f"the command exited with code {self.returncode}"
        return None


SHELL_ONLY = ("cd", "export", "source", ".", "set", "unset", "ulimit", "alias")
NO_SHELL = ("--exec runs the command without a shell: for a shell's syntax give --exec \"bash "
            "-c '...'\" (and env VAR=value for a variable)")


def split_command(command: str) -> list[str]:
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise UserError(f"cannot parse --exec {command!r}: {exc}") from None
    if not argv:
        raise UserError("--exec needs a command, e.g. --exec \"python infer.py\"")
    operator = shell_operator(command)
    if operator:  # it would reach the program as an argument, silently
        raise UserError(f"--exec: {operator!r} is shell syntax (quote it where it is an "
                        f"argument); {NO_SHELL}")
    if shutil.which(argv[0]) is None:
        if os.sep in argv[0] and os.path.isfile(argv[0]):  # ./infer.py without its x bit
            raise UserError(f"--exec: {argv[0]}: permission denied (not executable: chmod +x "
                            f"it, or run it as --exec \"python {argv[0]}\")")
        if argv[0] in SHELL_ONLY or re.match(r"[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
            raise UserError(f"--exec: command not found: {argv[0]} ({NO_SHELL})")
        raise UserError(f"--exec: command not found: {argv[0]}")
    return argv


def shell_operator(command: str) -> str | None:
    """The first redirection, pipe or list operator (``>``, ``2>&1``, ``|``, ``&&``, ``;``)
    outside quotes in ``command``; None when it has none."""
    quote, escaped, run = "", False, ""
    for ch in command + " ":
        if escaped:
            escaped = False
        elif ch == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "|&;<>":
            run += ch
            continue
        if run:
            return run
    return None


def child_env(config: DumpConfig, status_dir: str, eager: bool = False) -> dict[str, str]:
    from .inject import SITE_DIR  # torch-free

    env = dict(os.environ)
    if eager:
        env.update(EAGER_ENV)
    env[ENV_CONFIG] = config.to_json()
    env[ENV_STATUS_DIR] = status_dir
    parts = [SITE_DIR]
    if env.get("PYTHONPATH"):
        parts.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def run_exec(command: str, config: DumpConfig, min_free_gb: float = MIN_FREE_GB,
             eager: bool = False) -> ExecResult:
    """Run ``command`` (never through a shell), capturing in every Python process it starts,
    into a new run folder under ``config.dump_path`` (``new_run_folder``).

    ``min_free_gb`` > 0 refuses to start when the dump folder's file system has less free space.
    ``eager``: torch.compile is turned off in the command (``EAGER_ENV``).
    """
    argv = split_command(command)
    if not min_free_gb >= 0:
        raise UserError(f"--min-free-gb {min_free_gb}: must be 0 (no check) or more")
    check_free_space(config.dump_path, min_free_gb)
    made = _missing_folders(config.dump_path)
    run_dir = new_run_folder(config.dump_path)
    # the processes get it absolute: a program may change its working directory
    config = replace(config, dump_path=os.path.abspath(run_dir), command=command,
                     command_dir=os.getcwd())
    status_dir = tempfile.mkdtemp(prefix="srdd-status-")
    try:
        returncode, stopped = _run_forwarding_signals(
            argv, child_env(config, status_dir, eager), status_dir, run_dir)
        result = _collect(returncode, status_dir, _partial_files(run_dir),
                          _finished_files(run_dir), stopped)
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(run_dir)  # only when nothing was written into it
            for folder in made:  # and the folders of -o made for this run, when empty
                os.rmdir(folder)
    result.files = [_as_given(f, run_dir) for f in result.files]
    result.run_dir = run_dir
    return result


def _missing_folders(path: str) -> list[str]:
    """The folders of ``path`` that do not exist yet, the deepest first."""
    missing, path = [], os.path.realpath(path)  # as makedirs will follow links and ".."
    while path and not os.path.exists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        path = parent if parent != path else ""
    return missing


def _as_given(path: str, run_dir: str) -> str:
    """A file of the run folder as the user named the folder (relative stays relative)."""
    inside = os.path.relpath(os.path.abspath(path), os.path.abspath(run_dir))
    return path if inside.startswith(os.pardir) else os.path.join(run_dir, inside)


def new_run_folder(output: str) -> str:
    """A new folder ``<output>/srdd_dump_<UTC time>`` (``_1``, ``_2``... when taken)."""
    stamp = time.strftime(schema.RUN_TIME_FORMAT, time.gmtime())
    base = os.path.join(output, schema.RUN_PREFIX + stamp)
    path, n = base, 1
    refuse_a_file(output, f"-o {output}")
    try:
        os.makedirs(output, exist_ok=True)
    except OSError as exc:
        raise UserError(f"-o {output}: cannot create the folder ({exc.strerror})") from None
    while True:
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            path, n = f"{base}_{n}", n + 1
        except OSError as exc:
            raise UserError(f"-o {output}: cannot create a run folder in it "
                            f"({exc.strerror})") from None


def _run_forwarding_signals(argv: list[str], env: dict[str, str], status_dir: str = "",
                            run_dir: str = "") -> tuple[int, bool]:
    """Run and wait for the child; pass SIGINT/SIGTERM/SIGHUP on so it can finish its dump file. The
    handlers are in place before the child starts, so no signal is lost in between. Before a
    signal is passed on, the capturing processes are asked to finish their files
    (dump_file.FileWatch) and given up to FINISH_WAIT_SECONDS: a serving engine kills its
    workers with SIGKILL when stopped. Returns the exit code and whether srdd-dump stopped
    the command (``_wait_unless_refused``)."""
    procs: list[subprocess.Popen] = []
    pending: list[int] = []

    asked: list[bool] = []

    def forward(signum, frame):
        if not asked:  # the first signal only: a second one is passed on at once
            asked.append(True)
            _finish_files(status_dir, run_dir, f"stopped by {signal.Signals(signum).name}")
        if signum == signal.SIGINT and terminal_delivers_to_child():
            return  # Ctrl-C at a terminal already reached the child's process group
        if not procs:
            pending.append(signum)
            return
        try:
            procs[0].send_signal(signum)
        except ProcessLookupError:
            pass

    previous = {s: signal.signal(s, forward) for s in _forwarded_signals()}
    try:
        procs.append(subprocess.Popen(argv, env=env, shell=False))
        for signum in pending:
            procs[0].send_signal(signum)
        return _wait_unless_refused(procs[0], status_dir, run_dir)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _forwarded_signals() -> list[int]:
    """SIGINT, SIGTERM and SIGHUP (a closed terminal or ssh session, ``kill -HUP``): each ends
    the program, so each first lets it finish its dump file. SIGHUP stays ignored where the
    user ignored it (``nohup srdd-dump ...``)."""
    signals = [signal.SIGINT, signal.SIGTERM]
    hangup = getattr(signal, "SIGHUP", None)
    if hangup is not None and signal.getsignal(hangup) is not signal.SIG_IGN:
        signals.append(hangup)
    return signals


FINISH_WAIT_SECONDS = 5.0
REFUSED_POLL_SECONDS = 0.25
STOP_WAIT_SECONDS = 10.0  # after SIGTERM, before SIGKILL


def _wait_unless_refused(proc: subprocess.Popen, status_dir: str, run_dir: str
                         ) -> tuple[int, bool]:
    """The command's exit code, and whether srdd-dump stopped it: a process that reports
    options that do not fit its model (inject.stop_refused) stops the command: the other
    processes finish their files, then the command gets SIGTERM (SIGKILL if it is still alive
    STOP_WAIT_SECONDS later). A command that ended first was not stopped, whatever its code
    (a shell or torchrun in between exits 143, 0 or 1 when it is)."""
    read: set[str] = set()  # the reports read whole already (each process writes one)
    while True:
        try:
            return proc.wait(timeout=REFUSED_POLL_SECONDS), False
        except subprocess.TimeoutExpired:
            pass
        refused = _refused(status_dir, read) if status_dir else []
        if refused:
            break
    _finish_files(status_dir, run_dir, "stopped by srdd-dump: options that do not fit the model")
    # every process of the command, the refusing ones and those between them and the main
    # process too (a serving engine's core process): each is stopped and waited for, so that
    # none prints its own error after srdd-dump's (vLLM's "RuntimeError: cancelled")
    others = list(dict.fromkeys(
        [pid for pid in refused if pid != proc.pid] + descendants(proc.pid)))
    started = {pid: _start_time(pid) for pid in others}  # a pid reused later is not theirs
    others = [pid for pid in others if started[pid] is not None]
    for pid in others:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    deadline = time.monotonic() + STOP_WAIT_SECONDS
    try:
        code = proc.wait(timeout=STOP_WAIT_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    def still(pid: int) -> bool:
        return _alive(pid) and _start_time(pid) == started[pid]

    while any(still(pid) for pid in others) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in filter(still, others):  # one that ignores SIGTERM would run on, orphaned
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return code, True


def _start_time(pid: int) -> int | None:
    """When the process started (clock ticks since boot, /proc's field 22): with its pid, it
    names one process; 0 where /proc is not there, None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, IndexError):
        return 0 if _alive(pid) else None


def descendants(pid: int) -> list[int]:
    """The processes started by ``pid`` and by them, at this moment (Linux's /proc; elsewhere
    none are known)."""
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read()
            parent = int(stat[stat.rindex(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    """The process runs (a zombie, ended but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
        return stat[stat.rindex(b")") + 2:][:1] != b"Z"
    except (OSError, ValueError):
        return True


def _refused(status_dir: str, read: set[str]) -> list[int]:
    """The processes of the command that reported options that do not fit their model, among
    the reports not in ``read`` (those read whole are added to it)."""
    pids = []
    for name in os.listdir(status_dir):
        if not name.endswith(".json") or name in read:
            continue
        try:
            with open(os.path.join(status_dir, name)) as fh:
                status = json.load(fh)
        except (OSError, ValueError):  # being written: read again next time
            continue
        if not status.get("early"):  # an early one is replaced by the one at exit
            read.add(name)
        if status.get("refused") and isinstance(status.get("pid"), int):
            pids.append(status["pid"])
    return pids


def _finish_files(status_dir: str, run_dir: str, why: str) -> None:
    """Ask every capturing process to finish its file, saying ``why`` (its status keeps it as
    how the program ended); wait until no live process has one left unfinished
    (FINISH_WAIT_SECONDS at most), then withdraw the request."""
    if not status_dir:
        return
    request = os.path.join(status_dir, FINISH_REQUEST)
    with contextlib.suppress(OSError):
        with open(request + ".tmp", "w") as fh:
            fh.write(why)
        os.replace(request + ".tmp", request)  # never read half written
    deadline = time.monotonic() + FINISH_WAIT_SECONDS
    while _unfinished(run_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(OSError):
        os.remove(request)


def _unfinished(run_dir: str) -> list[str]:
    """The .partial files of the run whose writing process is alive."""
    out = []
    for path in _partial_files(run_dir):
        found = re.search(r"_pid(\d+)", os.path.basename(path))
        if found is None:
            continue
        try:
            os.kill(int(found[1]), 0)
        except ProcessLookupError:
            continue  # its process is gone: nothing will finish it
        except OSError:
            pass
        out.append(path)
    return out


def _partial_files(dump_path: str) -> set[str]:
    try:
        names = os.listdir(dump_path)
    except OSError:
        return set()
    suffix = schema.FILE_SUFFIX + schema.PARTIAL_SUFFIX
    return {os.path.abspath(os.path.join(dump_path, n)) for n in names if n.endswith(suffix)}


def _file_status(path: str) -> tuple[int, int, dict]:
    """(pid, the serving engine's requests the file's status counts, the evidence coverage it
    stores): 0, 0, {} when none or unreadable."""
    from ..format.reader import DumpReader

    try:
        with DumpReader(path) as reader:
            coverage = reader.status.get("coverage")
            return (int(reader.meta.get("pid") or 0), int(reader.status.get("requests") or 0),
                    coverage if isinstance(coverage, dict) else {})
    except Exception:  # noqa: BLE001 (a file srdd-compare will report on)
        return 0, 0, {}


def _rounds_written(path: str) -> int | None:
    """The rounds an unfinished file holds that a reader can use (None: unreadable)."""
    from ..format.reader import DumpReader

    try:
        with DumpReader(path) as reader:
            return len(reader.rounds)
    except Exception:  # noqa: BLE001 (srdd-compare says what is wrong with it)
        return None


def _finished_files(dump_path: str) -> set[str]:
    try:
        names = os.listdir(dump_path)
    except OSError:
        return set()
    return {os.path.abspath(os.path.join(dump_path, n)) for n in names
            if n.endswith(schema.FILE_SUFFIX)}


def _collect(returncode: int, status_dir: str, new_partials: set[str] | None = None,
             run_files: set[str] = frozenset(), stopped: bool = False) -> ExecResult:
    """What the processes reported; ``new_partials``: unfinished dump files of this run;
    ``stopped``: srdd-dump stopped the command (a process refused its options)."""
    result = ExecResult(returncode=returncode)
    statuses = []
    for name in sorted(os.listdir(status_dir)):
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(status_dir, name)) as fh:
                statuses.append(json.load(fh))
        except (OSError, ValueError):
            continue
    for st in statuses:
        for file in st.get("files") or []:
            if file.endswith(schema.BROKEN_SUFFIX):
                result.problems.append(
                    f"{file}: a write failed half-way, so the file is set aside and not used"
                )
            elif file not in result.files:
                result.files.append(file)
        if st.get("error"):
            result.problems.append(f"pid {st['pid']}: capture failed: {st['error']}")
    refused: dict[str, list] = {}  # reason -> the processes stopped for it (every TP rank)
    for st in statuses:
        if st.get("refused"):
            refused.setdefault(st["refused"], []).append(st["pid"])
    # a command that ended before the stop reached it (a small model's whole run) was not
    # stopped: it exited on its own, or was exiting (its work done) when the stop came
    exiting = all(st.get("exiting") for st in statuses if st.get("refused"))
    how = ("the command was stopped when its model first ran" if stopped and not exiting else
           "the command ended before srdd-dump could stop it")
    result.refused = [f"{reason}: {how}, since pid {', '.join(map(str, pids))} would capture "
                      "nothing" for reason, pids in refused.items()]
    result.degraded = _degraded(statuses)
    result.untested_versions = list(dict.fromkeys(
        note for st in statuses for note in st.get("untested_versions") or []))
    reported = {os.path.abspath(f) for f in result.files}
    unreported = run_files - reported
    for path in sorted(unreported):
        # finished by its process, which was then killed before it could report (a serving
        # engine's worker: dump_file.FileWatch)
        result.files.append(path)
        reported.add(path)
    seen: dict[int, int] = {}  # a process's files count its requests cumulatively
    # a process that never reported: the coverage its files store (each file its own)
    coverage: dict[int, list[dict]] = {}
    for path in result.files:
        pid, n, stored = _file_status(path)
        seen[pid] = max(seen.get(pid, 0), n)
        if path in unreported and stored:
            coverage.setdefault(pid, []).append(stored)
    result.requests = sum(seen.values())
    # a process that said only what it knew early (then killed): its files' coverage counts
    known = {st.get("pid") for st in statuses if not st.get("early")}
    unheard = [{"pid": pid, "degraded": shortfall_lines(summed(stored)), "model_seen": True}
               for pid, stored in sorted(coverage.items()) if pid not in known]
    if unheard:
        result.degraded = _degraded(statuses + unheard)
    for path in sorted((new_partials or set()) - reported):
        # its process died before finishing it (SIGKILL, out of memory, os._exit)
        rounds = _rounds_written(path)
        if rounds == 0:
            result.problems.append(f"{path}: the process writing it ended before it wrote a "
                                   "round: that process left no evidence")
            continue
        result.partials.append(path)
        result.problems.append(
            f"{path}: the process writing it ended without finishing it; srdd-compare uses the "
            f"{f'{rounds} ' if rounds else ''}rounds written before (marked incomplete)"
        )
    if not result.files and not result.problems and not result.refused:
        result.problems.extend(_why_nothing(statuses, returncode))
    return result


def _why_nothing(statuses: list[dict], returncode: int) -> list[str]:
    """Why a run wrote no file, from what its processes reported: the first reason that
    holds, most specific first."""
    failed = (f"; the command {_ended(returncode)}" + (": see its own error above"
                                                        if returncode > 0 else "")
              if returncode != 0 else "")
    silent = [f"pid {st['pid']}: nothing captured: "
              + (st["silence"] + (failed if "never finished" in st["silence"] else "")
                 if returncode == 0 or not st.get("blocks_unseen") else
                 f"the command {_ended(returncode)} after the model was called "
                 "and before any of its blocks ran: see the command's own error above")
              for st in statuses if st.get("silence")]
    if silent:
        return silent
    reasons = [st["no_blocks"] for st in statuses if st.get("no_blocks")]
    if reasons:
        return reasons[:1]
    if not statuses and returncode < 0:  # stopped (Ctrl-C, SIGTERM) before torch came in
        return [f"capture never started: the command {_ended(returncode)} before any Python "
                "process of it imported torch"]
    if not statuses:
        return ["capture never started: no Python process of the command imported torch with "
                "srdd-dump loaded (is the command's python the one srdd-dump is installed in?)"]
    if any(st.get("model_seen") for st in statuses):
        return ["no model forward with more than one token was captured (no prefill seen)"
                + (f"; the command {_ended(returncode)}" if returncode != 0 else "")
                + (": see its own error above" if returncode > 0 else "")]
    unwatched = [st["pid"] for st in statuses if st.get("torch_unwatched")]
    if unwatched:
        return [f"pid {unwatched[0]}: torch was imported past srdd-dump's import hook (an "
                "import hook of the program found it first), so capture never attached; "
                "use srdd_dump.register_hook in the program"]
    if any(st.get("compiled_out") for st in statuses):
        return ["no model forward was seen: the models run inside fullgraph=True "
                "torch.compile'd code, where srdd-dump's hooks cannot run; run eagerly: "
                "srdd-dump --eager"]
    if all(st.get("torch_missing") for st in statuses):
        return ["no model ran: the command's Python has no torch (srdd-dump captures "
                "PyTorch programs: install the device's torch there, or srdd-dump with "
                "its [dump] extra, which pulls torch>=2.1)"
                + (f"; the command {_ended(returncode)}" if returncode else "")]
    if returncode != 0:
        return [f"nothing captured: the command {_ended(returncode)} before any model with a "
                "block stack ran a forward"
                + ("" if returncode < 0 else ": see its own error above")]
    if not any(st.get("torch_imported", True) for st in statuses):
        return ["no model ran: no Python process of the command imported torch (does it "
                "run the model? a Python it starts with an environment of its own, "
                f"env={{...}} without {ENV_CONFIG} and PYTHONPATH, runs uncaptured: hand "
                "it os.environ)"]
    return ["no model with a block stack ran a forward in any process (the program "
            "imported torch but ran no model srdd-dump recognises, or a Python it "
            "starts with an environment of its own, env={...} without "
            f"{ENV_CONFIG} and PYTHONPATH, runs uncaptured: hand it os.environ)"]


def _ended(returncode: int) -> str:
    """'failed (exit code 1)', or for a command a signal ended: 'was stopped by SIGINT'."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was stopped by {name}"
    return f"failed (exit code {returncode})"


def _degraded(statuses: list[dict]) -> list[str]:
    """Each process's missing-evidence lines, one per line text (the processes named)."""
    pids: dict[str, list] = {}
    for st in statuses:
        lines = st.get("degraded")
        for line in lines if isinstance(lines, list) else []:
            pids.setdefault(str(line), []).append(st.get("pid"))
    if sum(1 for st in statuses if st.get("model_seen")) <= 1:
        return list(pids)
    return [f"{line} (pid {', '.join(str(p) for p in who)})" for line, who in pids.items()]
