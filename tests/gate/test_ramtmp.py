"""The gate keeps its steps' temporary files on a tmpfs with room, in a
directory of its own that goes with the run; elsewhere it leaves TMPDIR."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_overlay.gate import ramtmp


def _mounts(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "mounts"
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


def test_only_tmpfs_mount_points_count(tmp_path: Path) -> None:
    mounts = _mounts(
        tmp_path,
        "/dev/vda / ext4 rw,relatime,discard 0 0",
        "tmpfs /dev/shm tmpfs rw,relatime,size=24683784k 0 0",
        "tmpfs /run/a\\040b tmpfs rw 0 0",
        "garbage",
    )
    assert ramtmp.tmpfs_mounts(mounts) == {Path("/dev/shm"), Path("/run/a b")}
    assert ramtmp.tmpfs_mounts(tmp_path / "missing") == set()


def test_the_first_tmpfs_with_room_is_chosen(tmp_path: Path) -> None:
    disk, ram = tmp_path / "disk", tmp_path / "ram"
    disk.mkdir()
    ram.mkdir()
    mounts = _mounts(tmp_path, f"tmpfs {ram} tmpfs rw 0 0")
    where, why = ramtmp.ram_dir([disk, ram], mounts, min_free=1)
    assert where == ram and why.startswith("tmpfs, ")
    where, why = ramtmp.ram_dir([disk], mounts, min_free=1)
    assert where is None and why == f"no tmpfs with 0 GiB free at {disk}"
    too_much = ramtmp.free_bytes(ram) + 1
    assert ramtmp.ram_dir([ram], mounts, min_free=too_much)[0] is None


def test_the_runs_directory_goes_with_it_whatever_happens(tmp_path: Path) -> None:
    ram = tmp_path / "ram"
    ram.mkdir()
    mounts = _mounts(tmp_path, f"tmpfs {ram} tmpfs rw 0 0")
    with pytest.raises(RuntimeError), ramtmp.run_tmpdir({}, [ram], mounts, 1) as (d, _):
        assert d is not None and d.parent == ram and d.name.startswith(ramtmp.PREFIX)
        (d / "left").write_text("x")
        raise RuntimeError("a step failed")
    assert list(ram.iterdir()) == []
    with ramtmp.run_tmpdir({}, [tmp_path / "nowhere"], mounts, 1) as (none, why):
        assert none is None and why.startswith("no tmpfs")


def test_a_tmpdir_the_caller_set_is_kept(tmp_path: Path) -> None:
    ram = tmp_path / "ram"
    ram.mkdir()
    mounts = _mounts(tmp_path, f"tmpfs {ram} tmpfs rw 0 0")
    chosen = {"TMPDIR": str(tmp_path / "scratch")}
    with ramtmp.run_tmpdir(chosen, [ram], mounts, 1) as (none, why):
        assert none is None and why == "$TMPDIR set by the caller"
    assert list(ram.iterdir()) == []
