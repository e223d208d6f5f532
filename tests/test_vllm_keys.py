"""What a vLLM request's kdn keys depend on beyond its token ids, as vLLM's own prefix cache
does (``kdn.integrations.vllm_keys``): its images, its prompt embeddings, its LoRA adapter's
name and path, its ``cache_salt``. A request that differs in one of them is a miss, the same
request again a hit (vLLM's classes and the replay of ``tests.test_vllm``)."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM's config infers a platform
pytest.importorskip("vllm.v1.request")

from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kdn import keys  # noqa: E402
from kdn.errors import InvalidArgument  # noqa: E402
from kdn.server import ServerThread  # noqa: E402
from tests import test_vllm as base  # noqa: E402
from tests.helpers import uniform_layout  # noqa: E402
from tests.test_vllm import CHUNK, answered, both, fp16_replay  # noqa: E402

kdn_server = base.kdn_server

IMG = 7  # an image's placeholder token
PROMPT = [1, 2, 3] + [IMG] * 20 + [4, 5, 6, 8, 9, 10, 11, 12]  # 31 tokens: 3 chunks usable
HIT = 3 * CHUNK


def with_image(rid: str, image: str, offset: int = 3) -> Request:
    feat = MultiModalFeatureSpec(data=None, modality="image", identifier=image,
                                 mm_position=PlaceholderRange(offset=offset, length=20),
                                 mm_hash=image)
    return Request(rid, list(PROMPT), SamplingParams(max_tokens=4), None, mm_features=[feat])


def with_embeds(rid: str, seed: int) -> Request:
    emb = torch.randn(len(PROMPT), 16, generator=torch.Generator().manual_seed(seed))
    mask = [not 3 <= p < 23 for p in range(len(PROMPT))]  # positions 3..22 are embeddings
    return Request(rid, list(range(100, 100 + len(PROMPT))), SamplingParams(max_tokens=4),
                   None, prompt_embeds=emb, prompt_is_token_ids=mask)


def only_embeds(rid: str, seed: int) -> Request:
    """A prompt given as embeddings only (no token ids: vLLM's are 0s)."""
    emb = torch.randn(len(PROMPT), 16, generator=torch.Generator().manual_seed(seed))
    return Request(rid, None, SamplingParams(max_tokens=4), None, prompt_embeds=emb)


def with_adapter(rid: str, name: str, path: str) -> Request:
    return Request(rid, list(PROMPT), SamplingParams(max_tokens=4), None,
                   lora_request=LoRARequest(name, 1, path))


def with_salt(rid: str, salt: str) -> Request:
    return Request(rid, list(PROMPT), SamplingParams(max_tokens=4), None, cache_salt=salt)


CASES: dict[str, tuple[Callable[[str], Request], Callable[[str], Request]]] = {
    "image": (lambda r: with_image(r, "hash-of-A"), lambda r: with_image(r, "hash-of-B")),
    "image position": (lambda r: with_image(r, "hash-of-A"),
                       lambda r: with_image(r, "hash-of-A", offset=4)),
    "prompt embeds": (lambda r: with_embeds(r, 1), lambda r: with_embeds(r, 2)),
    "prompt embeds only": (lambda r: only_embeds(r, 1), lambda r: only_embeds(r, 2)),
    "adapter path": (lambda r: with_adapter(r, "sql", "/adapters/sql-v1"),
                     lambda r: with_adapter(r, "sql", "/adapters/sql-v2")),
    "adapter framing": (lambda r: with_adapter(r, "a:b", "c"),
                        lambda r: with_adapter(r, "a", "b:c")),
    "cache salt": (lambda r: with_salt(r, "alice"), lambda r: with_salt(r, "bob")),
}


@pytest.mark.parametrize("what", list(CASES))
def test_a_request_that_differs_beyond_its_tokens_is_a_miss(kdn_server: ServerThread,
                                                           what: str) -> None:
    stored, other = CASES[what]
    s, w = both(kdn_server.address, encodings=["raw"])
    assert w.worker is not None
    rp = fp16_replay(s, w)
    try:
        assert answered(rp, stored("first")) == 0
        rp.step()
        w.worker.wait_saves(30)
        assert answered(rp, other("other")) == 0, what
        assert answered(rp, stored("again")) == HIT, what
    finally:
        s.shutdown()
        w.shutdown()


def test_prefix_key_extras_change_their_chunk_and_every_later_one() -> None:
    layout = uniform_layout(2, 2, 8)
    ids = list(range(32))
    plain = keys.prefix_keys(ids, layout, "vllm", 8)
    assert keys.prefix_keys(ids, layout, "vllm", 8, extras=[b"", b""]) == plain
    got = keys.prefix_keys(ids, layout, "vllm", 8, extras=[b"", b"img"])
    assert got[0] == plain[0] and all(a != b for a, b in zip(got[1:], plain[1:]))
    with pytest.raises(InvalidArgument, match="extras"):
        keys.prefix_keys(ids, layout, "vllm", 8, extras=[b"", "img"])  # type: ignore[list-item]
