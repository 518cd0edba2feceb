"""``kvpipe bench`` writes its records and plots where it is told, and by default not into the working folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpipe.connector.bench import BenchOptions
from kvpipe.connector.cli.main import main


def test_by_default_records_go_to_the_users_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert BenchOptions().out_dir == tmp_path / "cache" / "kvpipe" / "bench"


def test_a_bench_run_leaves_the_working_folder_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert main(["bench", "framework", "--quick", "--repeats", "1"]) == 0
    assert list(work.iterdir()) == []
    out = tmp_path / "cache" / "kvpipe" / "bench"
    assert (out / "framework.json").is_file()
    assert f"records and plots in {out}" in capsys.readouterr().err
