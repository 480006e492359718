"""Find an NVML call that corrupts the heap: each call group of the real backend runs 300 times in its own
process under glibc's MALLOC_CHECK_=3 (corruption aborts at once), and the XID wait runs with polling.
  python bench/nvml_diag.py            -> one line per group: ok / CRASH (signal)
"""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def one(group: str, reps: int = 300) -> None:
    from probes.nvml_backend import PynvmlBackend
    from probes.nvml_fields import FIELD_VALUES_CALL, field_specs

    b = PynvmlBackend()
    links = b.nvlink_count(0) if hasattr(b, "nvlink_count") else 18
    specs = field_specs(links)
    names = [n for n, s in specs.items() if (s.call if s.call != FIELD_VALUES_CALL else "fv") == group
             or group == "all"]
    if group == "concurrent":  # the agent's pattern: XID wait on one thread, polls on another
        import threading

        b.xid_open()
        stop = threading.Event()

        def waiter() -> None:
            while not stop.is_set():
                b.xid_wait(50)

        t = threading.Thread(target=waiter)
        t.start()
        names = list(specs)
        for _ in range(100):
            for i in range(b.device_count()):
                b.read_fields(i, names)
        stop.set()
        t.join()
        b.close()
        return
    if group == "xid":
        b.xid_open()
        for _ in range(reps // 10):
            b.xid_wait(10)
        b.xid_close()
    for _ in range(reps):
        for i in range(b.device_count()):
            b.read_fields(i, names)
    b.close()


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        one(sys.argv[2])
        return
    from probes.nvml_fields import FIELD_VALUES_CALL, field_specs

    groups = sorted({(s.call if s.call != FIELD_VALUES_CALL else "fv") for s in field_specs(18).values()})
    groups += ["xid", "all", "concurrent"]
    env = dict(os.environ, MALLOC_CHECK_="3", PYTHONFAULTHANDLER="1")

    def run(g: str) -> tuple[str, int, str]:
        p = subprocess.run([sys.executable, __file__, "--one", g], env=env, capture_output=True, text=True,
                           timeout=120)
        return g, p.returncode, (p.stderr.strip().splitlines() or [""])[-1][:200]

    with ThreadPoolExecutor(8) as ex:
        for g, rc, err in ex.map(run, groups):
            print(f"{g:45s} {'ok' if rc == 0 else 'CRASH rc=' + str(rc)} {err if rc else ''}", flush=True)


if __name__ == "__main__":
    main()
