"""gRPC metadata keys shared by clients and servers."""

API_KEY_HEADER = "x-kdn-api-key"
"""Carries the caller's API key (``authorization: Bearer <key>`` is accepted too)."""
REQUEST_ID_HEADER = "x-request-id"
"""Carries a request id from client to server logs; the server echoes it in trailers."""
EXPORT_SKIPPED_HEADER = "x-kdn-export-skipped"
"""In an Export's trailers: how many entries it left out, no tier holding a good copy."""
