"""KDNEngine over a FleetClient (the real SmolLM2-135M, two in-process kdn nodes sharing a
real redis-server): a prompt's blocks stored through the fleet are reused, with the same
tokens as a full prefill, also after the node that served them stops."""

from __future__ import annotations

from pathlib import Path

import pytest

from kdn.client.fleet import FleetClient, FleetConfig
from kdn.engine import EngineConfig, KDNEngine
from tests.helpers import running_nodes
from tests.redis_servers import RedisServer

pytestmark = [pytest.mark.model, pytest.mark.redis]


def test_an_engine_reuses_blocks_through_the_fleet_across_a_node_loss(tmp_path: Path) -> None:
    from kdn.model.data import english_token_ids
    from kdn.model.models import load_model

    model, tokenizer = load_model("smollm2-135m")
    ids = [int(t) for t in english_token_ids(300, tokenizer)]
    with RedisServer(tmp_path / "redis") as redis, \
            running_nodes(tmp_path, redis_url=redis.url, tier_order=("ram", "redis")) as nodes:
        # no load bound to speak of: the engine's calls go where its blocks went, so the
        # stopped node is the one they try first
        config = FleetConfig(nodes=tuple(n.address for n in nodes), health_interval_s=0,
                             load_bound=100.0, client_options={"shm_bytes": 0})
        with FleetClient(config) as fleet:
            engine = KDNEngine(model, tokenizer, fleet,  # type: ignore[arg-type]
                               EngineConfig(chunk_tokens=64))
            full = engine.generate(ids, max_new_tokens=8)
            assert full.timings.decision == "recompute"
            assert full.store_thread is not None
            full.store_thread.join(60)
            # forced: on a busy 2-core host the controller may rightly find the prefill of
            # this small model cheaper than the hit it timed, and recompute (1 run in 4)
            hit = engine.generate(ids, max_new_tokens=8, force="lossless")
            assert hit.timings.reused_tokens == 256
            assert hit.token_ids == full.token_ids
            served = fleet.nodes.index(fleet.address)
            nodes[served].stop()
            after = engine.generate(ids, max_new_tokens=8, force="lossless")
            assert after.timings.reused_tokens == 256  # from Redis, through the other node
            assert after.token_ids == full.token_ids
            assert fleet.failovers >= 1 and fleet.address == nodes[1 - served].address
