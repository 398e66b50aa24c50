"""The import watcher of ``srdd-dump --exec`` on a stand-in package (torch is already imported
here): probes do not use it up, it tells once, after the module has run, whatever the loader,
and it leaves the module as the import system made it."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

import pytest

from srdd_dump.capture.inject import ImportWatcher

pytestmark = pytest.mark.capture


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """A package ``srdd_stand_in_torch`` on sys.path; yields (name, folder, calls, watcher)."""
    name = "srdd_stand_in_torch"
    package = tmp_path / name
    package.mkdir()
    (package / "__init__.py").write_text("LOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    calls: list[bool] = []
    watcher = ImportWatcher(name, lambda: calls.append(name in sys.modules))
    sys.meta_path.insert(0, watcher)
    yield name, package, calls, watcher
    if watcher in sys.meta_path:
        sys.meta_path.remove(watcher)
    for key in [k for k in sys.modules if k.split(".")[0] == name]:
        del sys.modules[key]


def test_probes_do_not_use_it_up_and_it_tells_once(stand_in):
    name, _, calls, watcher = stand_in
    for _ in range(3):  # transformers' and vLLM's find_spec probes
        assert importlib.util.find_spec(name) is not None
    assert calls == [] and watcher in sys.meta_path
    module = importlib.import_module(name)
    assert module.LOADED and calls == [True]  # after the module ran
    assert watcher not in sys.meta_path
    assert isinstance(module.__loader__, importlib.machinery.SourceFileLoader)
    assert module.__spec__.loader is module.__loader__
    importlib.reload(module)
    assert calls == [True]


def test_a_failed_import_is_not_told_and_a_later_one_is(stand_in):
    name, package, calls, watcher = stand_in
    (package / "__init__.py").write_text("raise ImportError('not yet')\n")
    with pytest.raises(ImportError, match="not yet"):
        importlib.import_module(name)
    assert calls == [] and watcher in sys.meta_path
    (package / "__init__.py").write_text("LOADED = True\n")
    importlib.invalidate_caches()
    sys.modules.pop(name, None)
    importlib.import_module(name)
    assert calls == [True]


class _SharedLoader(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A finder that is its own loader for every module it finds (pytest's assertion rewriter,
    typeguard and beartype import hooks are made this way)."""

    def __init__(self, names):
        self.names, self.executed = names, []

    def find_spec(self, name, path=None, target=None):
        if name not in self.names:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        self.executed.append(module.__name__)
        module.LOADED = True


def test_a_loader_shared_by_other_modules_is_left_alone(stand_in):
    name, _, calls, watcher = stand_in
    shared = _SharedLoader({name, "srdd_stand_in_other"})
    sys.meta_path.insert(sys.meta_path.index(watcher) + 1, shared)
    try:
        for _ in range(2):
            importlib.util.find_spec(name)
        importlib.import_module(name)
        importlib.import_module("srdd_stand_in_other")
    finally:
        sys.meta_path.remove(shared)
        sys.modules.pop("srdd_stand_in_other", None)
    assert shared.executed == [name, "srdd_stand_in_other"]
    assert calls == [True]  # once, and not for the other module
    assert sys.modules[name].__loader__ is shared
    assert "exec_module" not in vars(shared)  # never patched


def test_install_twice_watches_once(monkeypatch):
    from srdd_dump.capture import inject
    from srdd_dump.capture.config import ENV_CONFIG, DumpConfig

    pytest.importorskip("torch")  # imported: install attaches at once, no watcher is left
    monkeypatch.setenv(ENV_CONFIG, DumpConfig(dump_path="unused").to_json())
    monkeypatch.setattr(inject, "_state", {**inject._state, "config": None})
    started = []
    monkeypatch.setattr(inject, "_on_torch_imported", lambda: started.append(1))
    monkeypatch.setattr(inject.atexit, "register", lambda fn: None)
    monkeypatch.setattr(inject.os, "register_at_fork", lambda **kw: None)
    watchers = [f for f in sys.meta_path if isinstance(f, ImportWatcher)]
    inject.install()
    inject.install()
    assert started == [1]  # attached at once, and only once
    assert [f for f in sys.meta_path if isinstance(f, ImportWatcher)] == watchers
