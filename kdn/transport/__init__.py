"""How bytes travel between client and server; the storage side's, so no torch here.

``wire`` (frame messages encoded and parsed by hand, the data paths' opcodes), ``netio``
(containers read off a socket and checked as they land), ``buffers`` (recycled receive
buffers, the allocator's thresholds), ``regions`` (byte ranges of a shared region),
``addresses`` (whether an address keeps traffic on this machine) and ``metadata`` (the gRPC
metadata keys). Both sides import these modules directly; this package exports nothing, so
importing one of them runs nothing else.
"""
