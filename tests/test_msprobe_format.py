"""Real msprobe dumps read as they are (srdd_dump/format/msprobe.py): fixtures/msprobe/."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from srdd_dump.errors import UserError
from srdd_dump.format.msprobe import is_msprobe_dump, read_msprobe

from capture_utils import FIXTURES, run_cli

DUMP = os.path.join(FIXTURES, "msprobe", "smollm2_bf16")


def test_a_real_msprobe_dump_is_read_call_by_call():
    assert is_msprobe_dump(DUMP)
    (run,) = read_msprobe(DUMP)
    assert (run.step, run.rank, run.task, run.level) == (0, None, "tensor", "L0")
    assert len(run.calls) == 30 * 3 * 2  # decoder layer, attention and MLP; prefill + decode
    blocks = [c for c in run.calls if c.cls == "LlamaDecoderLayer"]
    assert {c.module for c in blocks} == {f"model.layers.{i}" for i in range(30)}
    assert {c.call for c in blocks} == {0, 1}
    prefill = next(c for c in blocks if c.module == "model.layers.5" and c.call == 0)
    x = run.tensor(prefill)
    assert list(x.shape) == prefill.output["shape"] and x.shape[1] > 1
    # the statistics msprobe wrote agree with the tensor read back
    assert x.max() == pytest.approx(prefill.output["Max"], rel=1e-6)
    assert x.min() == pytest.approx(prefill.output["Min"], rel=1e-6)
    # (msprobe computes the norm in the tensor's own dtype: bfloat16, 3 significant digits)
    assert float(np.linalg.norm(x.astype(np.float64))) == pytest.approx(
        prefill.output["Norm"], rel=1e-2)
    decode = next(c for c in blocks if c.module == "model.layers.5" and c.call == 1)
    assert run.tensor(decode).shape[1] == 1


def test_not_a_dump_and_a_damaged_one_get_one_line(tmp_path):
    assert not is_msprobe_dump(str(tmp_path))
    with pytest.raises(UserError, match="no msprobe dump.json"):
        read_msprobe(str(tmp_path))
    bad = tmp_path / "step0" / "rank0"
    bad.mkdir(parents=True)
    (bad / "dump.json").write_text("{not json")
    with pytest.raises(UserError) as err:
        read_msprobe(str(tmp_path))
    assert "dump.json" in str(err.value) and "\n" not in str(err.value)
    (bad / "dump.json").write_text(json.dumps({"framework": "mindspore", "data": {}}))
    with pytest.raises(UserError, match="mindspore"):
        read_msprobe(str(tmp_path))


def test_a_statistics_dump_has_no_tensors_to_read(tmp_path):
    copy = tmp_path / "stats"
    shutil.copytree(DUMP, copy)
    path = copy / "step0" / "proc4242" / "dump.json"
    doc = json.loads(path.read_text())
    for entry in doc["data"].values():
        for t in entry["output"]:
            if isinstance(t, dict):
                t.pop("data_name", None)
    doc["task"] = "statistics"
    path.write_text(json.dumps(doc))
    (run,) = read_msprobe(str(copy))
    assert not any(c.has_tensor for c in run.calls)
    with pytest.raises(UserError, match="no saved tensor"):
        run.tensor(run.calls[0])


def _edited(tmp_path, edit) -> str:
    """A copy of the real dump with dump.json's data changed by ``edit(data, folder)``."""
    copy = tmp_path / "dump"
    shutil.copytree(DUMP, copy)
    folder = copy / "step0" / "proc4242"
    doc = json.loads((folder / "dump.json").read_text())
    edit(doc["data"], folder)
    if doc["data"]:
        (folder / "dump.json").write_text(json.dumps(doc))
    return str(copy)


BLOCK0 = "Module.model.layers.0.LlamaDecoderLayer.forward.0"


def _truncate(data, folder):
    pt = folder / "dump_tensor_data" / data[BLOCK0]["output"][0]["data_name"]
    pt.write_bytes(pt.read_bytes()[:300])


def _wrong_size(data, folder):
    data[BLOCK0]["output"][0]["shape"] = [1, 7, 576]


def _only_children(data, folder):
    for name in list(data):
        del data[name]
    data["Module.model.layers.0.mlp.act_fn.SiLUActivation.forward.0"] = {"output": [
        {"type": "torch.Tensor", "dtype": "torch.bfloat16", "shape": [1, 4, 1536]}]}


ODD = {
    "a shape that is not a list": lambda d, f: d[BLOCK0]["output"][0].update(shape="1x40"),
    "an entry that is not a table": lambda d, f: d.update({BLOCK0: 5}),
    "an output of null": lambda d, f: d[BLOCK0].update(output=None),
    "a data_name that is not text": lambda d, f: d[BLOCK0]["output"][0].update(data_name=3),
    "null statistics": lambda d, f: d[BLOCK0]["output"][0].update(Max=None, Norm=None),
}
def _inputs_only(data, folder):
    for entry in data.values():
        entry["input_args"] = entry.pop("output")


def _no_tensor_folder(data, folder):
    shutil.rmtree(folder / "dump_tensor_data")


def _no_dump_json(data, folder):
    os.remove(folder / "dump.json")
    data.clear()


BROKEN = {
    "children that are no site": (_only_children, "holds no output of a block"),
    # a half-copied dump and one of inputs only: said as such (the advice was to add the
    # decoder layer class to msprobe's list, which it was)
    "inputs only": (_inputs_only, "records module inputs only (data_mode input); "
                    "srdd-compare reads outputs: dump with data_mode output or all"),
    "no dump_tensor_data": (_no_tensor_folder, "has no dump_tensor_data folder (a dump "
                            "copied without it?)"),
    "no dump.json": (_no_dump_json, "msprobe run folders without their dump.json"),
}
# tensor files that cannot be read: left out and named, the rest compared (a copy cut short)
UNREADABLE = {
    "a truncated .pt file": (_truncate, "cannot read it as a saved tensor"),
    "a .pt of another size than dump.json says": (_wrong_size, "dump.json says shape"),
}


@pytest.mark.parametrize("name", ODD)
def test_odd_entries_are_left_out_and_the_rest_is_read(tmp_path, name):
    path = _edited(tmp_path, ODD[name])
    proc = run_cli("srdd-compare", path, "-o", str(tmp_path / "r.csv"))
    assert proc.returncode == 0, proc.stderr
    assert "30 rows" in proc.stdout and "Traceback" not in proc.stderr


@pytest.mark.parametrize("name", UNREADABLE)
def test_an_unreadable_tensor_file_is_left_out_and_named(tmp_path, name):
    edit, words = UNREADABLE[name]
    proc = run_cli("srdd-compare", _edited(tmp_path, edit), "-o", str(tmp_path / "r.csv"))
    assert proc.returncode == 0, proc.stderr
    assert "tensor files of the msprobe dump could not be read" in proc.stderr
    assert words in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("name", BROKEN)
def test_a_damaged_dump_is_one_line(tmp_path, name):
    edit, words = BROKEN[name]
    proc = run_cli("srdd-compare", _edited(tmp_path, edit), "-o", str(tmp_path / "r.csv"))
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "unexpected" not in proc.stderr


def test_the_dump_a_step_or_a_rank_folder_is_read():
    ranks = os.path.join(FIXTURES, "msprobe", "smollm2_bf16_ranks")
    whole = [(r.step, r.rank) for r in read_msprobe(ranks)]
    assert whole == [(0, 0), (0, 1)]
    assert [(r.step, r.rank) for r in read_msprobe(os.path.join(ranks, "step0"))] == whole
    (one,) = read_msprobe(os.path.join(ranks, "step0", "rank1"))
    assert (one.step, one.rank) == (0, 1)


def test_the_conversion_cache_drops_earlier_versions_and_unused_entries(tmp_path):
    """Each changed msprobe dump is converted again into a new folder: the earlier versions of
    the same dump, and conversions not read for CACHE_DAYS, are removed."""
    import os
    import time

    from srdd_dump.compare.sources import CACHE_DAYS, _prune_cache
    from srdd_dump.format.from_msprobe import cache_folder

    dump = tmp_path / "dump"
    (dump / "step0" / "rank0").mkdir(parents=True)
    (dump / "step0" / "rank0" / "dump.json").write_text("{}")
    root = tmp_path / "cache"
    root.mkdir()
    first = cache_folder(str(dump), str(root))
    os.makedirs(first)
    (dump / "step0" / "rank0" / "dump.json").write_text('{"task": "tensor"}')  # changed
    now = cache_folder(str(dump), str(root))
    assert now != first and os.path.basename(now).rsplit("-", 1)[0] == \
        os.path.basename(first).rsplit("-", 1)[0]
    unused, recent = root / "msprobe-aaaaaaaaaaaa-1", root / "msprobe-bbbbbbbbbbbb-2"
    unused.mkdir()
    recent.mkdir()
    old = time.time() - (CACHE_DAYS + 1) * 86400
    os.utime(unused, (old, old))
    os.makedirs(now)
    _prune_cache(now)
    assert sorted(os.listdir(root)) == sorted([os.path.basename(now), recent.name])


@pytest.mark.parametrize("recorded", ["outputs (a child first)", "starts (inputs recorded)"])
def test_the_sites_of_a_block_are_in_the_order_their_outputs_were_made(recorded):
    """The sites were sorted by name (mlp before self_attn): the first divergence inside a
    block, read in that order, named the MLP where the attention had already diverged."""
    from srdd_dump.format.msprobe import ModuleCall
    from srdd_dump.format.msprobe_rounds import Layout

    made = ["input_layernorm", "self_attn.q_proj", "self_attn.o_proj", "self_attn",
            "post_attention_layernorm", "mlp.down_proj", "mlp"]
    started = ["input_layernorm", "self_attn", "self_attn.q_proj", "self_attn.o_proj",
               "post_attention_layernorm", "mlp", "mlp.down_proj"]
    order = made if recorded.startswith("outputs") else started
    cls = {"input_layernorm": "LlamaRMSNorm", "post_attention_layernorm": "LlamaRMSNorm",
           "self_attn": "LlamaAttention", "mlp": "LlamaMLP"}
    calls = [ModuleCall(f"model.layers.{i}.{name}", cls.get(name, "Linear"), 0)
             for i in range(2) for name in order]
    calls += [ModuleCall(f"model.layers.{i}", "LlamaDecoderLayer", 0) for i in range(2)]
    layout = Layout(calls)
    assert [name for name, layer, _ in layout.sites if layer == 1] == [
        f"model.layers.1.{name}" for name in made]
