"""What grpc's own server logs, said the way the agent's log reads.

grpc's asyncio server logs ``ExecuteBatchError raised in core by servicer method [...]`` at ERROR with a
Cython traceback when it cannot send the end of a call (its last message or status) because the call is
already over on the other side: a client that cancelled a stream after the events it wanted, a deadline that
passed as the handler returned, a connection that closed. The race is grpc's (it skips the log when it has
already seen the client close, and logs when the close arrives a moment later); the agent's state is not
touched by it and nothing is lost. An on-call engineer reading ERROR and a traceback would look for a bug, so
this filter turns exactly that record into one INFO line naming the method. Every other record of that
logger, an exception a handler raised included, passes unchanged.
"""
from __future__ import annotations

import logging
import re

GRPC_SERVER_LOGGER = "grpc._cython.cygrpc"
_GONE_PREFIX = "ExecuteBatchError raised in core by servicer method"
_METHOD = re.compile(r"\[([^\]]*)\]")


class ClientGoneFilter(logging.Filter):
    """Rewrites grpc's "could not send the end of the call" record into one INFO line; passes the rest."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if type(exc).__name__ != "ExecuteBatchError" or not str(record.msg).startswith(_GONE_PREFIX):
            return True
        try:
            text = record.getMessage()    # "... method [/pkg.Service/Method]", formatted or not
        except (TypeError, ValueError):
            text = str(record.msg)
        found = _METHOD.search(text)
        method = found.group(1) if found else "a method"
        record.msg = "the caller of %s was gone before the end of the call could be sent (%s); nothing to do"
        record.args = (method, _short(exc))
        record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        record.exc_info, record.exc_text = None, None
        return True


def _short(exc: BaseException) -> str:
    text = str(exc)   # Failed "execute_batch": (<grpc._cython.cygrpc.SendStatusFromServerOperation object at 0x..>,)
    ops = [part.split(" object")[0].rsplit(".", 1)[-1] for part in text.split("<")[1:]]
    return ", ".join(ops) if ops else text[:120]


def install() -> None:
    """Put the filter on grpc's server logger once (the agent calls this as it builds its servers)."""
    logger = logging.getLogger(GRPC_SERVER_LOGGER)
    if not any(isinstance(f, ClientGoneFilter) for f in logger.filters):
        logger.addFilter(ClientGoneFilter())
