"""Storage tiers (one module each) and the hierarchy that owns policy (``tiered``)."""

from kdn.store.base import Tier, TierStats
from kdn.store.tiered import Hit, Presence, TieredStore

__all__ = ["Hit", "Presence", "Tier", "TierStats", "TieredStore"]
