"""Delivery policy: which stored encoding to fetch, or whether to recompute."""

from kdn.delivery.controller import Decision, LoadingController
from kdn.delivery.defaults import (
    IN_PROCESS,
    NETWORK,
    PATH_PRIORS_B_S,
    PATHS,
    RECOMPUTE,
    SAME_HOST,
    default_encodings,
    encoding_name,
)

__all__ = ["IN_PROCESS", "NETWORK", "PATHS", "PATH_PRIORS_B_S", "RECOMPUTE", "SAME_HOST",
           "Decision", "LoadingController", "default_encodings", "encoding_name"]
