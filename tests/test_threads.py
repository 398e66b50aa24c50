"""A model run from several threads: one thread's forwards at a time are captured, a thread
that takes its turn at a new sequence (a server's pool) is captured from its prefill on, and
forwards run at once in other threads run uncaptured, said in the coverage; the program's own
outputs never change."""

from __future__ import annotations

import glob
import threading

import pytest
import torch

from srdd_dump import DumpConfig, register_hook
from srdd_dump.format.reader import DumpReader

from tiny_models import build

pytestmark = [pytest.mark.integration, pytest.mark.capture]


def _prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, 120, (1, n), generator=g) for n in (9, 12, 7)]


def _generate(model, ids) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    return out[0].tolist()


def _file(folder) -> str:
    (path,) = glob.glob(f"{folder}/**/*.h5", recursive=True)
    return path


def test_threads_taking_turns_are_each_captured(tmp_path):
    model = build("llama", layers=2)
    prompts = _prompts()
    plain = [_generate(model, ids) for ids in prompts]
    got: dict[int, list[int]] = {}
    with register_hook(model, DumpConfig(dump_path=str(tmp_path), samples=3, progress=False)):
        for i, ids in enumerate(prompts):  # one thread per request, one after another
            t = threading.Thread(target=lambda i=i, ids=ids: got.update({i: _generate(model,
                                                                                      ids)}))
            t.start()
            t.join()
    assert [got[i] for i in range(3)] == plain
    with DumpReader(_file(tmp_path)) as rd:
        assert rd.n_samples == 3
        assert "forwards of other threads" not in rd.status.get("coverage", {})


def test_threads_running_at_once_leave_the_program_unchanged_and_a_readable_dump(tmp_path):
    from dumpfactory import compare_written as compare_path

    model = build("llama", layers=2)
    prompts = _prompts()
    plain = [_generate(model, ids) for ids in prompts]
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(3)

    def work(i: int) -> None:
        try:
            start.wait()
            for _ in range(3):
                got[i] = _generate(model, prompts[i])
        except BaseException as exc:  # noqa: BLE001 (the assertion below shows it)
            errors.append(exc)

    with register_hook(model, DumpConfig(dump_path=str(tmp_path), samples=8,
                                         probe_samples=2, progress=False)):
        threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors and [got[i] for i in range(3)] == plain
    result = compare_path(str(tmp_path))
    assert result.files["status"].iloc[0] != "skipped"
    assert "FAULT" not in set(result.layers["verdict"]), result.layers.head()


def test_a_chat_turn_continued_in_a_new_thread_after_the_first_ended_is_captured(tmp_path):
    """Turn 1 in one thread, turn 2 (given turn 1's cache) in the next, one after the other:
    the first thread has ended, so the second's continuation is captured as in one thread."""
    def turns(model, folder):
        state = {}

        def first():
            with torch.no_grad():
                state["out"] = model.generate(torch.randint(1, 100, (1, 6), generator=g),
                                              max_new_tokens=3, do_sample=False,
                                              pad_token_id=0, return_dict_in_generate=True)

        def second():
            turn = torch.cat([state["out"].sequences, torch.randint(1, 100, (1, 4),
                                                                    generator=g)], dim=1)
            with torch.no_grad():
                model.generate(turn, past_key_values=state["out"].past_key_values,
                               max_new_tokens=3, do_sample=False, pad_token_id=0)

        with register_hook(model, DumpConfig(dump_path=str(folder), samples=4,
                                             progress=False)):
            for work in (first, second):
                t = threading.Thread(target=work)
                t.start()
                t.join()
        with DumpReader(_file(folder)) as rd:
            return len(rd.rounds), rd.status.get("coverage", {})

    g = torch.Generator().manual_seed(0)
    threaded, coverage = turns(build("llama", layers=2), tmp_path / "threads")
    assert "forwards of other threads" not in coverage
    g = torch.Generator().manual_seed(0)
    model = build("llama", layers=2)
    with register_hook(model, DumpConfig(dump_path=str(tmp_path / "one"), samples=4,
                                         progress=False)), torch.no_grad():
        out = model.generate(torch.randint(1, 100, (1, 6), generator=g), max_new_tokens=3,
                             do_sample=False, pad_token_id=0, return_dict_in_generate=True)
        turn = torch.cat([out.sequences, torch.randint(1, 100, (1, 4), generator=g)], dim=1)
        model.generate(turn, past_key_values=out.past_key_values, max_new_tokens=3,
                       do_sample=False, pad_token_id=0)
    with DumpReader(_file(tmp_path / "one")) as rd:
        assert threaded == len(rd.rounds) >= 4
