"""distllm.files: the atomic writer reads the umask without setting it (``os.umask`` sets it
to 0 for every thread of the process while it reads), and closes its file on any failure."""

from __future__ import annotations

import os

import pytest

from distllm import files


def test_the_umask_is_read_without_being_set(tmp_path, monkeypatch):
    mask = os.umask(0o027)
    try:
        def never(_mask):
            raise AssertionError("os.umask called: the process's umask changed for a moment")

        monkeypatch.setattr(os, "umask", never)
        assert files.umask() == 0o027
        path = files.write_text_atomic(tmp_path / "a.json", "{}")
        assert path.read_text() == "{}" and path.stat().st_mode & 0o777 == 0o640
    finally:
        monkeypatch.undo()
        os.umask(mask)


def test_a_write_that_fails_closes_and_removes_its_file(tmp_path, monkeypatch):
    before = set(os.listdir("/proc/self/fd"))

    def refused(fd, mode):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "fchmod", refused)
    with pytest.raises(PermissionError):
        files.write_text_atomic(tmp_path / "a.json", "{}")
    assert list(tmp_path.iterdir()) == []
    assert set(os.listdir("/proc/self/fd")) <= before | {str(fd) for fd in range(3)}
