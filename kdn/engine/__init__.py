"""Engine integration: transformers models that reuse KV from kdn."""

from kdn.engine.engine import EngineConfig, Generation, KDNEngine, Timings, decoder_layers

__all__ = ["EngineConfig", "Generation", "KDNEngine", "Timings", "decoder_layers"]
