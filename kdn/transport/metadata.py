"""gRPC metadata keys shared by clients and servers."""

import re

API_KEY_HEADER = "x-kdn-api-key"
"""Carries the caller's API key (``authorization: Bearer <key>`` is accepted too)."""
REQUEST_ID_HEADER = "x-request-id"
"""Carries a request id from client to server logs; the server echoes it in trailers."""
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
"""A request id the server keeps: it is on every log line of the call, so never free text (no
spaces, newlines or brackets to forge a line with); the server replaces any other with one it
makes, so a client refuses one that does not match."""
EXPORT_SKIPPED_HEADER = "x-kdn-export-skipped"
"""In an Export's trailers: how many entries it left out, no tier holding a good copy."""
