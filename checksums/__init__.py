"""Exact tensor fingerprints (see ``checksums.fingerprint`` for the spec)."""

from .fingerprint import (
    clear_fingerprint_cache,
    fingerprint_bytes,
    fingerprint_list_from_parts,
    fingerprint_numpy,
    fingerprint_tensor,
    fingerprint_tensors,
    fingerprint_tensors_async,
    fingerprint_words_to_ints,
    prepare_fingerprint,
)

__all__ = [
    "clear_fingerprint_cache",
    "fingerprint_bytes",
    "fingerprint_list_from_parts",
    "fingerprint_numpy",
    "fingerprint_tensor",
    "fingerprint_tensors",
    "fingerprint_tensors_async",
    "fingerprint_words_to_ints",
    "prepare_fingerprint",
]
