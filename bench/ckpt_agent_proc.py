"""The checkpoint agent for a bench, in a process of its own as in production (issue 21): a Coordinator
over the bench's Redis and memory dir behind the `Checkpoints` gRPC service on a unix socket. The ranks'
commit work (manifest parsing, Redis, evaluation) then runs here, not under the training process's GIL.

    python bench/ckpt_agent_proc.py --redis-socket R --memory DIR --socket S   # prints "ready" when serving
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--redis-socket", required=True)
    ap.add_argument("--memory", required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--keep-committed", type=int, default=2)
    args = ap.parse_args(argv)

    import grpc
    import redis

    from checkpoint.coordinator import Coordinator, CoordinatorConfig
    from checkpoint.shm_store import ShmStore
    from daemon.checkpoint_service import CheckpointService, register

    co = Coordinator(redis.Redis(unix_socket_path=args.redis_socket), ShmStore(Path(args.memory)), node="bench",
                     location=args.memory,
                     config=CoordinatorConfig(keep_committed=args.keep_committed, rollback_span_steps=0))

    async def serve() -> None:
        server = grpc.aio.server()
        register(server, CheckpointService(co))
        server.add_insecure_port(f"unix:{args.socket}")
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
