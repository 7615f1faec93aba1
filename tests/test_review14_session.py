"""Review 14 (hostile tester): defects found in this session's changes, each a failing test before its fix."""

from __future__ import annotations

import os

import pytest

from pdserve.engine import envs
from pdserve.engine.compile import use_cache_dir
from pdserve.engine.config import ConfigError


def test_unwritable_compile_cache_dir_names_the_knobs(tmp_path, monkeypatch):
    """PDSERVE_CACHE_DIR under a file: compiling (on by default) failed the node's start with inductor's bare
    NotADirectoryError, naming neither the variable nor --enforce-eager; eager starts fine there."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "x")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")            # unset for the call, restored after it
    monkeypatch.setattr(envs, "PDSERVE_CACHE_DIR", blocker / "cache")
    with pytest.raises(ConfigError, match=r"PDSERVE_CACHE_DIR.*--enforce-eager"):
        use_cache_dir()


def test_writable_compile_cache_dir_is_created(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "x")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setattr(envs, "PDSERVE_CACHE_DIR", tmp_path / "fresh")
    assert use_cache_dir() == str(tmp_path / "fresh" / "inductor")
    assert os.path.isdir(tmp_path / "fresh" / "inductor")
    assert os.listdir(tmp_path / "fresh" / "inductor") == []      # the probe file is gone
