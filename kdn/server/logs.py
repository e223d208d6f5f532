"""The server's log lines: one format for every logger, text or JSON lines, with the request
id of the call being served (the ``x-request-id`` a client sent, or the one the server made).

    configure("INFO", "json")   # {"ts": ..., "level": "INFO", "logger": "kdn.access",
                                #  "request_id": "...", "rpc": "Retrieve", ...} per line

With tracing on (``kdn.tracing``), JSON lines written inside a span also carry its
``trace_id`` and ``span_id``, so a log line leads to its trace and back.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time

from kdn import tracing

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("kdn_request_id", default="")
"""The request id of the call this task or thread serves ("" outside calls)."""


class _RequestId(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        ids = tracing.current_ids()
        if ids is not None:
            record.trace_id, record.span_id = ids
        return True


class JsonLines(logging.Formatter):
    """One JSON object per line. A message that is itself a JSON object (the access and audit
    logs) has its fields merged in rather than quoted."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name,
            "request_id": getattr(record, "request_id", ""),
        }
        trace_id = getattr(record, "trace_id", "")
        if trace_id:
            out["trace_id"], out["span_id"] = trace_id, getattr(record, "span_id", "")
        msg = record.getMessage()
        fields = None
        if msg.startswith("{"):
            try:
                fields = json.loads(msg)
            except ValueError:
                fields = None
        if isinstance(fields, dict):
            out.update({k: v for k, v in fields.items() if k not in ("ts", "level", "logger")})
        else:
            out["msg"] = msg
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


TEXT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


def configure(level: str, fmt: str = "text") -> None:
    """Send every logger's lines to stderr in ``fmt`` (text or json) at ``level``."""
    handler = logging.StreamHandler()
    handler.addFilter(_RequestId())
    handler.setFormatter(JsonLines() if fmt == "json" else logging.Formatter(TEXT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
