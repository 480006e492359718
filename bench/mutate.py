"""A copy of the tree with one named mutant applied, for checking that GPU tests fail without the code they test.

    python3 bench/mutate.py /tmp/mut update-waits     # copies . to /tmp/mut (no .git/.venv/.whl), patches it

Each mutant is a list of (file, old, new); every `old` must occur exactly once (a mutant that no longer
applies is an error, not a silent pass). bench/gpu_run.sh runs the tests in the copy and expects them to fail.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

MUTANTS: dict[str, tuple[str, list[tuple[str, str, str]]]] = {
    "update-waits": ("the update's waits for the save cut out", [
        ("checkpoint/snapshot.py", "            cur.wait_event(ev)\n", "            pass\n"),
        ("checkpoint/snapshot.py", "self._inflight.append((dev, ev))  # the optimizer's", "pass  # the optimizer's"),
    ]),
    "hook-wait-stream": ("the hooks' side stream waits through torch's wait_stream (an event made a call)", [
        ("checksums/grad_checks.py",
         "            ready.record(torch.cuda.current_stream(buf.device))   # the bucket's gradients are ready there\n"
         "            side.wait_event(ready)\n",
         "            side.wait_stream(torch.cuda.current_stream(buf.device))\n"),
        ("checksums/grad_checks.py",
         "                done.record(side)\n"
         "                self._current.get(dev)[1].wait_event(done)\n",
         "                self._current.get(dev)[1].wait_stream(side)\n"),
    ]),
}


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] not in MUTANTS:
        print(f"usage: mutate.py DEST {{{','.join(MUTANTS)}}}", file=sys.stderr)
        return 2
    dest, name = Path(argv[0]), argv[1]
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(".", dest, ignore=shutil.ignore_patterns(".git", ".venv", ".whl", "__pycache__"))
    what, edits = MUTANTS[name]
    texts: dict[Path, str] = {}
    for rel, old, new in edits:       # every edit checked before any file is written: all or none
        p = dest / rel
        s = texts.get(p, p.read_text())
        if s.count(old) != 1:
            print(f"mutant {name}: {rel} has {s.count(old)} copies of {old!r} (must be 1)", file=sys.stderr)
            return 1
        texts[p] = s.replace(old, new)
    for p, s in texts.items():
        p.write_text(s)
    print(f"mutant {name}: {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
