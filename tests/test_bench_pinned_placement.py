"""bench/pinned_placement.py: the page-layout probes it reports per slot, and its argument errors."""
from __future__ import annotations

import ctypes
import mmap
import os

import pytest

from bench.pinned_placement import main, numa_nodes, pagemap_stats


def test_layout_of_a_tmpfs_mapping() -> None:
    nbytes = 8 << 20
    fd = os.memfd_create("sdcw-place-test")
    try:
        os.posix_fallocate(fd, 0, nbytes)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        st = pagemap_stats(addr, nbytes)
        if os.geteuid() == 0:   # frame numbers are shown to root only; the suite runs as root in CI
            assert 1 <= st["runs"] <= nbytes // mmap.PAGESIZE
            assert 0.0 <= st["huge_share"] <= 1.0
            assert st["phys_lo_gib"] <= st["phys_hi_gib"]
            # a second mapping of the same file is the same frames: the same layout, read independently
            mm2 = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            assert pagemap_stats(ctypes.addressof(ctypes.c_char.from_buffer(mm2)), nbytes) == st
            # one page is one run and holds no 2 MiB chunk; its frame lies within the whole file's range
            one = pagemap_stats(addr + mmap.PAGESIZE, mmap.PAGESIZE)
            assert one["runs"] == 1 and one["huge_share"] == 0.0
            assert st["phys_lo_gib"] <= one["phys_lo_gib"] == one["phys_hi_gib"] <= st["phys_hi_gib"]
        else:
            assert st == {}
        assert numa_nodes("/memfd:sdcw-place-test").startswith("N0=")
        assert numa_nodes("/no/such/mapping") == ""
    finally:
        os.close(fd)


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--anon", "huge,tiny"])
    assert e.value.code == 2
    assert "--anon" in capsys.readouterr().err


def test_host_load_streams_and_stops() -> None:
    import threading
    import time

    from bench.pinned_placement import HostLoad

    before = set(threading.enumerate())
    with HostLoad(2) as load:
        started = set(threading.enumerate()) - before
        time.sleep(0.3)
    assert load.gbps > 0.0                      # bytes were streamed meanwhile
    assert len(started) == 2, started           # its threads (not the process's count: an earlier test's
    # threads may still be ending beside it, which failed a loaded run when the suite's order changed)
    assert not (set(threading.enumerate()) - before)   # and every thread it started has ended
    assert not any(t.is_alive() for t in started)


def test_copy_streams_refuses_bad_arguments_and_needs_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    """bench/copy_streams.py: a bad count is exit 2 with a message; without CUDA it says so, exit 2."""
    import torch

    from bench.copy_streams import main

    with pytest.raises(SystemExit) as e:
        main(["--streams", "0"])
    assert e.value.code == 2 and "--streams" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["--streams", "1"]) == 2
        assert "needs CUDA" in capsys.readouterr().err
