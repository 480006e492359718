"""The agent image's installed size, estimated from the distributions `sdcwatch[k8s,s3]` pulls into this
environment (sizes from their RECORD files) plus the slim base image. Run it in a fresh venv made by
`scripts/setup.sh` (an editable install made before an extra existed misses that extra's packages).

    python bench/image_size.py        # prints the estimate and the largest contributors; target: < 300 MB
"""
from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_images import BASE_IMAGE_MB, closure  # noqa: E402 - the one definition of what the image holds


def main() -> int:
    rows = []
    for name in sorted(closure("sdcwatch", {"k8s", "s3"}) - {"sdcwatch"}):
        dist = metadata.distribution(name)
        rows.append((sum((f.size or 0) for f in (dist.files or [])) / 1e6, name, dist.version))
    total = BASE_IMAGE_MB + sum(r[0] for r in rows)
    print(f"agent image, estimated: {total:.0f} MB ({BASE_IMAGE_MB} MB base + {total - BASE_IMAGE_MB:.0f} MB "
          f"of {len(rows)} distributions); target < 300 MB")
    for mb, name, version in sorted(rows, reverse=True)[:10]:
        print(f"  {mb:6.1f} MB  {name} {version}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
