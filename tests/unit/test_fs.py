"""atomic_dir / replace_dir: a folder appears whole or not at all."""

import os

import pytest

from modelops.fs import atomic_dir, replace_dir


def test_a_completed_block_replaces_the_old_folder_and_leaves_nothing_beside_it(tmp_path):
    dest = tmp_path / "v1"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    with atomic_dir(dest) as staging:
        assert staging.parent == tmp_path and staging.name.startswith(".staging-v1-")
        assert not any(staging.iterdir())
        (staging / "new.txt").write_text("new")
        assert (dest / "old.txt").read_text() == "old"  # readers still see the old copy
    assert sorted(p.name for p in dest.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]


def test_a_failed_block_leaves_the_old_folder_as_it_was(tmp_path):
    dest = tmp_path / "v1"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    with pytest.raises(RuntimeError, match="half way"):
        with atomic_dir(dest, prefix=".build-") as staging:
            (staging / "half.txt").write_text("x")
            raise RuntimeError("half way")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]
    assert (dest / "old.txt").read_text() == "old"


def test_a_failed_block_creates_no_folder_where_there_was_none(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with atomic_dir(tmp_path / "sub" / "v1"):
            raise KeyboardInterrupt
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == []


def test_replace_dir_moves_a_stale_copy_aside_and_removes_it(tmp_path):
    staging, dest = tmp_path / ".staging-v1", tmp_path / "v1"
    staging.mkdir()
    (staging / "a").write_text("complete")
    dest.mkdir()
    (dest / "b").write_text("stale")
    # a leftover from a crashed earlier replace of the same name does not block this one
    (tmp_path / f".old-v1-{os.getpid()}").mkdir()
    replace_dir(staging, dest)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]
    assert [p.name for p in dest.iterdir()] == ["a"] and (dest / "a").read_text() == "complete"
