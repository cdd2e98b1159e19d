"""Durable whole-file writes: the new content replaces the old and no temp file is left behind."""

from rlvr.files import atomic_write_text


def test_atomic_write_text_replaces_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "state.json"
    atomic_write_text(path, "old")
    atomic_write_text(path, "new")
    assert path.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
