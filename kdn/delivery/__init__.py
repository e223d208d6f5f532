"""Delivery policy: which stored encoding to fetch, or whether to recompute."""

from kdn.delivery.controller import RECOMPUTE, Decision, LoadingController, encoding_name

__all__ = ["RECOMPUTE", "Decision", "LoadingController", "encoding_name"]
