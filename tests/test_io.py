"""io.py and faults.py: atomic writes, stale temporary files, torn-line recovery, folder locks, crash hooks."""

from __future__ import annotations

import json
import os
import signal

import pytest

from dllm_align.core import faults
from dllm_align.core.errors import UserError
from dllm_align.core.io import (
    DirLock,
    JsonlAppender,
    _host_tag,
    atomic_path,
    atomic_write_text,
    recover_jsonl,
    remove_stale_temps,
)


def _lines(*rows) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


# --------------------------------------------------------------------------- recover_jsonl
def test_a_torn_last_line_is_cut(tmp_path):
    p = tmp_path / "log.jsonl"
    p.write_bytes(_lines({"i": 1}, {"i": 2}) + b'{"i": 3, "text": "hal')
    assert recover_jsonl(p) == [{"i": 1}, {"i": 2}]
    assert p.read_bytes() == _lines({"i": 1}, {"i": 2})  # cut on disk, so the next append starts a clean line


def test_a_complete_but_unterminated_last_line_is_cut_too(tmp_path):
    # The writer died before the newline: the record is redone, never half-trusted.
    p = tmp_path / "log.jsonl"
    p.write_bytes(_lines({"i": 1}) + b'{"i": 2}')
    assert recover_jsonl(p) == [{"i": 1}]


def test_zero_bytes_at_the_end_are_a_torn_tail(tmp_path):
    # What a power cut can leave after the last good line.
    p = tmp_path / "log.jsonl"
    p.write_bytes(_lines({"i": 1}) + b"\x00" * 40 + b"\n" + b"\x00" * 10)
    assert recover_jsonl(p) == [{"i": 1}]
    assert p.read_bytes() == _lines({"i": 1})


def test_a_damaged_line_before_good_lines_is_refused_not_cut(tmp_path):
    p = tmp_path / "log.jsonl"
    content = _lines({"i": 1}) + b"garbage\n" + _lines({"i": 3})
    p.write_bytes(content)
    with pytest.raises(UserError, match=r"log\.jsonl:2: damaged line in the middle"):
        recover_jsonl(p)
    assert p.read_bytes() == content  # nothing was cut away
    p.write_bytes(_lines({"i": 1}) + b"[1, 2]\n" + _lines({"i": 3}))  # valid JSON but not a record
    with pytest.raises(UserError, match=r":2: damaged line"):
        recover_jsonl(p)


def test_blank_lines_and_a_missing_file(tmp_path):
    p = tmp_path / "log.jsonl"
    assert recover_jsonl(p) == []
    p.write_bytes(_lines({"i": 1}) + b"\n  \n" + _lines({"i": 2}))
    assert recover_jsonl(p) == [{"i": 1}, {"i": 2}]


# --------------------------------------------------------------------------- atomic writes, stale temporaries
def test_atomic_write_replaces_or_leaves_the_old_file(tmp_path):
    p = tmp_path / "out.json"
    atomic_write_text(p, "old")
    with pytest.raises(RuntimeError):
        with atomic_path(p) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert p.read_text() == "old" and sorted(x.name for x in tmp_path.iterdir()) == ["out.json"]
    atomic_write_text(p, "new")
    assert p.read_text() == "new" and oct(p.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_stale_temporaries_of_dead_writers_are_removed(tmp_path):
    target = tmp_path / "shard.safetensors"
    dead = tmp_path / f".shard.safetensors.{_host_tag()}-{_dead_pid()}.x1.tmp"
    alive = tmp_path / f".shard.safetensors.{_host_tag()}-{os.getpid()}.x2.tmp"  # a live writer of this run
    other_host = tmp_path / f".shard.safetensors.00000000-{_dead_pid()}.x3.tmp"  # shared filesystem: not ours to judge
    other_file = tmp_path / f".shard.safetensors.idx.{_host_tag()}-{_dead_pid()}.x4.tmp"  # another target's temp
    for p in (dead, alive, other_host, other_file):
        p.write_text("partial")
    assert remove_stale_temps(target) == [dead]
    atomic_write_text(target, "done")  # every atomic write cleans up after killed writers of the same file
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, alive.name, other_host.name, other_file.name])


# --------------------------------------------------------------------------- DirLock
def test_dir_lock_refuses_a_second_writer_and_leaves_no_file(tmp_path):
    with DirLock(tmp_path, "busy: another run"):
        with pytest.raises(UserError, match="busy: another run"):
            with DirLock(tmp_path, "busy: another run"):
                pass
    assert list(tmp_path.iterdir()) == []
    with DirLock(tmp_path, "x"):  # released: free again
        pass


def test_dir_lock_holds_across_processes(tmp_path):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            with DirLock(tmp_path, "busy"):
                os.write(w, b"locked")
                signal.pause()  # hold the lock until killed
        finally:
            os._exit(1)
    os.close(w)
    assert os.read(r, 6) == b"locked"
    try:
        with pytest.raises(UserError, match="busy"):
            DirLock(tmp_path, "busy").__enter__()
    finally:
        os.kill(pid, signal.SIGKILL)  # a killed holder releases the lock with its file descriptor
        os.waitpid(pid, 0)
    with DirLock(tmp_path, "busy"):
        pass


# --------------------------------------------------------------------------- fault hooks
def test_fault_hooks_parse_and_count(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    assert faults.next_record() == 0 and not faults.armed("kill_after_records", 1)
    monkeypatch.setenv(faults.ENV, "kill_after_records:3, kill_in_final")
    assert faults.armed("kill_after_records", 3) and faults.armed("kill_in_final") and not faults.armed("kill_after_records", 2)
    faults._count.update(pid=-1, n=0)
    assert [faults.next_record() for _ in range(3)] == [1, 2, 3]


def test_a_kill_mid_record_tears_exactly_one_line(tmp_path):
    log = tmp_path / "log.jsonl"
    pid = os.fork()
    if pid == 0:
        try:
            os.environ[faults.ENV] = "kill_mid_record:3"
            with JsonlAppender(log) as app:
                for i in range(5):
                    app.write({"i": i, "text": "x" * 50})
        finally:
            os._exit(0)  # not reached: the hook kills first
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    data = log.read_bytes()
    assert data.count(b"\n") == 2 and not data.endswith(b"\n")
    assert recover_jsonl(log) == [{"i": 0, "text": "x" * 50}, {"i": 1, "text": "x" * 50}]
    with JsonlAppender(log) as app:  # appending after recovery gives clean lines
        app.write({"i": 2})
    assert [r["i"] for r in recover_jsonl(log)] == [0, 1, 2]
