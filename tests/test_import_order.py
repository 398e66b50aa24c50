"""srdd-dump --exec attaches whatever the program's import order and process layout.

Scripts are written the way users write them: ``from transformers import ...`` before
``import torch`` (transformers probes ``importlib.util.find_spec("torch")`` before importing
it, and so does vLLM's env_override), torch imported lazily inside a function, ``python -m``,
``runpy``, torch imported only in a multiprocessing child (spawn, forkserver, fork) and torchrun
children. Each one must leave a complete dump file per process that ran the model.
"""

from __future__ import annotations

import os
import shutil
import sys
import textwrap

import pytest

from srdd_dump.format.reader import DumpReader, find_dump_files

from capture_utils import run_cli

pytestmark = [pytest.mark.integration, pytest.mark.capture]

# The model part of every script: transformers first, torch after it, a tiny Llama generating.
MODEL_CODE = """
def run_model(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    import torch

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=64, num_attention_heads=4,
                         num_hidden_layers=3, intermediate_size=128, num_key_value_heads=2,
                         max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    print("tokens", out[0].tolist(), flush=True)
"""


def _script(tmp_path, name: str, *parts: str) -> str:
    path = tmp_path / name
    path.write_text("\n".join(textwrap.dedent(part) for part in parts))
    return str(path)


def _dump(tmp_path, command: str, *options: str):
    out = tmp_path / "dumps"
    res = run_cli("srdd-dump", "--exec", command, "-o", str(out), "--quiet", *options)
    assert res.returncode == 0, res.stderr
    assert "evidence missing" not in res.stderr, res.stderr
    return find_dump_files(str(out)), res


def _assert_captured(files: list[str], n_files: int = 1) -> None:
    assert len(files) == n_files, files
    for path in files:
        assert path.endswith(".h5"), path  # finished, not .partial
        with DumpReader(path) as r:
            assert r.complete
            assert r.n_samples == 1 and len(r.layers) == 3
            assert (r.rounds["step"] > 0).any(), "no decode step was captured"


def test_transformers_imported_before_torch(tmp_path):
    script = _script(tmp_path, "infer.py", """
        from transformers import LlamaConfig, LlamaForCausalLM  # the usual first line
        import torch
    """, MODEL_CODE, "run_model()\n")
    files, _ = _dump(tmp_path, f"{sys.executable} {script}")
    _assert_captured(files)


def test_find_spec_probe_before_import(tmp_path):
    # vLLM's env_override and transformers' import_utils ask whether torch is installed
    # before importing it
    script = _script(tmp_path, "infer.py", """
        import importlib.util
        assert importlib.util.find_spec("torch") is not None
        assert importlib.util.find_spec("torch") is not None  # asked again
        import torch
    """, MODEL_CODE, "run_model()\n")
    files, _ = _dump(tmp_path, f"{sys.executable} {script}")
    _assert_captured(files)


def test_torch_imported_lazily_in_a_function(tmp_path):
    script = _script(tmp_path, "infer.py", MODEL_CODE, """
        def main():
            run_model()

        if __name__ == "__main__":
            main()
    """)
    files, _ = _dump(tmp_path, f"{sys.executable} {script}")
    _assert_captured(files)


def test_python_dash_m_package(tmp_path):
    package = tmp_path / "myinfer"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "model.py").write_text(textwrap.dedent(MODEL_CODE))
    (package / "__main__.py").write_text("from myinfer.model import run_model\nrun_model()\n")
    out = tmp_path / "dumps"
    res = run_cli("srdd-dump", "--exec", f"{sys.executable} -m myinfer", "-o", str(out),
                  "--quiet", cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    _assert_captured(find_dump_files(str(out)))


def test_runpy_run_path(tmp_path):
    script = _script(tmp_path, "infer.py", MODEL_CODE, "run_model()\n")
    launcher = _script(tmp_path, "launch.py", f"""
        import runpy
        runpy.run_path({script!r}, run_name="__main__")
    """)
    files, _ = _dump(tmp_path, f"{sys.executable} {launcher}")
    _assert_captured(files)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_torch_only_in_a_multiprocessing_child(method, tmp_path):
    script = _script(tmp_path, "infer.py", MODEL_CODE, f"""
        import multiprocessing as mp
        import sys

        if __name__ == "__main__":
            assert "torch" not in sys.modules
            child = mp.get_context({method!r}).Process(target=run_model)
            child.start()
            child.join()
            sys.exit(child.exitcode)
    """)
    files, _ = _dump(tmp_path, f"{sys.executable} {script}")
    _assert_captured(files)


def test_forked_child_gets_its_own_file_and_leaves_the_parents(tmp_path):
    script = _script(tmp_path, "infer.py", MODEL_CODE, """
        import multiprocessing as mp
        import sys

        if __name__ == "__main__":
            import torch

            # a fork after torch's intra-op thread pool has run deadlocks, capture or not
            torch.set_num_threads(1)
            run_model()  # the parent's model: its session exists before the fork
            child = mp.get_context("fork").Process(target=run_model, args=(1,))
            child.start()
            child.join()
            sys.exit(child.exitcode)
    """)
    files, _ = _dump(tmp_path, f"{sys.executable} {script}")
    _assert_captured(files, n_files=2)
    pids = set()
    for path in files:
        with DumpReader(path) as r:
            pids.add(r.meta["pid"])
    assert len(pids) == 2


@pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None,
                    reason="torchrun is not installed beside this interpreter")
def test_torchrun_children(tmp_path):
    script = _script(tmp_path, "infer.py", """
        from transformers import LlamaConfig, LlamaForCausalLM
        import torch
    """, MODEL_CODE, "run_model()\n")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    files, _ = _dump(tmp_path, f"{torchrun} --standalone --nproc_per_node 2 {script}")
    _assert_captured(files, n_files=2)
    assert sorted(os.path.basename(f)[:10] for f in files) == ["srdd_rank0", "srdd_rank1"]


def test_a_plain_fork_child_leaves_the_parents_file_intact(tmp_path):
    # the child exits normally (atexit, the HDF5 library's close at exit) while the parent's
    # file is open and the parent writes more rounds afterwards
    script = _script(tmp_path, "infer.py", """
        from transformers import LlamaConfig, LlamaForCausalLM
        import os
        import sys
        import time
        import torch

        torch.set_num_threads(1)
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=128, hidden_size=64, num_attention_heads=4,
                             num_hidden_layers=3, intermediate_size=128,
                             num_key_value_heads=2, max_position_embeddings=256)
        model = LlamaForCausalLM(config).eval()
        with torch.no_grad():
            model(input_ids=torch.randint(0, 128, (1, 9)))
            pid = os.fork()
            if pid == 0:
                time.sleep(3)  # exits after the parent wrote the next rounds
                sys.exit(0)
            for _ in range(2):
                model(input_ids=torch.randint(0, 128, (1, 9)))
            time.sleep(1)  # the parent's writer thread has written them
            os.waitpid(pid, 0)
    """)
    files, _ = _dump(tmp_path, f"{sys.executable} {script}", "--samples", "3")
    (path,) = files
    with DumpReader(path) as r:
        assert r.complete and r.n_samples == 3 and len(r.rounds) == 3
        for layer in range(3):
            assert len(r.select(layer)) == 3
            assert r.read(r.select(layer)[-1]).std() > 0
