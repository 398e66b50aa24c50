"""The in-code API on tiny random models: what is captured, and that it is exactly right."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch import nn

from srdd_dump import DumpConfig, register_hook
from srdd_dump.capture.discovery import NoBlocksFound, find_blocks
from srdd_dump.format import schema
from srdd_dump.format.reader import DumpReader

from tiny_models import ARCHS, blocks_path, build

pytestmark = [pytest.mark.integration, pytest.mark.capture]


def _reference_outputs(model, blocks, ids):
    """Block outputs and stack input recorded by independent hooks."""
    got = {}
    handles = [
        blocks[0][1].register_forward_pre_hook(
            lambda m, a, k: got.__setitem__(-1, (a[0] if a else k["hidden_states"]).clone()),
            with_kwargs=True,
        )
    ]
    for i, (_, b) in enumerate(blocks):
        def hook(m, a, out, i=i):
            got[i] = (out[0] if isinstance(out, tuple) else out).clone()
        handles.append(b.register_forward_hook(hook))
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    return got


@pytest.mark.parametrize("arch", ARCHS)
def test_captures_every_block_exactly(arch, tmp_path):
    model = build(arch)
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(3))
    blocks = find_blocks(model)
    assert [n for n, _ in blocks] == [f"{blocks_path(arch)}.{i}" for i in range(4)]
    expected = _reference_outputs(model, blocks, ids)

    with register_hook(model, DumpConfig(dump_path=str(tmp_path))) as session:
        with torch.no_grad():
            model(input_ids=ids)
    with DumpReader(session.path) as r:
        assert r.complete
        assert r.layers == [n for n, _ in blocks]
        assert r.meta["model_class"].endswith(type(model).__name__)
        assert r.meta["block_class"] == type(blocks[0][1]).__name__
        assert len(r.rounds) == 1 and r.rounds[0]["batch"] == 2 and r.rounds[0]["seq"] == 11
        np.testing.assert_array_equal(r.token_ids(r.rounds[0]), ids.numpy().reshape(-1))
        for layer in range(-1, 4):
            (rec,) = r.select(layer)
            np.testing.assert_array_equal(r.read(rec), expected[layer].numpy())


def test_bf16_is_stored_losslessly(tmp_path):
    model = build("llama", dtype=torch.bfloat16)
    ids = torch.randint(0, 128, (1, 7))
    blocks = find_blocks(model)
    expected = _reference_outputs(model, blocks, ids)
    with register_hook(model, DumpConfig(dump_path=str(tmp_path))) as session:
        with torch.no_grad():
            model(input_ids=ids)
    with DumpReader(session.path) as r:
        rec = r.select(2)[0]
        assert r.dtype_of(rec) == "bfloat16"
        assert r.meta["hidden_dtype"] == "bfloat16"
        stored = r.f["data"][r.data_names[int(rec["data"])]][int(rec["row0"]):][: int(rec["nrows"])]
        assert stored.dtype == np.uint16
        np.testing.assert_array_equal(r.read(rec), expected[2].float().numpy())


def test_samples_steps_and_tokens_select_what_is_kept(tmp_path):
    model = build("llama")
    cfg = DumpConfig(dump_path=str(tmp_path), samples=2, steps="0,2-3", tokens="-3:")
    prompts = [torch.randint(0, 128, (1, n)) for n in (6, 8, 5)]
    with register_hook(model, cfg) as session:
        with torch.no_grad():
            for ids in prompts:
                model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    with DumpReader(session.path) as r:
        got = [(int(x["sample"]), int(x["step"]), int(x["seq"]), int(x["ntok"])) for x in r.rounds]
        assert got == [(0, 0, 6, 3), (0, 2, 1, 1), (0, 3, 1, 1),
                       (1, 0, 8, 3), (1, 2, 1, 1), (1, 3, 1, 1)]
        np.testing.assert_array_equal(r.positions(r.rounds[3]), [5, 6, 7])
        assert r.n_samples == 2


def test_a_one_token_prompt_is_a_sample_of_its_own(tmp_path):
    # generate() starts it with an empty KV cache: its first forward is a prefill of one
    # token, not the next decode step of the prompt before (found by a user trial)
    model = build("llama")
    cfg = DumpConfig(dump_path=str(tmp_path), samples=3, steps="0-2", probe_steps="0,2")
    prompts = [torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n))
               for n in (6, 1, 5)]
    with register_hook(model, cfg) as session:
        with torch.no_grad():
            for ids, new in zip(prompts, (1, 3, 3)):
                model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)
    with DumpReader(session.path) as r:
        got = [(int(x["sample"]), int(x["step"]), int(x["seq"])) for x in r.rounds]
        assert got == [(0, 0, 6), (1, 0, 1), (1, 1, 1), (1, 2, 1), (2, 0, 5), (2, 1, 1),
                       (2, 2, 1)]
        probed = sorted({(int(r.rounds[int(x["round"])]["sample"]),
                          int(r.rounds[int(x["round"])]["step"]))
                         for x in r.records if x["kind"] != schema.KIND_CLEAN})
        # the prefill probed in the first sample, step 2 in the first that reached it
        assert (0, 0) in probed and (1, 2) in probed and (2, 2) not in probed

def test_kept_positions_hold_the_right_values(tmp_path):
    model = build("qwen2")
    ids = torch.randint(0, 128, (1, 10))
    expected = _reference_outputs(model, find_blocks(model), ids)
    with register_hook(model, DumpConfig(dump_path=str(tmp_path), tokens="0,4:6,-1")) as s:
        with torch.no_grad():
            model(input_ids=ids)
    with DumpReader(s.path) as r:
        rec = r.select(1)[0]
        np.testing.assert_array_equal(r.read(rec), expected[1][:, [0, 4, 5, 9]].numpy())


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class _Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.small = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.stages = nn.ModuleList([_Block() for _ in range(5)])

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.stages:
            x = b(x)
        return x


def test_custom_module_and_layers_pattern(tmp_path):
    model = _Custom()
    assert [n for n, _ in find_blocks(model)] == [f"stages.{i}" for i in range(5)]
    names = [n for n, _ in find_blocks(model, "stages.*")]
    assert names == [f"stages.{i}" for i in range(5)]  # children like stages.0.lin are not blocks
    with register_hook(model, DumpConfig(dump_path=str(tmp_path), layers="stages.[13]")) as s:
        model(torch.randint(0, 20, (1, 4)))
    with DumpReader(s.path) as r:
        assert r.layers == ["stages.1", "stages.3"]


def test_nothing_found_names_the_largest_candidates():
    model = nn.Sequential(nn.Linear(4, 300), nn.ReLU(), nn.Linear(300, 4))
    model = nn.ModuleDict({"encoder": model, "head": nn.Linear(4, 2)})
    with pytest.raises(NoBlocksFound, match=r"largest candidates: encoder \(Sequential"):
        find_blocks(model)
    with pytest.raises(NoBlocksFound, match="matches no module"):
        find_blocks(build("gpt2"), "model.layers.*")


def test_a_failing_hook_turns_capture_off_but_inference_goes_on(tmp_path, monkeypatch, capsys):
    model = build("llama")
    ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    session = register_hook(model, DumpConfig(dump_path=str(tmp_path)))
    with torch.no_grad():
        model(input_ids=ids)  # one good sample
    import srdd_dump.capture.sinks as sinks

    def boom(*a, **k):
        raise RuntimeError("device copy failed")

    monkeypatch.setattr(sinks, "to_host", boom)
    with torch.no_grad():
        got = model(input_ids=ids).logits
        again = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(again, want, rtol=0, atol=0)
    assert "device copy failed" in session.error
    assert capsys.readouterr().err.count("capture turned off") == 1
    with DumpReader(session.path) as r:  # what was written before is kept
        assert len(r.rounds) == 1
        assert not r.complete and "device copy failed" in r.status["error"]


@pytest.mark.parametrize("debug", [False, True])
def test_a_capture_error_shows_its_traceback_with_debug_only(tmp_path, monkeypatch, capsys, debug):
    import srdd_dump.capture.sinks as sinks

    def boom(*a, **k):
        raise RuntimeError("device copy failed")

    monkeypatch.setattr(sinks, "to_host", boom)
    model = build("llama")
    session = register_hook(model, DumpConfig(dump_path=str(tmp_path), debug=debug,
                                              progress=False))
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 6)))
    err = capsys.readouterr().err
    assert "capture turned off: RuntimeError: device copy failed" in err
    assert ("Traceback (most recent call last)" in err) == debug
    assert ("in boom" in err) == debug
    session.close()


def _chat_turns(model) -> None:
    """A prompt, then a second turn given the first turn's cache (4 new tokens)."""
    first = model.generate(torch.randint(1, 100, (1, 6)), max_new_tokens=3, do_sample=False,
                           pad_token_id=0, return_dict_in_generate=True)
    turn = torch.cat([first.sequences, torch.randint(1, 100, (1, 4))], dim=1)
    model.generate(turn, past_key_values=first.past_key_values, max_new_tokens=3,
                   do_sample=False, pad_token_id=0)


def _probed_rounds(path) -> set[tuple[int, int]]:
    with DumpReader(path) as r:
        return {(int(x["sample"]), int(x["step"])) for x in r.rounds if x["prow_len"] > 0}


def test_a_prompt_after_a_cached_past_is_captured_unprobed_and_said(tmp_path, capsys):
    """A second chat turn given the first turn's cache (or a speculative / prompt-lookup
    verification: several tokens after a cached past) is a sample captured without probes:
    a replay without that past failed and turned capture off before."""
    model = build("llama")
    config = DumpConfig(dump_path=str(tmp_path), probe_samples=2, progress=False)
    with register_hook(model, config) as session, torch.no_grad():
        _chat_turns(model)
    assert session.error is None
    err = capsys.readouterr().err
    # the cache holds the first turn but its last token, which comes with the 4 new ones
    assert "not probed: continued prefill probes (0 of 1 calls): a forward of 5 tokens " \
           "after 8 cached ones" in err
    with DumpReader(session.path) as r:
        assert r.complete and r.n_samples == 2
    probed = _probed_rounds(session.path)
    assert (0, 0) in probed and (1, 0) not in probed


def test_probes_a_later_prompt_took_from_a_continued_turn_are_not_missing(tmp_path, capsys):
    model = build("llama")
    config = DumpConfig(dump_path=str(tmp_path), probe_samples=2, progress=False)
    with register_hook(model, config) as session, torch.no_grad():
        _chat_turns(model)
        model.generate(torch.randint(1, 100, (1, 7)), max_new_tokens=3, do_sample=False,
                       pad_token_id=0)
    assert "continued prefill probes" not in capsys.readouterr().err
    probed = _probed_rounds(session.path)
    assert {(0, 0), (2, 0)} <= probed and (1, 0) not in probed


def test_a_continued_turn_on_a_static_cache_is_not_replayed_either(tmp_path):
    from transformers import StaticCache

    model = build("llama")
    try:
        cache = StaticCache(config=model.config, max_cache_len=64)
    except TypeError:  # transformers 4.x
        cache = StaticCache(config=model.config, max_batch_size=1, max_cache_len=64)
    with torch.no_grad():
        first = model.generate(torch.randint(1, 100, (1, 6)), past_key_values=cache,
                               max_new_tokens=3, do_sample=False, pad_token_id=0,
                               return_dict_in_generate=True)
        turn = torch.cat([first.sequences, torch.randint(1, 100, (1, 4))], dim=1)
        with register_hook(model, DumpConfig(dump_path=str(tmp_path), progress=False)) as s:
            model.generate(turn, past_key_values=first.past_key_values, max_new_tokens=3,
                           do_sample=False, pad_token_id=0)
    assert s.error is None  # its length is a device tensor: the attention mask gives it


def test_a_generation_without_kv_cache_is_said_to_have_no_decode_step(tmp_path, capsys):
    model = build("llama")
    with register_hook(model, DumpConfig(dump_path=str(tmp_path), progress=False)), \
            torch.no_grad():
        model.generate(torch.randint(1, 100, (1, 6)), max_new_tokens=3, do_sample=False,
                       pad_token_id=0, use_cache=False)
    err = capsys.readouterr().err
    assert "decode steps with a KV cache (0 of 2 calls): each new token recomputed the " \
           "whole sequence" in err
    # a hand-written greedy loop over the whole sequence: transformers 5 gives each call an
    # empty cache of its own (no past either), and it went unsaid
    with register_hook(model, DumpConfig(dump_path=str(tmp_path / "loop"), progress=False)), \
            torch.no_grad():
        ids = torch.randint(1, 100, (1, 6))
        for _ in range(3):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert "decode steps with a KV cache (0 of 2 calls): each new token recomputed the " \
           "whole sequence" in capsys.readouterr().err
    # a prompt, then the same prompt and one more token, both generated with a cache: nothing
    with register_hook(model, DumpConfig(dump_path=str(tmp_path / "b"), progress=False)), \
            torch.no_grad():
        prompt = torch.randint(1, 100, (1, 6))
        for ids in (prompt, torch.cat([prompt, torch.tensor([[5]])], dim=1)):
            model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert "decode steps with a KV cache" not in capsys.readouterr().err


def test_per_head_outputs_left_out_are_named(tmp_path):
    """A q_norm / k_norm (Qwen3, Gemma 3) normalises each head: its output is (batch, seq,
    heads, dim), not the round's token rows, and is left out at operator granularity. The
    compare's note names them instead of a count alone."""
    tf = pytest.importorskip("transformers")
    if not hasattr(tf, "Qwen3Config"):
        pytest.skip("Qwen3 needs transformers >= 4.51")
    from srdd_dump.compare.sources import capture_notes

    torch.manual_seed(0)
    model = tf.Qwen3ForCausalLM(tf.Qwen3Config(
        vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=64))
    with register_hook(model, DumpConfig(dump_path=str(tmp_path), granularity="op",
                                         probes="none", progress=False)) as session:
        with torch.no_grad():
            model(input_ids=torch.randint(0, 128, (1, 6)))
    with DumpReader(session.path) as r:
        status = r.status
    assert status["records_dropped"] == 4  # q_norm and k_norm of 2 layers
    assert status["records_dropped_sites"] == ["model.layers.N.self_attn.k_norm",
                                               "model.layers.N.self_attn.q_norm"]
    (note,) = [n for n in capture_notes("f.h5", status) if "left out" in n]
    assert note.endswith("were left out: model.layers.N.self_attn.k_norm, "
                         "model.layers.N.self_attn.q_norm")


def test_hooks_are_removed_when_done(tmp_path):
    model = build("gpt2")
    with register_hook(model, DumpConfig(dump_path=str(tmp_path), samples=1)) as s:
        with torch.no_grad():
            model(input_ids=torch.randint(0, 128, (1, 5)))
            assert any(b._forward_hooks for _, b in s.blocks)
            model(input_ids=torch.randint(0, 128, (1, 5)))  # second sample: capture is complete
        assert not any(b._forward_hooks or b._forward_pre_hooks for _, b in s.blocks)
    with DumpReader(s.path) as r:
        assert r.complete and len(r.rounds) == 1
        assert r.select(0, kind=schema.KIND_CLEAN).shape == (1,)


def test_a_second_session_on_a_captured_model_records_nothing_and_breaks_nothing(
        tmp_path, capsys):
    """Two register_hook sessions open on one model: the second is inert (one warning), the
    first captures as asked, and a session that closes itself inside a forward (its last
    sample done) leaves that forward running (torch still calls its removed hooks)."""
    model = build("llama")
    first = register_hook(model, DumpConfig(dump_path=str(tmp_path / "a"), samples=3,
                                            progress=False))
    second = register_hook(model, DumpConfig(dump_path=str(tmp_path / "b"), samples=1,
                                             progress=False))
    assert "already captured by another open session" in capsys.readouterr().err
    with torch.no_grad():
        for n in (6, 7, 8, 9):
            model.generate(torch.randint(1, 100, (1, n)), max_new_tokens=2, do_sample=False,
                           pad_token_id=0)
    second.close()
    assert second.path is None and not (tmp_path / "b").exists()
    with DumpReader(first.close()) as r:
        assert r.complete and r.n_samples == 3
    with register_hook(model, DumpConfig(dump_path=str(tmp_path / "c"), samples=1,
                                         progress=False)) as again:  # the model is free again
        with torch.no_grad():
            for n in (6, 7):  # the session closes itself in the second prefill's first block
                model.generate(torch.randint(1, 100, (1, n)), max_new_tokens=2,
                               do_sample=False, pad_token_id=0)
    with DumpReader(again.path) as r:
        assert r.complete and r.n_samples == 1


def test_register_hook_takes_a_pipelines_model_and_refuses_what_it_cannot_capture(tmp_path):
    from srdd_dump.errors import UserError

    class Pipeline:  # what transformers.pipeline(...) returns: the model as .model
        def __init__(self, model):
            self.model = model

    model = build("llama")
    with register_hook(Pipeline(model), DumpConfig(dump_path=str(tmp_path / "d"), samples=1,
                                                   progress=False)) as session:
        with torch.no_grad():
            model(input_ids=torch.randint(0, 128, (1, 5)))
    with DumpReader(session.path) as r:
        assert r.complete and r.n_samples == 1
    with pytest.raises(UserError, match="expected the model .* got a str"):
        register_hook("HuggingFaceTB/SmolLM2-135M", DumpConfig(dump_path=str(tmp_path)))
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(UserError, match="a file of that name exists"):
        register_hook(model, DumpConfig(dump_path=str(tmp_path / "a_file")))
    assert not any(b._forward_hooks for _, b in find_blocks(model))  # nothing left attached
    # a folder that cannot be made is refused at once, as msit does (it was found at the
    # first forward, in a warning the program ran on past)
    for folder in (tmp_path / "a_file" / "sub", tmp_path / ("x" * 300)):
        with pytest.raises(UserError, match=r"register_hook: dump_path .*: cannot create the "
                                            r"folder \((Not a directory|File name too long)\)"):
            register_hook(model, DumpConfig(dump_path=str(folder)))
    assert not any(b._forward_hooks for _, b in find_blocks(model))


def test_a_session_whose_model_never_ran_says_so(tmp_path, capfd):
    """In code, a session closed before its model ran (or while a second instance ran) ended
    without a word; the command line's run says "nothing captured". A generation without a
    KV cache never reaches the steps asked for: said as such."""
    model, other = build("llama"), build("llama")
    session = register_hook(model, DumpConfig(dump_path=str(tmp_path), progress=False))
    with torch.no_grad():
        other(input_ids=torch.randint(0, 128, (1, 5)))
    session.close()
    assert session.path is None
    assert "nothing captured: the model given to register_hook (LlamaForCausalLM) never ran a " \
        "forward while the session was open" in capfd.readouterr().err
    session = register_hook(model, DumpConfig(dump_path=str(tmp_path), steps="1-3",
                                              progress=False))
    with torch.no_grad():
        model.generate(torch.randint(1, 100, (1, 8)), max_new_tokens=3, do_sample=False,
                       use_cache=False, pad_token_id=0)
    session.close()
    assert "nothing captured: DumpConfig steps 1-3 selects no step of the forwards seen: each " \
        "new token recomputed the whole sequence (no KV cache" in capfd.readouterr().err


FORKED = """
import os, sys
sys.path.insert(0, {fixtures!r})
import torch
from tiny_models import build
from srdd_dump import DumpConfig, register_hook
model = build("llama")
session = register_hook(model, DumpConfig(dump_path={folder!r}, progress=False))
if os.fork() == 0:
    sys.exit(0)  # the child ends normally: its exit handlers see the parent's session
os.wait()
with torch.no_grad():
    model(input_ids=torch.randint(0, 128, (1, 5)))
session.close()
"""


def test_a_forked_child_says_nothing_of_its_parents_session(tmp_path):
    """A child forked before the model ran, ending normally, warned that the parent's model
    never ran."""
    import subprocess
    import sys

    from capture_utils import FIXTURES

    proc = subprocess.run([sys.executable, "-c", FORKED.format(
        fixtures=FIXTURES, folder=str(tmp_path / "d"))], capture_output=True, text=True,
        timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "nothing captured" not in proc.stderr and "srdd-dump: wrote" in proc.stderr


def test_a_dropped_model_and_session_are_freed_and_the_file_finished(tmp_path):
    """Nothing of srdd_dump holds an open session: dropping the model and the session frees
    the model's memory, and the file is finished then, not at exit."""
    import gc
    import weakref

    model = build("llama")
    session = register_hook(model, DumpConfig(dump_path=str(tmp_path), progress=False))
    with torch.no_grad():
        model.generate(torch.randint(1, 100, (1, 6)), max_new_tokens=2, do_sample=False,
                       pad_token_id=0)
    alive = weakref.ref(model)
    del model, session
    gc.collect()
    assert alive() is None
    (done,) = tmp_path.iterdir()  # finished: no .partial file left
    assert done.suffix == ".h5"
    with DumpReader(str(done)) as r:
        assert r.complete and r.n_samples == 1


DROPPED_IN_A_THREAD = """
import gc, os, sys, threading
sys.path.insert(0, {fixtures!r})
import torch
from tiny_models import build
from srdd_dump import DumpConfig, register_hook

def run():
    model = build("llama")
    session = register_hook(model, DumpConfig(dump_path={folder!r}, progress=False))
    with torch.no_grad():
        model(input_ids=torch.randint(1, 100, (1, 6)))
    del model, session
    gc.collect()

t = threading.Thread(target=run)
t.start()
t.join()
print(sorted(os.listdir({folder!r})))
"""


def test_a_session_dropped_in_another_thread_is_finished_at_exit(tmp_path):
    """A collection outside the main thread (possibly the writer's own) never closes the
    session there: it waits for the exit, which finishes the file."""
    import subprocess
    import sys

    from capture_utils import FIXTURES

    folder = str(tmp_path / "d")
    proc = subprocess.run([sys.executable, "-c", DROPPED_IN_A_THREAD.format(
        fixtures=FIXTURES, folder=folder)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (before_exit,) = eval(proc.stdout)  # noqa: S307 (the list the script printed)
    assert before_exit.endswith(".partial")
    (done,) = os.listdir(folder)
    assert done.endswith(".h5") and "srdd-dump: wrote" in proc.stderr
    with DumpReader(os.path.join(folder, done)) as r:
        assert r.complete and r.n_samples == 1


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_replays_add_nothing_to_the_outputs_the_model_collects(arch, tmp_path):
    """transformers records hidden states, attentions and router logits with forward hooks:
    the probe replays inside the call must not lengthen those tuples or change aux_loss."""
    if arch == "mixtral":
        from moe_models import build as build_moe

        model = build_moe("mixtral")
    else:
        model = build(arch)
    model.config._attn_implementation = "eager"  # attentions are returned by eager only
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(5))
    asked = dict(output_hidden_states=True, output_attentions=True)
    if arch == "mixtral":
        asked["output_router_logits"] = True

    def run():
        with torch.no_grad():
            return model(input_ids=ids, **asked)

    plain = run()
    with register_hook(model, DumpConfig(dump_path=str(tmp_path), samples=1)) as session:
        captured = run()
    with DumpReader(session.path) as r:
        assert len(r.select(kind=schema.KIND_GAIN, layer=None, site=None)) > 0  # replays ran
    for key in ("hidden_states", "attentions", "router_logits"):
        if getattr(plain, key, None) is None:
            continue
        assert len(getattr(captured, key)) == len(getattr(plain, key)), key
        for a, b in zip(getattr(plain, key), getattr(captured, key)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    if getattr(plain, "aux_loss", None) is not None:
        assert float(captured.aux_loss) == float(plain.aux_loss)


def test_a_copy_of_the_model_runs_uncaptured_and_unchanged_and_is_said(tmp_path, capsys):
    """copy.deepcopy of a hooked model copies the hook tables too: the copy's forwards were
    recorded in this dump as the model's own samples (a copy altered on purpose, a quantised
    twin say, mixed into the evidence)."""
    import copy

    model = build("llama")
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(5))
    config = DumpConfig(dump_path=str(tmp_path), progress=False)
    with register_hook(model, config) as session, torch.no_grad():
        model(input_ids=ids)
        twin = copy.deepcopy(model)
        twin.model.layers[1].mlp.down_proj.weight.mul_(1.5)
        got = twin(input_ids=ids).logits
        twin(input_ids=ids)
        model(input_ids=ids)
        # a replica sharing the model's hook tables (DataParallel makes one per device) runs
        # as the model
        model._replicate_for_data_parallel()(input_ids=ids)
    assert session.error is None
    assert capsys.readouterr().err.count("a copy of the captured model ran (") == 1
    with torch.no_grad():  # the copy's own result: its hooks gone, as a copy made uncaptured
        assert torch.equal(got, twin(input_ids=ids).logits)
    assert not any(t for m in twin.modules() for t in (m._forward_hooks, m._forward_pre_hooks))
    with DumpReader(session.path) as r:
        assert r.complete and r.n_samples == 3  # the model's forwards, not the copy's


def test_a_forward_that_raises_in_the_blocks_is_no_sample(tmp_path, capsys):
    """A harness that catches a malformed sample and goes on (found by a user trial): the call
    that raised inside the blocks took sample 0 and the prefill's probes, so no prompt's
    prefill was probed. It now counts as no sample: the next prompt is sample 0, probed."""
    model = build("llama")
    cfg = DumpConfig(dump_path=str(tmp_path), samples=2, steps="0,1", progress=False)
    prompts = [torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n))
               for n in (6, 5)]
    with register_hook(model, cfg) as session:
        with torch.no_grad():
            with pytest.raises(RuntimeError):  # a 4-D mask of the wrong size
                model(input_ids=prompts[0], attention_mask=torch.ones(1, 3, 3, 3))
            for ids in prompts:
                model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert "a forward of the model raised (RuntimeError" in capsys.readouterr().err
    with DumpReader(session.path) as r:
        got = [(int(x["sample"]), int(x["step"]), int(x["seq"])) for x in r.rounds]
        assert got == [(0, 0, 6), (0, 1, 1), (1, 0, 5), (1, 1, 1)]
        probed = {(int(r.rounds[int(x["round"])]["sample"]),
                   int(r.rounds[int(x["round"])]["step"]))
                  for x in r.records if x["kind"] != schema.KIND_CLEAN}
        assert (0, 0) in probed and (0, 1) in probed
        assert r.status["samples"] == 2 and r.status["failed_calls"] == 1


def test_a_relative_dump_path_is_the_folder_register_hook_made(tmp_path, monkeypatch):
    """A harness that changes folder after register_hook (Hydra's os.chdir): the file went to
    the relative path under the new folder, the folder register_hook made stayed empty and
    session.path no longer resolved (found by a user trial)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    model = build("llama")
    session = register_hook(model, DumpConfig(dump_path="d_rel", samples=1, progress=False))
    os.chdir(tmp_path / "sub")
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 5)))
    session.close()
    assert os.path.isabs(session.path) and os.path.exists(session.path)
    assert os.path.dirname(session.path) == str(tmp_path / "d_rel")
    assert not (tmp_path / "sub" / "d_rel").exists()


def test_a_forward_that_raises_after_its_last_block_keeps_its_sample(tmp_path):
    """The call raised after its round was written (in the model's head): that round stays a
    sample, and the next forward is the next sample (never a second sample 0). A decode step
    that raises is no step: nothing of it is kept."""
    model = build("llama")
    calls = {"n": 0}

    def head_fails_once(module, args, output):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("out of memory in the head")

    handle = model.lm_head.register_forward_hook(head_fails_once)
    cfg = DumpConfig(dump_path=str(tmp_path), samples=3, steps="0-3", progress=False)
    prompts = [torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n))
               for n in (6, 5, 7)]

    def second_block_fails_in_a_decode_step(module, args):
        if args[0].shape[1] == 1 and calls["n"] < 10:
            calls["n"] = 10
            raise RuntimeError("a decode kernel failed")

    with register_hook(model, cfg) as session, torch.no_grad():
        with pytest.raises(RuntimeError):
            model(input_ids=prompts[0])
        handle.remove()
        model.generate(prompts[1], max_new_tokens=2, do_sample=False, pad_token_id=0)
        handle = model.model.layers[1].register_forward_pre_hook(
            second_block_fails_in_a_decode_step)
        with pytest.raises(RuntimeError):  # its step 1 raises: generate stops
            model.generate(prompts[2], max_new_tokens=3, do_sample=False, pad_token_id=0)
        handle.remove()
    with DumpReader(session.path) as r:
        got = [(int(x["sample"]), int(x["step"]), int(x["seq"])) for x in r.rounds]
        assert got == [(0, 0, 6), (1, 0, 5), (1, 1, 1), (2, 0, 7)]
        assert r.status["failed_calls"] == 1
