"""srdd-dump --exec on unmodified scripts: injection, multi-process, exit codes, transparency."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from srdd_dump.errors import UserError
from srdd_dump.format import schema as s
from srdd_dump.format.reader import DumpReader, find_dump_files

from capture_utils import FIXTURES, py, run_cli, run_plain

pytestmark = [pytest.mark.integration, pytest.mark.capture]


# a user script's start: the tiny llama of fixtures/tiny_models.py as ``m``
TINY_LLAMA = (f"import sys; sys.path.insert(0, {FIXTURES!r})\n"
              "import torch\nfrom tiny_models import build\nm = build('llama')\n")


def _write(path, text):
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_exec_is_transparent_and_dumps(arch, tmp_path):
    plain, captured = tmp_path / "plain.json", tmp_path / "captured.json"
    res = run_cli("srdd-dump", "--exec", py("infer_tiny.py", arch, str(plain)), "-o",
                  str(tmp_path / "unused"), "--samples", "0")
    assert res.returncode == 2 and "--samples must be at least 1" in res.stderr
    run_plain([sys.executable, os.path.join(FIXTURES, "infer_tiny.py"), arch, str(plain)])
    res = run_cli("srdd-dump", "--exec", py("infer_tiny.py", arch, str(captured)), "-o",
                  str(tmp_path / "d"), "--steps", "all")
    assert res.returncode == 0, res.stderr
    assert json.loads(plain.read_text()) == json.loads(captured.read_text())
    (path,) = find_dump_files(str(tmp_path / "d"))
    assert os.path.basename(path).startswith("srdd_rank0_pid")
    with DumpReader(path) as r:
        assert r.complete and r.n_samples == 3
        assert r.meta["command"].endswith(f"{arch} {captured}")
        assert r.meta["model_config"]["num_hidden_layers"] == 4


def test_two_process_launcher_gives_one_file_per_rank(tmp_path):
    cmd = py("launch_two.py", os.path.join(FIXTURES, "infer_tiny.py"), "qwen2")
    res = run_cli("srdd-dump", "--exec", cmd, "-o", str(tmp_path))
    assert res.returncode == 0, res.stderr
    files = find_dump_files(str(tmp_path))
    assert sorted(os.path.basename(f)[:10] for f in files) == ["srdd_rank0", "srdd_rank1"]
    pids = set()
    for f in files:
        with DumpReader(f) as r:
            pids.add(r.meta["pid"])
            assert r.meta["world_size"] == "2"
            assert f"rank{r.meta['rank']}_pid{r.meta['pid']}" in f
    assert len(pids) == 2


def test_exit_code_propagates_and_dump_is_finalised(tmp_path):
    script = _write(tmp_path / "fails.py", (
        TINY_LLAMA +
        "with torch.no_grad(): m(input_ids=torch.randint(0, 128, (1, 6)))\n"
        "raise SystemExit(7)\n"))
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} {script}", "-o", str(tmp_path / "d"))
    assert res.returncode == 7
    (path,) = find_dump_files(str(tmp_path / "d"))
    assert path.endswith(".h5")
    with DumpReader(path) as r:
        assert r.complete and len(r.rounds) == 1


@pytest.mark.parametrize("broken, error, marker, said", [
    # the program's own prefill raises inside a block (a reshape that does not fit)
    ("m.model.layers[1].mlp", "shape is invalid", "never finished",
     "the program's forward raised, or the program ended inside it, so no round was written; "
     "the command failed (exit code 1): see its own error above"),
    # the model is called but fails before any block runs (its embedding raises): not --layers
    ("m.model.embed_tokens", "token id out of range", "nothing captured",
     "before any of its blocks ran: see the command's own error above"),
], ids=["in-a-block", "before-the-blocks"])
def test_a_program_that_fails_in_its_first_forward_is_pointed_at(broken, error, marker, said,
                                                                   tmp_path):
    """The end of the run says nothing was captured and that the command failed, pointing at
    its own error rather than only at capture."""
    script = _write(tmp_path / "breaks.py", (
        TINY_LLAMA +
        f"def broken(*args, **kwargs):\n    raise RuntimeError({error!r})\n"
        f"{broken}.forward = broken\n"
        "with torch.no_grad(): m(input_ids=torch.randint(0, 128, (1, 6)))\n"))
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} {script}", "-o", str(tmp_path / "d"))
    assert res.returncode == 1, res.stderr[-2000:]
    assert error in res.stderr  # the user's own error, theirs to see
    line = next(x for x in res.stderr.splitlines() if marker in x)
    assert said in line, line
    assert "--layers" not in line


def test_exception_in_script_propagates(tmp_path):
    script = _write(tmp_path / "raises.py", "raise ValueError('user bug')\n")
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} {script}", "-o", str(tmp_path / "d"))
    assert res.returncode == 1
    assert "user bug" in res.stderr  # the user's own traceback is theirs to see


def test_model_without_blocks_is_explained(tmp_path):
    script = _write(tmp_path / "mlp.py", (
        "import torch\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))\n"
        "print(m(torch.ones(3, 4)).shape)\n"))
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} {script}", "-o", str(tmp_path / "d"))
    assert res.returncode == 3
    assert "no stack of repeated blocks" in res.stderr and "--layers" in res.stderr
    assert "Traceback" not in res.stderr


def test_capture_failure_gives_nonzero_exit_after_the_command(tmp_path):
    script = _write(tmp_path / "bad.py", (
        f"import sys; sys.path.insert(0, {FIXTURES!r})\n"
        "import torch\nimport srdd_dump.capture.sinks as h\nfrom tiny_models import build\n"
        "def boom(*a, **k): raise RuntimeError('simulated capture bug')\n"
        "h.to_host = boom\n"
        "m = build('gpt2')\n"
        "with torch.no_grad(): y = m(input_ids=torch.randint(0, 128, (1, 6))).logits\n"
        "print('finished', y.shape)\n"))
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} {script}", "-o", str(tmp_path / "d"))
    assert "finished" in res.stdout
    assert res.returncode == 3
    assert "simulated capture bug" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("fault, message", [
    ("bias@layer=99", "--inject: layer 99 out of range: the captured blocks are layers 0-3 "
     "(model.layers.0 to model.layers.3)"),
    ("bias@layer=1,site=nope", "--inject: no site 'nope' in model.layers.1"),
])
def test_an_inject_the_model_lacks_stops_the_command(fault, message, tmp_path):
    """An --inject that no block of the model fits is known only when the model runs: the
    command is stopped then (exit 2, bad options), not after a whole run without capture."""
    script = _write(tmp_path / "long.py", (
        TINY_LLAMA + "import time\n"
        "with torch.no_grad():\n"
        "    for _ in range(600):\n"
        "        m(input_ids=torch.randint(0, 128, (1, 6)))\n"
        "        time.sleep(0.1)\n"
        "print('finished')\n"))
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} {script}", "-o", str(tmp_path / "d"),
                  "--inject", fault)
    assert res.returncode == 2
    assert "finished" not in res.stdout  # stopped, not run to its end (a minute) uncaptured
    lines = [line for line in res.stderr.splitlines() if line.startswith("srdd-dump")]
    assert len(lines) == 1 and lines[0].startswith(f"srdd-dump: error: {message}"), res.stderr
    assert "the command was stopped" in lines[0] and "Traceback" not in res.stderr
    assert not find_dump_files(str(tmp_path / "d"))


def test_an_inject_a_pool_workers_model_lacks_stops_the_program_too(tmp_path):
    """The model runs in a multiprocessing Pool's worker: the program is stopped as a whole
    (a worker that exited alone would leave Pool.map waiting for ever)."""
    script = _write(tmp_path / "pool.py", (
        f"import sys, time; sys.path.insert(0, {FIXTURES!r})\n"
        "import multiprocessing as mp\n"
        "def work(n):\n"
        "    import torch\n    from tiny_models import build\n    m = build('llama')\n"
        "    with torch.no_grad():\n"
        "        for _ in range(600):\n"
        "            m(input_ids=torch.randint(0, 128, (1, 6)))\n"
        "            time.sleep(0.1)\n"
        "    return n\n"
        "if __name__ == '__main__':\n"
        "    with mp.get_context('spawn').Pool(1) as pool:\n"
        "        print(pool.map(work, [1, 2]))\n"
        "    print('finished')\n"))
    # run directly and through a shell (which exits 143, not -15, when stopped): both were
    # stopped by srdd-dump and say so
    for command in (f"{sys.executable} {script}", f"sh -c '{sys.executable} {script}'"):
        res = run_cli("srdd-dump", "--exec", command, "-o", str(tmp_path / "d"),
                      "--inject", "bias@layer=99", timeout=300)
        assert res.returncode == 2 and "finished" not in res.stdout
        assert "srdd-dump: error: --inject: layer 99 out of range" in res.stderr
        assert "the command was stopped when its model first ran" in res.stderr, res.stderr


def test_a_refused_inject_leaves_no_process_to_speak_after_it(tmp_path):
    """vLLM's layout: the model runs in a worker that a core process started; when the worker
    stops, the core prints its own error ("RuntimeError: cancelled"). Every process of the
    command is stopped and waited for: srdd-dump's error is the last line."""
    script = _write(tmp_path / "engine.py", (
        f"import sys, time; sys.path.insert(0, {FIXTURES!r})\n"
        "import multiprocessing as mp\n"
        "def worker():\n"
        "    import torch\n    from tiny_models import build\n    m = build('llama')\n"
        "    with torch.no_grad():\n"
        "        for _ in range(600):\n"
        "            m(input_ids=torch.randint(0, 128, (1, 6)))\n"
        "            time.sleep(0.1)\n"
        "def core():\n"
        "    w = mp.get_context('spawn').Process(target=worker)\n    w.start()\n"
        "    while w.is_alive():\n        time.sleep(0.05)\n"
        "    time.sleep(1.5)\n"
        "    print('RuntimeError: cancelled', file=sys.stderr, flush=True)\n"
        "if __name__ == '__main__':\n"
        "    c = mp.get_context('spawn').Process(target=core)\n    c.start()\n"
        "    while c.is_alive():\n        time.sleep(0.05)\n"
        "    print('finished')\n"))
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} {script}", "-o", str(tmp_path / "d"),
                  "--inject", "bias@layer=99", timeout=300)
    assert res.returncode == 2 and "finished" not in res.stdout
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("srdd-dump: error: --inject: layer 99 out of range"), res.stderr
    assert "cancelled" not in res.stderr, res.stderr


@pytest.mark.parametrize("command, message", [
    ("", "needs a command"),
    ("no-such-program-xyz --flag", "command not found: no-such-program-xyz"),
    ("python 'unclosed", "cannot parse"),
    ("python x.py > out.txt", "'>' is shell syntax"),
    ("cd sub", "command not found: cd (--exec runs the command without a shell"),
])
def test_bad_exec_commands(command, message, tmp_path):
    res = run_cli("srdd-dump", "--exec", command, "-o", str(tmp_path))
    assert res.returncode == 2 and message in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_two_exec_commands_are_refused_before_either_runs(tmp_path):
    """`--exec A --exec B` ran B alone, without a word."""
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} -c print(1)", "--exec",
                  f"{sys.executable} -c print(2)", "-o", str(tmp_path / "d"))
    assert res.returncode == 2 and "--exec is given 2 times" in res.stderr
    assert res.stdout == "" and len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("code", [0, 4])
def test_a_program_ending_with_os_exit_leaves_a_finished_file(code, tmp_path):
    """os._exit skips atexit: the file was left .partial and a successful program's run ended
    with exit 3 ("ended without finishing it"). The program's own exit code stays."""
    body = ("import os\nwith torch.no_grad():\n"
            "    m.generate(torch.randint(1, 100, (1, 7)), max_new_tokens=2, do_sample=False,\n"
            "               pad_token_id=0)\nprint('finished', flush=True)\n")
    (tmp_path / "plain").mkdir()
    ended = _exec_tiny(tmp_path / "plain", "plain.py", body)
    (plain,) = find_dump_files(str(tmp_path / "plain" / "d"))
    res = _exec_tiny(tmp_path, "osexit.py", body + f"os._exit({code})\n")
    assert res.returncode == code and "finished" in res.stdout, res.stderr
    (path,) = find_dump_files(str(tmp_path / "d"))
    assert not path.endswith(".partial") and "without finishing" not in res.stderr
    with DumpReader(path) as r, DumpReader(plain) as p:
        assert ended.returncode == 0 and r.complete
        assert len(r.rounds) == len(p.rounds) and len(r.records) == len(p.records)


def test_a_tokens_range_that_keeps_nothing_says_so(tmp_path):
    """--tokens 5:2 keeps no position of any forward: refused before the command runs.
    --tokens 20: on 9-token prompts keeps none of these: the end says that, not "no prefill
    seen" (a 9-token prefill ran)."""
    script = _write(tmp_path / "gen.py", TINY_LLAMA + "with torch.no_grad():\n"
                    "    m.generate(torch.randint(1, 100, (1, 9)), max_new_tokens=2, "
                    "do_sample=False, pad_token_id=0)\nprint('finished')\n")
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} {script}", "-o", str(tmp_path / "d"),
                  "--tokens", "0:4,5:2")
    assert res.returncode == 2 and "finished" not in res.stdout
    assert "--tokens 5:2 keeps no position" in res.stderr
    from srdd_dump.capture.config import parse_tokens

    for empty in (":0", "-1:0", "-2:-8"):
        with pytest.raises(UserError, match=f"DumpConfig tokens {empty} keeps no position"):
            parse_tokens(empty)
    assert parse_tokens("-8:") and parse_tokens("2:-1") and parse_tokens("0:1")
    # an empty value (an unset shell variable) meant every position for --tokens, no probe
    # for --probes and was refused for --steps: refused alike, before the command runs
    for flag in ("--tokens", "--probes", "--steps", "--probe-steps"):
        res = run_cli("srdd-dump", "--exec", f"{sys.executable} {script}", "-o",
                      str(tmp_path / "e"), flag, " ")
        assert res.returncode == 2 and f"{flag} is empty: use " in res.stderr, res.stderr
        assert "finished" not in res.stdout and not (tmp_path / "e").exists()
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} {script}", "-o", str(tmp_path / "d"),
                  "--tokens", "20:")
    assert res.returncode == 3 and "finished" in res.stdout
    assert "--tokens 20: keeps no position of the forwards seen (the longest had 9 tokens)" \
        in res.stderr and "no prefill seen" not in res.stderr


def test_a_refused_inject_says_stopped_only_when_the_command_was(tmp_path):
    """A tiny model's program ended before srdd-dump's stop reached it ("done llama" printed):
    it was said to be "stopped when its model first ran"."""
    from srdd_dump.capture.launch import _collect

    (tmp_path / "7.json").write_text(json.dumps(
        {"pid": 7, "refused": "--inject dead_zone@layer=99: layer 99 out of range"}))
    ended = _collect(-9, str(tmp_path)).refused  # ended on its own (the OOM killer)
    stopped = _collect(0, str(tmp_path), stopped=True).refused  # torchrun's 0 after the stop
    assert ended == ["--inject dead_zone@layer=99: layer 99 out of range: the command ended "
                     "before srdd-dump could stop it, since pid 7 would capture nothing"]
    assert stopped == ["--inject dead_zone@layer=99: layer 99 out of range: the command was "
                       "stopped when its model first ran, since pid 7 would capture nothing"]
    # stopped while it was exiting (its atexit ran: "done llama" printed, its files written):
    # its work was done, not cut short
    (tmp_path / "7.json").write_text(json.dumps(
        {"pid": 7, "refused": "--inject dead_zone@layer=99: layer 99 out of range",
         "exiting": True}))
    assert _collect(-15, str(tmp_path), stopped=True).refused == ended


def test_msits_flags_name_what_does_their_job(tmp_path):
    """msit's -er read as "No such option: -e"; --token-range got "Possible options: --tokens",
    which keeps token positions, not rounds."""
    for flag in ("-er", "--token-range", "--execute-range=0,1"):
        res = run_cli("srdd-dump", "--exec", f"{sys.executable} -c pass", "-o",
                      str(tmp_path / "d"), flag, *(() if "=" in flag else ("0,1",)))
        name = flag.split("=", 1)[0]
        assert res.returncode == 2 and f"No such option: {name}; use --steps" in res.stderr, \
            res.stderr
        assert not (tmp_path / "d").exists()


def test_msprobes_config_keys_as_flags_name_what_does_their_job(tmp_path):
    """An msprobe user's --task statistics got "Possible options: --draws", --step "--help"."""
    for flag, said in (("--task", "use --store: stats for msprobe's task statistics"),
                       ("--step", "use --steps"), ("--level", "use --granularity")):
        res = run_cli("srdd-dump", "--exec", f"{sys.executable} -c pass", "-o",
                      str(tmp_path / "d"), flag, "1")
        assert res.returncode == 2 and f"No such option: {flag}; {said}" in res.stderr, \
            res.stderr
        assert "Possible options" not in res.stderr and not (tmp_path / "d").exists()


def test_steps_past_the_generation_say_so(tmp_path):
    """--steps 5-9 on a generation of 2 new tokens (steps 0-1): the end says the steps select
    none of the forwards seen, not "no prefill seen" (two prefills ran)."""
    script = _write(tmp_path / "gen.py", TINY_LLAMA + "with torch.no_grad():\n"
                    "    for _ in range(2):\n"
                    "        m.generate(torch.randint(1, 100, (1, 9)), max_new_tokens=2, "
                    "do_sample=False, pad_token_id=0)\nprint('finished')\n")
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} {script}", "-o", str(tmp_path / "d"),
                  "--steps", "5-9")
    assert res.returncode == 3 and "finished" in res.stdout
    assert "--steps 5-9 selects no step of the forwards seen (step 0 is a prompt's prefill; " \
        "the longest generation seen reached step 1)" in res.stderr, res.stderr
    assert "no prefill seen" not in res.stderr


def test_a_script_without_its_execute_bit_and_a_negative_free_space(tmp_path):
    script = tmp_path / "infer.py"
    script.write_text("print('hi')\n")
    res = run_cli("srdd-dump", "--exec", str(script), "-o", str(tmp_path / "d"))
    assert res.returncode == 2 and "permission denied (not executable" in res.stderr
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} {script}", "-o",
                  str(tmp_path / "d"), "--min-free-gb", "-1")
    assert res.returncode == 2 and "--min-free-gb -1.0: must be 0" in res.stderr
    assert "hi" not in res.stdout and not (tmp_path / "d").exists()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_an_output_folder_on_a_file_system_of_no_size_says_it_cannot_be_created(tmp_path):
    """/proc holds no files: the folder cannot be made (it once said '0.00 GB free')."""
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} -c print(1)", "-o", "/proc/nope")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "srdd-dump: error: -o /proc/nope: cannot create the folder (No such file or directory)"]


def test_a_read_only_file_system_is_named_as_such(tmp_path, monkeypatch):
    """A read-only mount reports no free space: it said "only 0.00 GB free ... free some
    space", which no deleting mends."""
    from srdd_dump.capture import diskspace

    real = os.statvfs
    monkeypatch.setattr(diskspace.os, "statvfs", lambda p: os.statvfs_result(
        (*real(p)[:8], os.ST_RDONLY, real(p).f_namemax)))
    with pytest.raises(UserError, match=r"^-o .*/d: its file system is read-only; choose"):
        diskspace.check_free_space(str(tmp_path / "d"), 2.0)


def test_exec_never_uses_a_shell(tmp_path):
    """Shell syntax outside quotes is refused before anything runs (it reached the program as
    plain arguments: `> out.txt` wrote no file and said nothing); quoted, it is an argument."""
    marker = tmp_path / "pwned"
    for command, operator in ((f"echo hi; touch {marker}", ";"),
                              (f"echo hi > {marker}", ">"), ("echo hi | tee x", "|"),
                              ("echo hi 2>&1", ">&"), (f"cd {tmp_path} && echo hi", "&&")):
        res = run_cli("srdd-dump", "--exec", command, "-o", str(tmp_path / "d"))
        assert res.returncode == 2 and res.stdout == "", res.stderr
        (line,) = res.stderr.splitlines()
        assert f"{operator!r} is shell syntax" in line and "bash -c" in line
    assert not marker.exists() and not (tmp_path / "d").exists()
    res = run_cli("srdd-dump", "--exec", f"echo 'hi;' '>' \\| \"{marker}&\"",
                  "-o", str(tmp_path / "d"))
    assert res.stdout.strip() == f"hi; > | {marker}&"  # quoted: plain arguments
    for command in ("cd sub", "FOO=1 python x.py"):
        res = run_cli("srdd-dump", "--exec", command, "-o", str(tmp_path / "d"))
        assert res.returncode == 2 and "without a shell" in res.stderr, res.stderr


def test_wheel_ships_the_sitecustomize(tmp_path):
    """A normal (non-editable) install must carry the file that starts capture in children."""
    import zipfile

    from capture_utils import ROOT

    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), ROOT], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("srdd_dump-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "srdd_dump/capture/inject/site/sitecustomize.py" in names
    assert "srdd_dump/cli/dump.py" in names
    assert not any(n.startswith("cli/") for n in names)  # no top-level package named cli


def test_script_importing_srdd_dump_before_torch_is_captured(tmp_path):
    script = _write(tmp_path / "early.py", (
        f"import sys; sys.path.insert(0, {FIXTURES!r})\n"
        "from srdd_dump import register_hook  # noqa: F401\n"
        "import torch\nfrom tiny_models import build\n"
        "m = build('llama')\n"
        "with torch.no_grad(): m(input_ids=torch.randint(0, 128, (1, 8)))\n"))
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} {script}", "-o", str(tmp_path / "d"))
    assert res.returncode == 0, res.stderr
    assert len(find_dump_files(str(tmp_path / "d"))) == 1


def test_output_named_like_a_file_is_one_line_and_a_program_that_changes_folder_dumps_there(
        tmp_path):
    """-o naming an existing file: one line, exit 2 (it once looped forever); a relative -o
    with a program that changes its working directory: the run folder stays where srdd-dump
    said, and the printed path is the one it wrote."""
    (tmp_path / "afile").write_text("")
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} -c pass", "-o", "afile",
                  cwd=str(tmp_path), timeout=60)
    assert res.returncode == 2 and "a file of that name exists" in res.stderr, res.stderr
    (tmp_path / "elsewhere").mkdir()
    script = _write(tmp_path / "moves.py", (
        TINY_LLAMA +
        f"import os\nos.chdir({str(tmp_path / 'elsewhere')!r})\n"
        "with torch.no_grad(): m(input_ids=torch.randint(0, 128, (1, 6)))\n"))
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} {script}", "-o", "dumps",
                  cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    (path,) = find_dump_files(str(tmp_path / "dumps"))
    assert not os.path.exists(tmp_path / "elsewhere" / "dumps")
    assert os.path.relpath(path, str(tmp_path)) in res.stderr


def _own_session_script(tmp_path, name: str, end: str, before: str = "") -> str:
    """A program that opens its own session (into tmp_path/own, 2 samples) after ``before``,
    generates from three prompts, then runs ``end``."""
    return _write(tmp_path / name, (
        TINY_LLAMA +
        "from srdd_dump import DumpConfig, register_hook\n" + before +
        f"session = register_hook(m, DumpConfig(dump_path={str(tmp_path / 'own')!r}, "
        "samples=2, progress=False))\n"
        "with torch.no_grad():\n"
        "    for n in (6, 7, 8):\n"
        "        m.generate(torch.randint(1, 100, (1, n)), max_new_tokens=2, do_sample=False,\n"
        "                   pad_token_id=0)\n" + end))


def test_a_program_with_its_own_register_hook_runs_under_exec(tmp_path):
    """The program opens its own session (register_hook) and srdd-dump --exec watches it too:
    one session captures the model (the program's, in its own folder, which srdd-dump lists),
    and the program runs to its end (it once died of a hook called after its removal)."""
    script = _own_session_script(tmp_path, "own.py", end="print('finished')\n")
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} {script}", "-o", str(tmp_path / "d"))
    assert res.returncode == 0, res.stderr
    assert "finished" in res.stdout and "Traceback" not in res.stderr
    (path,) = find_dump_files(str(tmp_path / "own"))
    assert path in res.stderr  # listed by srdd-dump
    with DumpReader(path) as r:
        assert r.complete and r.n_samples == 2
    assert not find_dump_files(str(tmp_path / "d"))
    # the folder to compare is the program's own, not srdd-dump's run folder, which is empty
    assert f"compare it with: srdd-compare {tmp_path / 'own'}" in res.stderr
    assert "run folder" not in res.stderr


def test_a_programs_register_hook_after_a_warm_up_takes_over_under_exec(tmp_path):
    """A warm-up forward before the program's own register_hook (a black-box user's script):
    srdd-dump's session had attached at the warm-up, so the program's session recorded
    nothing (its folder never made, session.path None) and srdd-dump's probed the warm-up.
    Now the program's session takes over from there, as when it comes first; srdd-dump's
    keeps the warm-up in its own file, said so."""
    script = _own_session_script(
        tmp_path, "warm.py", end="session.close()\nprint('path', session.path)\n",
        before="with torch.no_grad():\n    m(input_ids=torch.randint(1, 100, (1, 5)))\n")
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} {script}", "-o", str(tmp_path / "d"))
    assert res.returncode == 0, res.stderr
    (path,) = find_dump_files(str(tmp_path / "own"))
    assert f"path {path}" in res.stdout and path in res.stderr
    assert "captures its model itself (register_hook) from here on" in res.stderr
    with DumpReader(path) as r:
        assert r.complete and r.n_samples == 2
        assert [int(x["seq"]) for x in r.rounds if x["step"] == 0] == [6, 7]
        assert any(x["kind"] != s.KIND_CLEAN for x in r.records)  # its first prompt probed
    (warm,) = find_dump_files(str(tmp_path / "d"))  # the warm-up, in srdd-dump's own file
    with DumpReader(warm) as r:
        assert [int(x["seq"]) for x in r.rounds] == [5]


def test_two_sessions_of_the_program_in_two_folders_are_both_listed(tmp_path):
    """A program that captures two models itself, each into its own folder: srdd-dump lists
    both files and both folders to compare (the second was once not mentioned at all)."""
    script = _write(tmp_path / "two.py", (
        TINY_LLAMA +
        "m2 = build('llama', seed=1)\n"
        "from srdd_dump import DumpConfig, register_hook\n"
        f"a = register_hook(m, DumpConfig(dump_path={str(tmp_path / 'a')!r}, progress=False))\n"
        "b = register_hook(m2, DumpConfig(dump_path='b', progress=False))\n"  # relative
        "with torch.no_grad():\n"
        "    for n in (6, 7):\n"
        "        m(torch.randint(1, 100, (1, n))); m2(torch.randint(1, 100, (1, n)))\n"
        "print('finished')\n"))
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} {script}", "-o", str(tmp_path / "d"),
                  cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("srdd-dump: wrote ") == 2, res.stderr  # each file once
    for folder in ("a", "b"):
        (path,) = find_dump_files(str(tmp_path / folder))
        assert f"srdd-dump: wrote {path}" in res.stderr
        assert f"compare it with: srdd-compare {tmp_path / folder}" in res.stderr
    assert "run folder" not in res.stderr


def test_the_compare_command_it_prints_can_be_pasted(tmp_path):
    """An output folder with a space and a quote: the printed srdd-compare command is quoted
    for the shell, and running it as printed compares the run."""
    script = _write(tmp_path / "one.py", TINY_LLAMA + "with torch.no_grad():\n"
                    "    m(torch.randint(1, 100, (1, 7)))\n")
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} {script}", "-o",
                  str(tmp_path / "my dumps" / "it's"))
    assert res.returncode == 0, res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if "compare it with: " in ln]
    tool, *args = shlex.split(line.split("compare it with: ")[1])
    done = run_cli(tool, *args, "-o", str(tmp_path / "report.csv"), "-q")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "report.csv").exists()


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_pool_used_as_a_context_manager_leaves_finished_files(context, tmp_path):
    """`with Pool(...) as pool:` ends with Pool.terminate (SIGTERM to the workers): a worker
    finishes its file first, so the run is complete and the exit code is the program's."""
    _write(tmp_path / "work.py", (
        f"import sys; sys.path.insert(0, {FIXTURES!r})\n"
        "def work(n):\n"
        "    import torch\n    from tiny_models import build\n"
        "    m = build('llama')\n"
        "    with torch.no_grad():\n"
        "        out = m.generate(torch.randint(1, 100, (1, n)), max_new_tokens=2,\n"
        "                         do_sample=False, pad_token_id=0)\n"
        "    return out.shape[1]\n"))
    script = _write(tmp_path / "main.py", (
        "import multiprocessing as mp\nfrom work import work\n"
        "if __name__ == '__main__':\n"
        f"    with mp.get_context({context!r}).Pool(1) as pool:\n"
        "        print(pool.map(work, [6]))\n"))
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} {script}", "-o", str(tmp_path / "d"),
                  cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert "[8]" in res.stdout
    (path,) = find_dump_files(str(tmp_path / "d"))
    with DumpReader(path) as r:
        assert r.complete and r.n_samples == 1


def test_a_script_that_does_not_exist_or_a_bad_sigma(tmp_path):
    """The command's own error, its exit code, and one line saying why nothing was captured;
    a negative --sigma is refused before the command runs."""
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} {tmp_path / 'nope.py'}", "-o",
                  str(tmp_path / "d"))
    assert res.returncode == 2 and "can't open file" in res.stderr
    assert "the command failed (exit code 2) before any model" in res.stderr
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} -c pass", "-o", str(tmp_path / "d"),
                  "--sigma", "-0.1")
    assert res.returncode == 2 and "sigma must be a positive number" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    # a size given twice would be probed twice (twice the draws): refused, as a repeated dc
    for option, value in (("--sigma", "0.1"), ("--dc", "1")):
        res = run_cli("srdd-dump", "--exec", f"{sys.executable} -c pass", "-o",
                      str(tmp_path / "d"), option, value, option, value)
        assert res.returncode == 2, res.stderr
        assert res.stderr.strip().splitlines() == [
            f"srdd-dump: error: {option} {value} is given twice; give each value once"]
    # an option's value of the wrong kind, an unknown option: one line too, not click's usage
    for args in (["--draws", "two"], ["--bogus"]):
        res = run_cli("srdd-dump", *args, "--exec", f"{sys.executable} -c pass", "-o",
                      str(tmp_path / "d"))
        assert res.returncode == 2 and res.stderr.startswith("srdd-dump: error: "), res.stderr
        assert len(res.stderr.strip().splitlines()) == 1 and "Usage:" not in res.stderr


def _exec_tiny(tmp_path, name: str, body: str):
    """srdd-dump --exec of a script: the tiny llama as ``m``, then ``body``; dumps in d/."""
    script = _write(tmp_path / name, TINY_LLAMA + body)
    return run_cli("srdd-dump", "--exec", f"{sys.executable} {script}", "-o", str(tmp_path / "d"))


def test_a_program_with_stderr_closed_runs_and_is_captured(tmp_path):
    """A program without stderr (started with ``2>&-``, a daemon: ``sys.stderr`` is None)
    printed nothing and exited 1 under capture (the progress bar asked None isatty): it runs
    as without capture, and its dump is written."""
    script = _write(tmp_path / "closed.py", (
        "import sys; sys.stderr = None\n"
        "import torch\nfrom torch import nn\n"
        "class Block(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = nn.Linear(16, 16)\n"
        "    def forward(self, x):\n"
        "        return x + self.lin(x)\n"
        "class Toy(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.layers = nn.ModuleList([Block() for _ in range(3)])\n"
        "    def forward(self, x):\n"
        "        for b in self.layers:\n"
        "            x = b(x)\n"
        "        return x\n"
        "torch.manual_seed(0)\n"
        "m = Toy().eval()\n"
        "with torch.no_grad():\n"
        "    y = m(torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(0)))\n"
        "print('DONE', round(float(y.sum()), 4), flush=True)\n"))
    plain = run_plain([sys.executable, script])
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} {script}", "-o", str(tmp_path / "d"),
                  "--granularity", "block")
    assert res.returncode == 0 and res.stdout == plain.stdout, res.stdout + res.stderr
    (path,) = find_dump_files(str(tmp_path / "d"))
    with DumpReader(path) as r:
        assert r.complete and r.n_samples == 1


def test_assisted_generation_captures_the_model_generating_not_its_assistant(tmp_path):
    res = _exec_tiny(tmp_path, "assisted.py", (
        "draft = build('llama', seed=1, layers=2)\n"
        "with torch.no_grad():\n"
        "    for n in (6, 7):\n"
        "        out = m.generate(torch.randint(1, 100, (1, n)), max_new_tokens=4,\n"
        "                         do_sample=False, pad_token_id=0, assistant_model=draft)\n"
        "        print(out.tolist())\n"))
    assert res.returncode == 0, res.stderr
    assert "LlamaForCausalLM runs inside LlamaForCausalLM.generate (an assistant model): " \
           "not captured" in res.stderr
    (path,) = find_dump_files(str(tmp_path / "d"))
    with DumpReader(path) as r:
        assert r.meta["model_config"]["num_hidden_layers"] == 4  # m, not the 2-layer draft


def test_a_second_model_built_after_capture_began_is_said_once(tmp_path):
    res = _exec_tiny(tmp_path, "two_models.py", (
        "for dtype in (torch.float32, torch.bfloat16):\n"
        "    if dtype is torch.bfloat16:\n"
        "        m = build('llama', dtype=dtype)\n"
        "    with torch.no_grad():\n"
        "        m.generate(torch.randint(1, 100, (1, 6)), max_new_tokens=2, do_sample=False,\n"
        "                   pad_token_id=0)\n"
        "print('done')\n"))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "done"
    assert res.stderr.count("srdd-dump: note: another model was built after capture began "
                            "(LlamaModel.layers: 4 x LlamaDecoderLayer") == 1
    (path,) = find_dump_files(str(tmp_path / "d"))
    with DumpReader(path) as r:
        assert r.n_samples == 1  # the first model's prompt only


def test_a_forked_child_that_builds_its_own_model_is_captured_without_a_note(tmp_path):
    """A fork child building and running a model of its own: captured in its own file, so no
    "another model was built" note (it was said for the child's model, which srdd-dump did
    capture)."""
    res = _exec_tiny(tmp_path, "fork_child.py", (
        "import multiprocessing as mp\n"
        "torch.set_num_threads(1)\n"
        "def child():\n"
        "    c = build('llama', seed=2)\n"
        "    with torch.no_grad():\n"
        "        c.generate(torch.randint(1, 100, (1, 5)), max_new_tokens=2, do_sample=False,\n"
        "                   pad_token_id=0)\n"
        "if __name__ == '__main__':\n"
        "    with torch.no_grad():\n"
        "        m.generate(torch.randint(1, 100, (1, 6)), max_new_tokens=2, do_sample=False,\n"
        "                   pad_token_id=0)\n"
        "    p = mp.get_context('fork').Process(target=child)\n"
        "    p.start()\n"
        "    p.join()\n"
        "    print(p.exitcode)\n"))
    assert res.returncode == 0 and res.stdout.strip() == "0", res.stderr
    assert "another model was built" not in res.stderr, res.stderr
    files = find_dump_files(str(tmp_path / "d"))
    assert len(files) == 2
    for path in files:
        with DumpReader(path) as r:
            assert r.complete and r.n_samples == 1


def test_a_model_the_program_drops_is_freed_and_its_file_finished_then(tmp_path):
    """del model; gc.collect() frees the model under capture (a program loading one model
    after another would otherwise hold them all): its session goes with it and finishes the
    file at once, and srdd-dump still reports it."""
    res = _exec_tiny(tmp_path, "drop.py", (
        "import gc, os, weakref\n"
        "with torch.no_grad():\n"
        "    m.generate(torch.randint(1, 100, (1, 6)), max_new_tokens=2, do_sample=False,\n"
        "               pad_token_id=0)\n"
        "alive = weakref.ref(m)\n"
        "del m\n"
        "gc.collect()\n"
        f"done = [f for _, _, fs in os.walk({str(tmp_path / 'd')!r}) for f in fs]\n"
        "print('freed' if alive() is None else 'alive', done)\n"))
    assert res.returncode == 0, res.stderr
    freed, files = res.stdout.strip().split(" ", 1)
    assert freed == "freed"
    assert files.endswith(".h5']") and "partial" not in files  # finished before the exit
    assert "warning" not in res.stderr and "wrote" in res.stderr
    (path,) = find_dump_files(str(tmp_path / "d"))
    with DumpReader(path) as r:
        assert r.n_samples == 1


def test_a_warning_the_program_shows_once_shows_once_under_capture(tmp_path):
    """Capture imports its file library at torch's import, not at the first forward, where
    its import's warnings.catch_warnings let the program's shown warnings show again."""
    res = _exec_tiny(tmp_path, "warns.py", (
        "import warnings\n"
        "def old_api():\n"
        "    warnings.warn('old_api is deprecated', FutureWarning)\n"
        "for n in (5, 6):\n"
        "    old_api()\n"
        "    with torch.no_grad():\n"
        "        m.generate(torch.randint(1, 100, (1, n)), max_new_tokens=2, do_sample=False,\n"
        "                   pad_token_id=0)\n"))
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("FutureWarning: old_api is deprecated") == 1, res.stderr


@pytest.mark.unit
def test_the_requests_line_says_more_than_n_once_capture_stopped_counting():
    from srdd_dump.capture.launch import ExecResult

    assert ExecResult(0).requests_line(8) is None  # no serving engine ran
    assert ExecResult(0, requests=3).requests_line(8) == (
        "3 requests seen by the serving engine, each captured as one sample")
    # 12 requests, --samples 1: capture closed after the second, which it counted
    assert ExecResult(0, requests=2).requests_line(1) == (
        "more than 1 request seen by the serving engine; the first captured as one sample "
        "(the later ones were not counted)")
    assert ExecResult(0, requests=9).requests_line(8) == (
        "more than 8 requests seen by the serving engine; the first 8 captured, one sample "
        "each (the later ones were not counted)")
    assert ExecResult(0, requests=1).requests_line(8) == (
        "1 request seen by the serving engine, captured as one sample")


def test_threads_that_start_the_model_at_once_get_one_session_and_file(tmp_path):
    """Four threads whose first forwards start together: one session attaches (its file alone,
    its thread's forwards), the program's outputs are those of a plain run."""
    body = (
        "import threading\n"
        "ids = [torch.randint(1, 100, (1, n), generator=torch.Generator().manual_seed(n))\n"
        "       for n in (6, 7, 8, 9)]\n"
        "go = threading.Barrier(4)\n"
        "out = {}\n"
        "def work(i):\n"
        "    go.wait()\n"
        "    with torch.no_grad():\n"
        "        out[i] = m.generate(ids[i], max_new_tokens=3, do_sample=False,\n"
        "                            pad_token_id=0).tolist()\n"
        "ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
        "print([out[i] for i in range(4)])\n")
    plain = run_plain([sys.executable, _write(tmp_path / "plain.py", TINY_LLAMA + body)])
    res = _exec_tiny(tmp_path, "threads.py", body)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-1] == plain.stdout.splitlines()[-1]
    assert "Traceback" not in res.stderr and "capture turned off" not in res.stderr
    assert len(find_dump_files(str(tmp_path / "d"))) == 1


def test_a_run_that_wrote_nothing_leaves_no_empty_folder(tmp_path):
    """A command that fails before its first forward (a black-box user's missing script,
    crash, refused option): its empty run folder went, the -o folder made for it stayed."""
    script = _write(tmp_path / "fails.py", "import torch\nraise SystemExit(4)\n")
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} {script}", "-o",
                  str(tmp_path / "new" / "out"))
    assert res.returncode == 4, res.stderr
    assert not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()  # a folder the user made is never removed
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} {script}", "-o",
                  str(tmp_path / "kept"))
    assert res.returncode == 4 and (tmp_path / "kept").is_dir() and not os.listdir(
        tmp_path / "kept")
