"""The model side's reach into transformers: the only package of kdn that imports it.

``hf`` (the one transformers adapter: layouts, caches, prefill, the greedy loop, the pieces
of a model kdn drives), ``models`` (the small causal LM tests and benchmarks run on, loaded
offline), ``data`` (SQuAD dev and English text for evaluation), ``embed`` (sentence
embeddings for RAG) and ``families`` (the model families the blender computes exactly). This
package exports nothing, so importing one of them loads only what that module needs: torch,
which all but ``families`` need, is imported here, where a missing one is MissingExtra naming
kdn's model extra (``kdn.extras``).
"""

from kdn.extras import model_side

with model_side("kdn.model"):
    import torch  # noqa: F401

