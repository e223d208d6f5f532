"""Engines' storage interfaces implemented over the kdn client, each an optional extra.

* ``kdn.integrations.sglang``: SGLang's HiCache L3 storage (``KDNHiCacheStorage``); needs
  ``sglang`` installed (``scripts/bootstrap.sh sglang``).
* ``kdn.integrations.vllm``: vLLM's v1 KV connector (``KDNConnector``), loaded by vLLM from its
  module path; needs ``vllm`` installed (``scripts/bootstrap.sh vllm``).

Nothing here is imported by ``kdn`` itself: importing a module of this package is what loads
the engine it plugs into.
"""
