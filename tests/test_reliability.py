"""Faults and security (issue 7), with real processes: a program killed mid-dump, a file-size
limit and a full disk, a capture error, Ctrl-C and SIGTERM to srdd-dump, the free-space gate,
umask, odd paths, the child's environment, no shell, no formulas in XLSX, no unpickling.

Every guarantee in docs/reliability.md names the test here that proves it. The user programs
are loops of forward passes on the tiny llama of fixtures/tiny_models.py, or, where the model
does not matter and a transformers import would only cost time, on a 4-block torch toy.
"""

from __future__ import annotations

import ast
import os
import re
import select
import shlex
import signal
import stat
import subprocess
import sys
import textwrap
import time

import numpy as np
import openpyxl
import pytest

from srdd_dump.capture.config import DumpConfig
from srdd_dump.capture.launch import CHILD_ENV, EAGER_ENV, child_env
from srdd_dump.format import schema as s
from srdd_dump.format.reader import DumpReader, find_dump_files

from capture_utils import FIXTURES, ROOT, run_cli
from dumpfactory import baseline_written as compare_baseline
from dumpfactory import compare_written as compare_path
from dumpfactory import normal_rounds, write_dump

pytestmark = [pytest.mark.integration, pytest.mark.capture]

LOOP = textwrap.dedent(f"""
    import os, sys, time
    sys.path.insert(0, {FIXTURES!r})
    import torch
    n, pause, seq, arch = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    if arch == "toy":
        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(64, 64)
            def forward(self, x):
                return x + torch.tanh(self.linear(x))
        class Toy(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = torch.nn.Embedding(128, 64)
                self.layers = torch.nn.ModuleList(Block() for _ in range(4))
            def forward(self, input_ids):
                h = self.embed(input_ids)
                for block in self.layers:
                    h = block(h)
                return h
        torch.manual_seed(0)
        model = Toy().eval()
    else:
        from tiny_models import build
        model = build(arch)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for i in range(n):
            model(input_ids=torch.randint(0, 128, (1, seq), generator=gen))
            print("forward", i, os.getpid(), flush=True)
            time.sleep(pause)
    print("finished", flush=True)
""")

# Runs a command under a file-size limit. SIGXFSZ is ignored, as a batch system would set it,
# so that a write past the limit fails with EFBIG instead of killing the program: srdd-dump
# itself never changes how the user's program handles signals.
LIMIT = textwrap.dedent("""
    import os, resource, signal, sys
    limit = int(sys.argv[1])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
""")

# The same loop with the writer's room check switched off, so that the write itself fails:
# what happens when something else fills the disk between the check and the write.
NO_CHECK = "import srdd_dump.format.writer as w\nw._H5File._check_room = lambda *a: None\n"


def _script(tmp_path, name: str = "loop.py", prefix: str = "") -> str:
    path = tmp_path / name
    path.write_text(prefix + LOOP)
    return str(path)


def _command(*argv: str) -> str:
    return shlex.join([sys.executable, *argv])


def _start(*args: str, umask: int | None = None, gate: str | None = None) -> subprocess.Popen:
    """srdd-dump as a user starts it, in its own session (no terminal to deliver Ctrl-C);
    ``gate``: SRDD_DUMP_MIN_FREE_GB ("": unset, the command's own default; None: as the tests
    set it, conftest.py)."""
    env = dict(os.environ)
    if gate is not None:
        env.pop("SRDD_DUMP_MIN_FREE_GB", None)
        env.update({"SRDD_DUMP_MIN_FREE_GB": gate} if gate else {})
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return subprocess.Popen(
        [sys.executable, "-m", "srdd_dump.cli.dump", *args], cwd=ROOT, env=env,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
        preexec_fn=(lambda: os.umask(umask)) if umask is not None else None,
    )


def _wait_for_forward(proc: subprocess.Popen, n: int, timeout: float = 120) -> int:
    """Read the program's output until its forward number ``n``; returns the program's pid."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], deadline - time.monotonic())
        line = proc.stdout.readline() if ready else ""
        if not line:
            break
        if line.startswith(f"forward {n} "):
            return int(line.split()[2])
    proc.kill()
    pytest.fail(f"the program did not reach forward {n}: {proc.stderr.read()[-2000:]}")


def _finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("srdd-dump did not end")
    return proc.returncode, out, err


def _dump_cli(*args: str, umask: int | None = None, gate: str | None = None
              ) -> tuple[int, str, str]:
    return _finish(_start(*args, umask=umask, gate=gate))


def _only(folder) -> str:
    files = find_dump_files(str(folder))
    assert len(files) == 1, files
    return files[0]


def _all_records_readable(path: str) -> int:
    """Read every record of every round the file lists; returns the number of rounds."""
    with DumpReader(path) as r:
        known = set(r.rounds["round"].tolist())
        for rec in r.records:
            if int(rec["round"]) in known:
                assert np.isfinite(r.read(rec)).all()
        return len(r.rounds)


# -- killed mid-dump -------------------------------------------------------------------------


def test_a_command_stopped_before_it_imports_torch_is_said_so(tmp_path):
    """SIGTERM while the program is still starting (before torch): the end says the command
    was stopped before torch came in, not that srdd-dump may be installed in another Python."""
    script = tmp_path / "slow_start.py"
    script.write_text("import time\nprint('starting', flush=True)\ntime.sleep(60)\n"
                      "import torch\n")
    proc = _start("--exec", _command(str(script)), "-o", str(tmp_path / "d"),
                  "--min-free-gb", "0")
    assert proc.stdout.readline().startswith("starting")
    os.kill(proc.pid, signal.SIGTERM)
    code, _, err = _finish(proc)
    assert code == 128 + signal.SIGTERM, err
    assert "capture never started: the command was stopped by SIGTERM before any Python " \
        "process of it imported torch" in err, err
    assert "installed in" not in err and "see its own error" not in err, err


def test_a_program_stopped_after_it_imported_torch_is_not_said_to_be_before(tmp_path):
    """SIGTERM to the program (a server waiting for requests) after it imported torch and
    before its first forward: the end said "stopped by SIGTERM before any Python process of it
    imported torch", sending the user to the install. Its process reported nothing: it never
    attached, so it had no SIGTERM handler yet."""
    script = tmp_path / "waits.py"
    script.write_text("import os, time\nimport torch\nprint('ready', os.getpid(), flush=True)\n"
                      "time.sleep(60)\n")
    proc = _start("--exec", _command(str(script)), "-o", str(tmp_path / "d"),
                  "--min-free-gb", "0")
    line = proc.stdout.readline()
    assert line.startswith("ready"), line
    os.kill(int(line.split()[1]), signal.SIGTERM)
    code, _, err = _finish(proc)
    assert code == 128 + signal.SIGTERM, err
    assert "nothing captured: the command was stopped by SIGTERM before any model with a " \
        "block stack ran a forward" in err, err
    assert "imported torch" not in err, err


@pytest.mark.parametrize("how", ["SIGKILL to the program", "SIGTERM to srdd-dump",
                                 "SIGHUP to srdd-dump", "SIGHUP to the process group"])
def test_killed_mid_dump_keeps_every_finished_sample(how, tmp_path):
    arch = "llama" if how.startswith("SIGKILL") else "toy"
    proc = _start("--exec", _command(_script(tmp_path), "100000", "0.3", "12", arch),
                  "-o", str(tmp_path / "d"), "--samples", "100000", "--min-free-gb", "0")
    # round 3 was handed to the writer two forwards (0.6 s of sleeps) before forward 5
    pid = _wait_for_forward(proc, 5)
    if how.startswith("SIGKILL"):
        os.kill(pid, signal.SIGKILL)
        want = 128 + signal.SIGKILL
    else:
        # srdd-dump first asks the program's capture to finish its file, then forwards the
        # signal; Python dies of SIGTERM (SIGHUP: a closed ssh session) without exit handlers
        sent = signal.SIGHUP if how.startswith("SIGHUP") else signal.SIGTERM
        if how.endswith("process group"):  # a closed ssh session: the program gets it too
            os.killpg(proc.pid, sent)
        else:
            os.kill(proc.pid, sent)
        want = 128 + sent
    code, _, err = _finish(proc)
    assert code == want, err
    name = signal.Signals(want - 128).name
    assert f"the command was killed by {name} (exit code {want})" in err
    assert "Traceback" not in err
    path = _only(tmp_path / "d")
    rounds = _all_records_readable(path)
    assert rounds >= 4
    result = compare_path(str(tmp_path / "d"), progress=False)
    files = result.files.iloc[0]
    with DumpReader(path) as r:
        assert r.n_samples == rounds  # every round is a finished sample
        complete = r.complete
        ended = r.status.get("program_error")
    if how.startswith("SIGKILL"):
        assert path.endswith(".h5.partial") and not complete
        assert f"{path}: the process writing it ended without finishing it; srdd-compare " \
            f"uses the {rounds} rounds written before" in err, err
        assert "); compare it with: srdd-compare " in err, err  # the run folder, as always
        assert files["status"] == "incomplete" and "(.partial file)" in files["reason"]
        # said on the terminal too, with what the file cannot say (its evidence counts)
        assert any(n.endswith("(.partial file); the " f"{rounds} rounds written were used; the "
                              "evidence its capture could not get is counted at the end: "
                              "unknown here") for n in result.notes), result.notes
    else:
        assert path.endswith(".h5") and complete, err
        assert "ended without finishing it" not in err and files["status"] != "incomplete"
        # the file says the run was stopped (a later reader would take it for a short run)
        assert ended == f"stopped by {name}", ended
        assert f"the program ended while capturing (stopped by {name})" in \
            " ".join(result.notes)
    assert files["rounds"] == rounds and set(result.layers["samples"]) == {rounds}


def _toy_first_forward(tmp_path, name: str, forward: str) -> str:
    """A program of one forward of a 3-block toy (16 wide, 8 tokens) whose blocks run
    ``forward`` (the body of Block.forward: ``self.index``, the module's ``calls`` list)
    before their own work; prints "finished" after it."""
    script = tmp_path / name
    script.write_text(textwrap.dedent("""
        import os, time
        import torch
        calls = []
        class Block(torch.nn.Module):
            def __init__(self, index):
                super().__init__()
                self.linear = torch.nn.Linear(16, 16)
                self.index = index
            def forward(self, x):
        {forward}
                return x + torch.tanh(self.linear(x))
        class Toy(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = torch.nn.Embedding(32, 16)
                self.layers = torch.nn.ModuleList(Block(i) for i in range(3))
            def forward(self, input_ids):
                h = self.embed(input_ids)
                for block in self.layers:
                    h = block(h)
                return h
        with torch.no_grad():
            Toy().eval()(input_ids=torch.arange(8)[None])
        print("finished", flush=True)
    """).replace("{forward}", textwrap.indent(textwrap.dedent(forward), " " * 8)))
    return str(script)


def test_sigterm_inside_the_first_probed_round_says_so(tmp_path):
    """Stopped while the first forward is being probed (its replays cost several forwards):
    the end says that round was under way, not that no prefill was seen. The program's block
    waits inside its first replay until it is killed, so the signal lands there."""
    script = _toy_first_forward(tmp_path, "slow_first.py", """
        calls.append(1)
        if len(calls) == 4:  # the 3 blocks ran: the first replay of the probes
            print("forward 1", os.getpid(), flush=True)
            while True:
                time.sleep(0.1)
    """)
    proc = _start("--exec", _command(script), "-o", str(tmp_path / "d"), "--min-free-gb", "0")
    _wait_for_forward(proc, 1)
    os.kill(proc.pid, signal.SIGTERM)
    code, out, err = _finish(proc)
    assert code == 128 + signal.SIGTERM, err
    assert "finished" not in out
    assert "the capture was stopped inside its first round (sample 1's prefill over 3 " \
           "layers, being probed" in err, err
    assert "no prefill seen" not in err and "Traceback" not in err, err


def test_a_first_forward_that_raises_is_not_said_to_be_stopped(tmp_path):
    """The program's first forward raises inside its second block: that round never
    finished, said so (not "stopped": nothing stopped it; not "no prefill seen")."""
    script = _toy_first_forward(tmp_path, "raises.py", """
        if self.index == 1:
            raise RuntimeError("device out of memory")
    """)
    code, _, err = _dump_cli("--exec", _command(script), "-o", str(tmp_path / "d"),
                             "--min-free-gb", "0")
    assert code == 1 and "RuntimeError: device out of memory" in err, err
    assert "the first round (sample 1's prefill over 3 layers, being probed: each layer is " \
           "replayed several times, a cost of several forwards) never finished: the " \
           "program's forward raised" in err, err
    assert "stopped inside" not in err and "no prefill seen" not in err, err


# -- Ctrl-C ----------------------------------------------------------------------------------


def test_ctrl_c_reaches_the_program_and_the_dump_is_finalised(tmp_path):
    proc = _start("--exec", _command(_script(tmp_path), "100000", "0.2", "12", "llama"),
                  "-o", str(tmp_path / "d"), "--samples", "100000", "--min-free-gb", "0")
    _wait_for_forward(proc, 2)
    os.kill(proc.pid, signal.SIGINT)  # to srdd-dump only, as `kill -INT` would
    code, out, err = _finish(proc)
    # The program's own exit code: KeyboardInterrupt's traceback and 1 for a program that
    # loaded a transformers model, death by SIGINT (130) for a plain Python program.
    assert code in (1, 128 + signal.SIGINT), err
    assert "KeyboardInterrupt" in err
    assert "finished" not in out
    path = _only(tmp_path / "d")
    assert path.endswith(".h5") and f"srdd-dump: wrote {path}" in err
    with DumpReader(path) as r:
        assert r.complete and len(r.rounds) >= 3
    assert compare_path(path, progress=False).files["status"].tolist() == ["ok"]


def test_ctrl_c_before_any_model_ran_is_said_as_such(tmp_path):
    """Ctrl-C while the program loads its model: one line that the command was stopped by
    SIGINT, not "failed (exit code -2)" beside "killed by SIGINT (exit code 130)"."""
    script = tmp_path / "slow.py"
    script.write_text("import time\nimport torch\nprint('forward 1 0', flush=True)\n"
                      "time.sleep(60)\n")
    proc = _start("--exec", f"{sys.executable} {script}", "-o", str(tmp_path / "d"),
                  "--min-free-gb", "0")
    _wait_for_forward(proc, 1)
    os.kill(proc.pid, signal.SIGINT)
    code, _, err = _finish(proc)
    assert code == 128 + signal.SIGINT, err
    assert "was stopped by SIGINT before any model" in err, err
    assert "exit code -" not in err


# -- file-size limit, full disk ----------------------------------------------------------------


def _check_capture_stopped(code: int, out: str, err: str, cause: str) -> None:
    assert code == 3, err
    assert "finished" in out  # the program ran to its end
    assert "Traceback" not in err and "Exception ignored" not in err
    # the toy's blocks hold no attention or MLP: the evidence line says so, apart
    assert "evidence missing: not captured: sub-layer sites" in err, err
    warnings = [line for line in err.splitlines()
                if "warning:" in line and "evidence missing" not in line]
    assert len(warnings) == 1 and "capture turned off" in warnings[0], err
    assert re.search(rf"error: pid \d+: capture failed: cannot write .*{cause}", err), err


def test_file_size_limit_stops_capture_before_the_file_breaks(tmp_path):
    limit = tmp_path / "limit.py"
    limit.write_text(LIMIT)
    cmd = _command(str(limit), "2300000", _script(tmp_path), "40", "0", "64", "toy")
    code, out, err = _dump_cli("--exec", cmd, "-o", str(tmp_path / "d"), "--samples", "1000",
                               "--probes", "none", "--min-free-gb", "0")
    _check_capture_stopped(code, out, err, r"file-size limit \(RLIMIT_FSIZE")
    path = _only(tmp_path / "d")
    assert path.endswith(".h5")  # finalised, with every round before the one that did not fit
    rounds = _all_records_readable(path)
    assert 1 <= rounds < 40
    with DumpReader(path) as r:
        assert not r.complete and "RLIMIT_FSIZE" in r.status["write_error"]
    result = compare_path(path, progress=False)
    assert result.files["status"].tolist() == ["incomplete"]
    assert "RLIMIT_FSIZE" in result.files["reason"][0]


def test_a_write_that_fails_anyway_is_survived(tmp_path):
    """The disk fills between the check and the write: HDF5 cannot close such a file, and
    closing it twice crashed the program at exit (SIGSEGV) before the file was detached."""
    limit = tmp_path / "limit.py"
    limit.write_text(LIMIT)
    cmd = _command(str(limit), "2000000", _script(tmp_path, prefix=NO_CHECK), "40", "0", "64",
                   "toy")
    code, out, err = _dump_cli("--exec", cmd, "-o", str(tmp_path / "d"), "--samples", "1000",
                               "--probes", "none", "--min-free-gb", "0")
    _check_capture_stopped(code, out, err, r"File too large \(errno 27\)")
    (run,) = os.listdir(tmp_path / "d")
    (broken,) = os.listdir(tmp_path / "d" / run)
    assert broken.endswith(".h5" + s.BROKEN_SUFFIX)  # set aside: its content is not trusted
    assert f"{broken}: a write failed half-way, so the file is set aside" in err
    proc = run_cli("srdd-compare", str(tmp_path / "d"), "-o", str(tmp_path / "r.csv"),
                   timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


@pytest.fixture
def small_disk(tmp_path):
    """A 2.5 MB tmpfs (root only); unmounted afterwards."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2500k", "tmpfs", str(mnt)], capture_output=True
    ).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_gate_and_stop(small_disk, tmp_path):
    out = small_disk / "d"
    cmd = _command(_script(tmp_path), "40", "0", "64", "toy")
    code, _, err = _dump_cli("--exec", cmd, "-o", str(out), "--samples", "1000", gate="")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err  # the default 2 GB gate refuses to start
    assert "GB free on its file system, 2 GB required" in lines[0] and "--min-free-gb 0" in err
    assert not out.exists()
    code, stdout, err = _dump_cli("--exec", cmd, "-o", str(out), "--samples", "1000",
                                  "--probes", "none", "--min-free-gb", "0")
    _check_capture_stopped(code, stdout, err, "MB free on the file system of")
    path = _only(out)
    assert path.endswith(".h5") and _all_records_readable(path) >= 1
    assert compare_path(path, progress=False).files["status"].tolist() == ["incomplete"]


@pytest.mark.parametrize("option, gate", [(["--min-free-gb", "1e9"], None), ([], "1e9")],
                         ids=["option", "environment"])
def test_free_space_gate_runs_before_the_command(tmp_path, option, gate):
    marker = tmp_path / "ran"
    cmd = _command("-c", f"open({str(marker)!r}, 'w')")
    code, _, err = _dump_cli("--exec", cmd, "-o", str(tmp_path / "new" / "d"), *option,
                             gate=gate)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("srdd-dump: error: -o ")
    assert "1e+09 GB required" in lines[0] and "--min-free-gb 0" in lines[0]
    assert not marker.exists() and not (tmp_path / "new").exists()


def test_the_option_overrides_the_machines_gate_and_a_bad_gate_is_one_line(tmp_path):
    marker = tmp_path / "ran"
    cmd = _command("-c", f"open({str(marker)!r}, 'w')")
    code, _, err = _dump_cli("--exec", cmd, "-o", str(tmp_path / "d"), "--min-free-gb", "0",
                             gate="1e9")
    assert code == 3 and marker.exists() and "no model" in err, err  # ran: no gate
    code, _, err = _dump_cli("--exec", cmd, "-o", str(tmp_path / "e"), gate="lots")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "SRDD_DUMP_MIN_FREE_GB" in lines[0], err


# -- the capture hook raises -------------------------------------------------------------------


def test_capture_error_mid_run_keeps_the_rounds_before(tmp_path):
    broken_hook = (
        "import torch\n"  # first: importing the hooks before torch defeats --exec's injection
        "import srdd_dump.capture.sinks as h\n"
        "_real, _calls = h.to_host, [0]\n"
        "def to_host(*a, **k):\n"
        "    _calls[0] += 1\n"
        "    if _calls[0] > 10:  # 5 tensors a round: rounds 0 and 1 go through\n"
        "        raise RuntimeError('simulated capture bug')\n"
        "    return _real(*a, **k)\n"
        "h.to_host = to_host\n"
    )
    cmd = _command(_script(tmp_path, prefix=broken_hook), "6", "0", "8", "toy")
    code, out, err = _dump_cli("--exec", cmd, "-o", str(tmp_path / "d"), "--probes", "none",
                               "--min-free-gb", "0")
    assert code == 3 and "finished" in out and out.count("forward") == 6
    assert "simulated capture bug" in err and "Traceback" not in err
    path = _only(tmp_path / "d")
    assert path.endswith(".h5") and _all_records_readable(path) == 2
    with DumpReader(path) as r:
        assert not r.complete and "simulated capture bug" in r.status["error"]
    result = compare_path(path, progress=False)
    assert result.files["status"].tolist() == ["incomplete"]


def test_program_raising_after_capture_keeps_its_exit_code_and_a_finished_dump(tmp_path):
    raises = LOOP + "raise ValueError('user bug')\n"
    script = tmp_path / "raises.py"
    script.write_text(raises)
    code, out, err = _dump_cli("--exec", _command(str(script), "2", "0", "8", "toy"),
                               "-o", str(tmp_path / "d"), "--min-free-gb", "0")
    assert code == 1 and "finished" in out
    assert "ValueError: user bug" in err  # the program's own traceback, untouched
    assert "srdd-dump: the command exited with code 1" in err
    path = _only(tmp_path / "d")
    assert path.endswith(".h5") and _all_records_readable(path) == 2
    with DumpReader(path) as r:
        assert r.complete
        assert r.status["program_error"] == "ValueError: user bug"
    # the dump copied off the device says how its program ended
    done = run_cli("srdd-compare", path, "-o", str(tmp_path / "r.csv"))
    assert done.returncode == 0
    assert ("the program ended while capturing (ValueError: user bug): the "
            "rounds before it are compared") in done.stderr


@pytest.mark.parametrize("ending", ["raises", "finishes", "exits"])
def test_the_dump_says_whether_an_error_ended_its_program(ending, tmp_path):
    """In code: a with block an exception leaves, a program an uncaught error ends (the hook
    closed at exit) keep that error in the file's status; a clean end or sys.exit keep none."""
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {FIXTURES!r})
        import torch
        from srdd_dump import DumpConfig, register_hook
        from tiny_models import build
        model = build("llama")
        ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(0))
        try:
            with register_hook(model, DumpConfig(dump_path={str(tmp_path / "a")!r})):
                model(input_ids=ids)
                if {ending!r} == "raises":
                    raise KeyError("in the block")
        except KeyError:
            pass
        register_hook(model, DumpConfig(dump_path={str(tmp_path / "b")!r}))
        model(input_ids=ids)
        if {ending!r} == "raises":
            raise RuntimeError("device lost")
        if {ending!r} == "exits":
            sys.exit(3)
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == {"raises": 1, "finishes": 0, "exits": 3}[ending], done.stderr
    with DumpReader(_only(tmp_path / "a")) as a, DumpReader(_only(tmp_path / "b")) as b:
        if ending == "raises":
            # the program caught it and went on: its block was left, the program did not end
            assert a.status["program_error"] == "its with register_hook block was left by " \
                "KeyError: 'in the block'"
            left = compare_path(str(tmp_path / "a"), progress=False)
            notes = left.notes
            assert left.headlines[0].endswith(
                "(prefill only: no decode step was captured before its with register_hook "
                "block was left by KeyError: 'in the block')"), left.headlines
            assert any(n.endswith(": the capture ended when its with register_hook block was "
                                  "left by KeyError: 'in the block': the rounds before it are "
                                  "compared") for n in notes), notes
            assert not any("the program ended" in n for n in notes), notes
            assert b.status["program_error"] == "RuntimeError: device lost"
            (line,) = compare_path(str(tmp_path / "b"), progress=False).headlines
            assert line.endswith("(prefill only: no decode step was captured before the "
                                 "program ended: RuntimeError: device lost)"), line
        else:
            assert a.status["program_error"] is None and b.status["program_error"] is None


# -- umask, odd paths --------------------------------------------------------------------------


def test_dump_files_honour_the_umask(tmp_path):
    code = textwrap.dedent(f"""
        import os, numpy as np
        from srdd_dump.format.writer import DumpWriter, Round, Tensor
        for mask in (0o077, 0o022, 0o027):
            os.umask(mask)
            w = DumpWriter(os.path.join({str(tmp_path)!r}, f"u{{mask:o}}.h5"), {{}}, ["b.0"])
            x = np.zeros((1, 4, 8), np.float32)
            w.submit(Round(sample=0, step=0, batch=1, seq=4, positions=np.arange(4),
                           tensors=[Tensor(layer=0, array=x, dtype="float32")]))
            w.close()
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    modes = {p: stat.S_IMODE(os.stat(tmp_path / p).st_mode) for p in os.listdir(tmp_path)}
    assert modes == {"u77.h5": 0o600, "u22.h5": 0o644, "u27.h5": 0o640}


def test_paths_with_spaces_and_non_ascii(tmp_path):
    """srdd-dump -o, the script's own path and srdd-compare's input and output, all with
    spaces, quotes and non-ASCII characters; the dump made under umask 077 is private."""
    odd = tmp_path / "dir with space" / "ünï cödé 数据 'q'"
    odd.mkdir(parents=True)
    script = _script(odd, "my loop é.py")
    dumps = odd / "dumps ü"
    cmd = _command(script, "3", "0", "8", "llama")
    code, out, err = _dump_cli("--exec", cmd, "-o", str(dumps), "--probes", "none",
                               "--min-free-gb", "0", umask=0o077)
    assert code == 0, err
    path = _only(dumps)
    run = os.path.dirname(path)  # the run's own folder in -o
    assert os.path.dirname(run) == str(dumps) and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with DumpReader(path) as r:
        assert r.meta["command"] == cmd
    for report in ("rapport été.xlsx", "報告 1.csv"):
        out_file = odd / "out ü" / report
        proc = run_cli("srdd-compare", str(dumps), "-o", str(out_file), "--quiet", timeout=60)
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        assert out_file.exists()
    sources = [row[0].value for row in openpyxl.load_workbook(odd / "out ü" / "rapport été.xlsx")
               ["files"].iter_rows(min_row=2)]
    assert sources == [os.path.relpath(path, dumps)]


# -- the child's environment, no shell ---------------------------------------------------------


def test_every_variable_passed_to_the_child_is_documented(tmp_path):
    env = child_env(DumpConfig(dump_path=str(tmp_path)), str(tmp_path))
    changed = {k for k, v in env.items() if os.environ.get(k) != v}
    assert changed == set(CHILD_ENV)
    env = child_env(DumpConfig(dump_path=str(tmp_path)), str(tmp_path), eager=True)
    assert {k for k, v in env.items() if os.environ.get(k) != v} == changed | set(EAGER_ENV)
    with open(os.path.join(ROOT, "docs", "cli.md"), encoding="utf-8") as fh:
        doc = fh.read()
    section = doc.split("### Environment passed to the command")[1].split("\n### ")[0]
    documented = set(re.findall(r"^\| `([A-Z_]+)` \|", section, flags=re.M))
    assert documented == set(CHILD_ENV) | set(EAGER_ENV)


def test_exec_arguments_are_never_expanded(tmp_path):
    marker = tmp_path / "pwned"
    res = run_cli("srdd-dump", "--exec",
                  f"echo $HOME `touch {marker}` $(touch {marker}) '*' '>' {marker}",
                  "-o", str(tmp_path / "d"), "--min-free-gb", "0", timeout=60)
    assert not marker.exists()
    assert res.stdout.strip() == f"$HOME `touch {marker}` $(touch {marker}) * > {marker}"
    assert res.returncode == 3  # echo is no Python program: nothing was captured
    res = run_cli("srdd-dump", "--exec", f"echo hi > {marker}", "-o", str(tmp_path / "d"),
                  timeout=60)
    assert res.returncode == 2 and not marker.exists()  # refused, never run


# -- reports: formula injection ----------------------------------------------------------------

EVIL = ["=HYPERLINK(\"http://x\",\"y\")", "+1+1", "-1+1", "@SUM(A1)", "\t=1", "\r=1"]


def _formula_dumps(tmp_path) -> str:
    rng = np.random.default_rng(0)
    folder = tmp_path / "=evil dir"
    for i, name in enumerate(("=cmd|' /C calc'!A0.h5", "@SUM(A1).h5", "+x.h5", "-x.h5")):
        write_dump(str(folder / name), normal_rounds(rng, layers=(-1, 0, 1, 2, 3)),
                   names=[EVIL[(i + k) % len(EVIL)] for k in range(4)],
                   meta={"rank": i, "pid": 100 + i})
    return str(folder)


def _assert_no_formulas(path) -> None:
    for ws in openpyxl.load_workbook(path).worksheets:
        for row in ws.iter_rows():
            for cell in row:
                assert cell.data_type != "f", (ws.title, cell.coordinate, cell.value)
                if isinstance(cell.value, str):
                    assert not cell.value.startswith(("=", "+", "@", "\t", "\r")), (
                        ws.title, cell.coordinate, cell.value)
                    assert not re.match(r"-[^0-9.i]", cell.value), (ws.title, cell.value)


def test_no_cell_of_any_report_sheet_is_a_formula(tmp_path):
    folder = _formula_dumps(tmp_path)
    compare_path(folder, str(tmp_path / "r.xlsx"), progress=False)
    _assert_no_formulas(tmp_path / "r.xlsx")
    first = find_dump_files(folder)[0]
    compare_baseline(folder, first, str(tmp_path / "b.xlsx"), progress=False)
    _assert_no_formulas(tmp_path / "b.xlsx")


# -- compare never unpickles -------------------------------------------------------------------

COMPARE_SIDE = ["srdd_dump/errors.py", "srdd_dump/compare", "srdd_dump/runtime",
                "srdd_dump/format", "srdd_dump/analysis", "srdd_dump/report", "cli/compare.py",
                "cli/compare_command.py"]


def _compare_side_sources() -> dict[str, str]:
    out = {}
    for entry in COMPARE_SIDE:
        path = os.path.join(ROOT, entry)
        files = [path] if path.endswith(".py") else [
            os.path.join(path, n) for n in sorted(os.listdir(path)) if n.endswith(".py")]
        for f in files:
            with open(f, encoding="utf-8") as fh:
                out[os.path.relpath(f, ROOT)] = fh.read()
    return out


def test_compare_side_code_has_no_deserialiser():
    banned_modules = {"pickle", "cPickle", "dill", "cloudpickle", "joblib", "marshal", "shelve",
                      "torch", "yaml"}
    banned_calls = {"load", "loads", "eval", "exec", "Unpickler"}
    for name, text in _compare_side_sources().items():
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not {a.name.split(".")[0] for a in node.names} & banned_modules, name
            elif isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] not in banned_modules, name
            elif isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                owner = getattr(getattr(func, "value", None), "id", "")
                assert not (called in banned_calls and owner not in ("json",)), (
                    name, ast.unparse(node))
                assert not any(k.arg == "allow_pickle" for k in node.keywords), name


def test_compare_runs_with_unpickling_disabled(tmp_path, monkeypatch):
    import pickle

    def refuse(*args, **kwargs):
        raise AssertionError("compare tried to unpickle")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(np, "load", refuse)
    monkeypatch.setitem(sys.modules, "torch", None)  # and torch cannot even be imported
    rng = np.random.default_rng(1)
    mine = write_dump(str(tmp_path / "m" / "a.h5"), normal_rounds(rng))
    golden = write_dump(str(tmp_path / "g" / "a.h5"), normal_rounds(rng))
    assert len(compare_path(mine, str(tmp_path / "r.xlsx"), progress=False).layers)
    assert len(compare_baseline(mine, golden, str(tmp_path / "b.xlsx"), progress=False).table)


def test_a_file_finished_by_a_process_killed_before_it_reported_keeps_its_missing_evidence(
        tmp_path):
    """A serving engine's worker finishes its file when asked, then is killed (SIGKILL) before
    it reports: the evidence its file says it could not get is still listed at the end."""
    from srdd_dump.capture.launch import _collect

    coverage = {"prefill attention references": {"expected": 12, "done": 0,
                                                 "first_error": "LlamaAttention: no layout"},
                "prefill block probes": {"expected": 4, "done": 4}}
    path = write_dump(str(tmp_path / "srdd_rank0_pid4321.h5"),
                      normal_rounds(np.random.default_rng(0)), meta={"rank": 0, "pid": 4321},
                      status={"coverage": coverage})
    status_dir = tmp_path / "status"
    status_dir.mkdir()
    result = _collect(0, str(status_dir), set(), {os.path.abspath(path)})
    assert result.files == [os.path.abspath(path)]
    assert len(result.degraded) == 1
    assert "prefill attention references (0 of 12 calls)" in result.degraded[0]
    assert "LlamaAttention: no layout" in result.degraded[0]


def test_an_unfinished_file_without_a_round_is_said_to_hold_no_evidence(tmp_path):
    """A rank killed at the start of its first round leaves a .partial with no round: the end
    said "srdd-compare uses the rounds written before", and srdd-compare then skipped it."""
    from srdd_dump.capture.launch import _collect
    from srdd_dump.format.writer import DumpWriter

    writer = DumpWriter(str(tmp_path / "run" / "srdd_rank0_pid7.h5"), {"rank": 0, "pid": 7},
                        ["model.layers.0"], max_pending=0)  # never closed: its process died
    status_dir = tmp_path / "status"
    status_dir.mkdir()
    result = _collect(-9, str(status_dir), {writer.partial_path})
    assert result.problems == [f"{writer.partial_path}: the process writing it ended before it "
                               "wrote a round: that process left no evidence"]
    assert result.partials == [] and result.folders() == {}


def test_a_command_whose_python_has_no_torch_is_told_so(tmp_path):
    """srdd-dump installed without its dump extra (a compare-only install): the end said "no
    model with a block stack ran a forward" and nothing of torch."""
    import json

    from srdd_dump.capture.launch import _collect

    status_dir = tmp_path / "status"
    status_dir.mkdir()
    for pid in (11, 12):
        (status_dir / f"{pid}.json").write_text(json.dumps(
            {"pid": pid, "files": [], "model_seen": False, "torch_missing": True}))
    (problem,) = _collect(0, str(status_dir)).problems
    assert "has no torch" in problem and "[dump] extra" in problem
    (problem,) = _collect(1, str(status_dir)).problems  # the program's `import torch` failed
    assert "has no torch" in problem and problem.endswith("failed (exit code 1)")
    (status_dir / "12.json").write_text(json.dumps({"pid": 12, "files": [],
                                                    "model_seen": False}))
    (problem,) = _collect(0, str(status_dir)).problems  # one process had torch
    assert "no model with a block stack ran a forward in any process" in problem
    for pid, imported in ((11, False), (12, False)):  # `python -c pass`: torch never imported
        (status_dir / f"{pid}.json").write_text(json.dumps(
            {"pid": pid, "files": [], "model_seen": False, "torch_imported": imported}))
    (problem,) = _collect(0, str(status_dir)).problems
    assert problem.startswith("no model ran: no Python process of the command imported torch")
    (status_dir / "12.json").write_text(json.dumps(
        {"pid": 12, "files": [], "model_seen": False, "torch_imported": True}))
    (problem,) = _collect(0, str(status_dir)).problems
    assert "imported torch but ran no model srdd-dump recognises" in problem


def test_forwards_srdd_dump_does_not_capture_keep_a_serving_file_open():
    """A serving engine's file is finished after IDLE seconds without a forward: the chunks of
    a long prefill it does not capture are forwards too (a generate call was split in two
    files when only captured rounds counted)."""
    from srdd_dump.capture.dump_file import FileWatch

    finished = []
    watch = FileWatch(lambda: finished.append(time.monotonic()), lambda: None, None,
                      seconds=2.0)
    watch.touch()  # a captured round
    end = time.monotonic() + 3.0
    while time.monotonic() < end:  # uncaptured forwards
        watch.busy()
        time.sleep(0.2)
    assert not finished
    deadline = time.monotonic() + 10
    while not finished and time.monotonic() < deadline:
        time.sleep(0.1)
    watch.stop()
    assert finished and finished[0] >= end + 1.5


def _ends_by_sigterm_with_one_finished_round(script, folder) -> None:
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGTERM and "survived" not in proc.stdout, proc.stderr
    (path,) = find_dump_files(str(folder))
    with DumpReader(path) as r:
        assert r.complete and len(r.rounds) == 1


def test_sigterm_inside_a_capture_hook_finishes_the_file_and_ends_the_process(tmp_path):
    """SIGTERM lands while a capture hook holds the writer queue's lock: the handler only wakes
    a thread, which finishes the file once the lock is free and then ends the process by
    SIGTERM (closing from the handler itself hung the process forever)."""
    script = tmp_path / "term.py"
    script.write_text(textwrap.dedent(f"""
        import os, queue, signal, sys, time
        sys.path.insert(0, {FIXTURES!r})
        import torch
        from tiny_models import build
        from srdd_dump.capture.config import DumpConfig
        from srdd_dump.capture.hooks import CaptureSession
        from srdd_dump.capture import inject
        model = build("llama", layers=2)
        session = CaptureSession(model, DumpConfig(dump_path={str(tmp_path / "d")!r},
                                                   samples=3, progress=False))
        import weakref
        inject._state["session"], inject._state["end"] = weakref.ref(session), session.end
        inject.finish_on_sigterm()
        put = queue.Queue._put
        def _put(self, item):  # Queue.put holds its mutex here
            if item is not None and not getattr(self, "_shot", False):
                self._shot = True
                os.kill(os.getpid(), signal.SIGTERM)
            put(self, item)
        queue.Queue._put = _put
        with torch.no_grad():
            model(torch.randint(0, 128, (1, 8)))
            time.sleep(30)
        print("survived")
    """))
    _ends_by_sigterm_with_one_finished_round(script, tmp_path / "d")


def test_a_session_dropped_in_another_thread_is_finished_by_a_sigterm(tmp_path):
    """A collection outside the main thread leaves the session for later (every weak
    reference to it is cleared by then): the SIGTERM path, which ends without the exit
    handlers, still finishes its file."""
    script = tmp_path / "term.py"
    script.write_text(textwrap.dedent(f"""
        import gc, os, signal, sys, threading, time, weakref
        sys.path.insert(0, {FIXTURES!r})
        import torch
        from tiny_models import build
        from srdd_dump.capture.config import DumpConfig
        from srdd_dump.capture.hooks import CaptureSession
        from srdd_dump.capture import inject

        def run():
            model = build("llama", layers=2)
            session = CaptureSession(model, DumpConfig(dump_path={str(tmp_path / "d")!r},
                                                       samples=3, progress=False))
            inject._state["session"], inject._state["end"] = weakref.ref(session), session.end
            with torch.no_grad():
                model(torch.randint(0, 128, (1, 8)))
            del model, session
            gc.collect()

        t = threading.Thread(target=run)
        t.start()
        t.join()
        inject.finish_on_sigterm()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        print("survived")
    """))
    _ends_by_sigterm_with_one_finished_round(script, tmp_path / "d")


def test_an_early_status_is_replaced_by_the_one_at_exit(tmp_path, monkeypatch):
    """A process whose hooks were compiled out says so at once (inject.report_early): the
    status at exit replaces it; the refusal watch reads that one too, not only the early one;
    only the status files count, not one being written."""
    import json

    from srdd_dump.capture import inject
    from srdd_dump.capture.config import ENV_STATUS_DIR
    from srdd_dump.capture.launch import _collect, _refused

    status_dir = tmp_path / "status"
    status_dir.mkdir()
    monkeypatch.setenv(ENV_STATUS_DIR, str(status_dir))
    monkeypatch.setitem(inject._state, "reported", False)
    inject.report_early({"model_seen": True, "compiled_out": True, "silence": "compiled out"})
    me = status_dir / f"{os.getpid()}.json"
    assert json.loads(me.read_text())["early"] is True
    (status_dir / "99.json.tmp").write_text("{")  # another process's, half written
    read: set[str] = set()
    assert _refused(str(status_dir), read) == [] and not read
    (problem,) = _collect(0, str(status_dir)).problems
    assert problem == f"pid {os.getpid()}: nothing captured: compiled out"
    me.write_text(json.dumps({"pid": os.getpid(), "files": [], "refused": "no blocks"}))
    assert _refused(str(status_dir), read) == [os.getpid()]
    monkeypatch.setitem(inject._state, "reported", True)  # once reported, never overwritten
    inject.report_early({"compiled_out": True})
    assert "refused" in json.loads(me.read_text())


def test_an_unfinished_file_with_empty_evidence_counts_knows_them():
    """A file whose capture failed before any probe (status coverage {}: nothing expected)
    knows its evidence counts; only a file without them (a .partial's) says "unknown here"."""
    from types import SimpleNamespace

    from srdd_dump.compare.sources import incomplete_reason

    def reason(status):
        return incomplete_reason(SimpleNamespace(path="d/srdd_rank0_pid1.h5", status=status,
                                                 rounds=np.zeros(2)))

    assert "unknown here" not in reason({"error": "OSError: disk full", "coverage": {}})
    assert reason({"error": "OSError: disk full"}).endswith(
        "the 2 rounds written were used; the evidence its capture could not get is counted "
        "at the end: unknown here")


@pytest.mark.unit
def test_a_server_stopped_by_a_signal_is_its_usual_end():
    """vllm serve ends with Ctrl-C or SIGTERM: its last file read "the program ended while
    capturing (stopped by SIGINT)", as if cut short; a program without requests still does."""
    from srdd_dump.compare.sources import capture_notes

    served = capture_notes("f.h5", {"program_error": "stopped by SIGINT", "requests": 12})
    assert "f.h5: the serving engine was stopped by SIGINT (a server's usual end): the " \
        "rounds finished before it are compared" in served, served
    assert not any("program ended" in n for n in served)
    plain = capture_notes("f.h5", {"program_error": "stopped by SIGINT", "requests": 0})
    assert "f.h5: the program ended while capturing (stopped by SIGINT): the rounds before " \
        "it are compared" in plain, plain
