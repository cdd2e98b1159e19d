"""The `rlvr` command's own decisions, without training: where a demo writes."""

from __future__ import annotations

from rlvr.config import load_config
from workflows import cli


def test_fresh_run_name_skips_taken_names(tmp_path):
    assert cli.fresh_run_name(tmp_path, "demo") == "demo"
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo-2").mkdir()
    assert cli.fresh_run_name(tmp_path, "demo") == "demo-3"


def test_demo_keeps_an_earlier_run(tmp_path, capsys):
    cfg = load_config(None, [f"run.output_dir={tmp_path}", "run.name=demo"])
    assert cli.demo_run_path(cfg, overwrite=False) == tmp_path / "demo"
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "metrics.jsonl").write_text("{}\n")
    path = cli.demo_run_path(cfg, overwrite=False)
    assert path == tmp_path / "demo-2" and cfg.run.name == "demo-2"
    assert (tmp_path / "demo" / "metrics.jsonl").read_text() == "{}\n"
    assert "runs as demo-2" in capsys.readouterr().err


def test_demo_overwrite_deletes_and_says_so(tmp_path, capsys):
    (tmp_path / "demo").mkdir()
    cfg = load_config(None, [f"run.output_dir={tmp_path}", "run.name=demo"])
    assert cli.demo_run_path(cfg, overwrite=True) == tmp_path / "demo"
    assert not (tmp_path / "demo").exists() and cfg.run.name == "demo"
    assert f"deleting the earlier run {tmp_path / 'demo'}" in capsys.readouterr().err


def test_demo_overwrite_flag():
    parser = cli.build_parser()
    assert parser.parse_args(["demo", "--overwrite"]).overwrite
    assert not parser.parse_args(["demo"]).overwrite
