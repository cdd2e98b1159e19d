"""without_modules: a package is unimportable inside the block only, and one already imported is
left alone."""

import sys

import pytest

from rlvr.training.lean_import import without_modules


@pytest.fixture
def probe_module(tmp_path, monkeypatch):
    """A module nothing has imported yet, on sys.path."""
    (tmp_path / "rlvr_probe_module.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "rlvr_probe_module"
    sys.modules.pop("rlvr_probe_module", None)


def test_a_hidden_module_fails_to_import_inside_and_imports_after(probe_module):
    with without_modules(probe_module), pytest.raises(ImportError):
        __import__(probe_module)
    assert probe_module not in sys.modules
    assert __import__(probe_module).VALUE == 7


def test_an_imported_module_stays_importable(probe_module):
    module = __import__(probe_module)
    with without_modules(probe_module):
        assert __import__(probe_module) is module
    assert sys.modules[probe_module] is module


def test_the_block_is_undone_when_it_raises(probe_module):
    with pytest.raises(RuntimeError), without_modules(probe_module):
        raise RuntimeError
    assert __import__(probe_module).VALUE == 7
