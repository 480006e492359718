"""Small helpers shared by several test files."""
from __future__ import annotations

import contextlib
import datetime
from pathlib import Path
from typing import Any, Iterator

from checksums.reporter import Directive, ReporterStats, StepReport, to_request


def self_signed_cert() -> tuple[bytes, bytes]:
    """A self-signed CA certificate for `localhost` (PEM cert, PEM key), valid for a day."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def write_self_signed(tmp: Path) -> tuple[Path, Path]:
    cert, key = self_signed_cert()
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert)
    key_path.write_bytes(key)
    return cert_path, key_path


class RecordingReporter:
    """A `StepSink` that keeps what a Monitor submits: the plain reports, and each one's wire form as the
    gRPC reporter would send it (`checksums.reporter.to_request`; the transport is tested in test_reporter)."""

    def __init__(self) -> None:
        self.reports: list[StepReport] = []
        self.requests: list[Any] = []

    def submit(self, report: StepReport) -> bool:
        self.reports.append(report)
        self.requests.append(to_request(report))
        return True

    def take_directives(self) -> list[Directive]:
        return []

    def stats(self) -> ReporterStats:
        return ReporterStats(sent=len(self.reports))


@contextlib.contextmanager
def count_host_syncs(monitor: Any, seen: list[str]) -> Iterator[None]:
    """Record every call that would make the host wait for the device (on CUDA) while active."""
    import torch   # here: the agent's tests import this module without torch

    patches: list[tuple[Any, str, Any]] = []

    def spy(owner: Any, name: str) -> None:
        orig = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if name != "_drain" or kwargs.get("block", args[0] if args else False):
                seen.append(name)
            return orig(*args, **kwargs)
        patches.append((owner, name, orig))
        setattr(owner, name, wrapper)

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy"):
        spy(torch.Tensor, name)
    spy(torch, "equal")
    spy(torch.cuda.Event, "synchronize")
    spy(torch.cuda, "synchronize")
    spy(monitor, "flush")
    spy(monitor, "_drain")
    try:
        yield
    finally:
        for owner, name, orig in reversed(patches):
            if owner is monitor:
                delattr(owner, name)
            else:
                setattr(owner, name, orig)


def recovery_outcome(monitor: Any, recovery: Any, state: list[Any], **extra: Any) -> dict[str, Any]:
    """What a replica-recovery test rank reports, the Monitor closed: `state` (its tensors' bytes, as lists),
    the skipped steps, the repairs, the mismatching votes, the step count, stage errors and the rewrites."""
    out = {"state": state, "skipped": [s.step for s in monitor.guard.skipped],
           "repairs": [(r.vote_step, r.at_step, r.source_rank, r.ok) for r in recovery.repairs] if recovery else [],
           "mismatches": monitor.stats.mismatches, "step": monitor.step_count,
           "errors": monitor.guard.stats.errors, "rewrites": monitor.guard.rewrites, **extra}
    monitor.close()
    return out
