"""Engine integration: the connector protocol and KDNEngine, a transformers model reusing KV
from kdn through it."""

from kdn.extras import model_side

with model_side("kdn.engine"):  # kdn[model] not installed: MissingExtra
    from kdn.engine.connector import KVConnector
    from kdn.engine.engine import EngineConfig, Generation, KDNEngine, Timings

__all__ = ["EngineConfig", "Generation", "KDNEngine", "KVConnector", "Timings"]
