"""Open the store behind a copy's location (a directory, an s3:// URL, a peer agent's URL): torch-free.

Used by the rank's restore and snapshot, by the agent (verifying copies on other nodes) and by
`sdcwatch ckpt restore`.
"""
from __future__ import annotations

from checkpoint.blobstore import BlobStore
from checkpoint.grpc_store import grpc_store_for, is_peer_url
from checkpoint.s3_store import s3_store_for
from checkpoint.shm_store import DirStore


def dir_store_for(location: str) -> BlobStore:
    """The store at a copy's location: a directory (memory, NVMe, flash tiers), an s3:// URL (one client
    per URL, reused; credentials from the usual AWS sources), or a peer agent's memory tier at a
    grpcs:// / unix:// / grpc:// URL (checkpoint/grpc_store.py; credentials from the agent's [peers]
    config or the SDCWATCH_PEER_* environment)."""
    if location.startswith("s3://"):
        return s3_store_for(location)
    if is_peer_url(location):
        return grpc_store_for(location)
    return DirStore(location, create=False)
