"""The ``kdn`` command line."""
