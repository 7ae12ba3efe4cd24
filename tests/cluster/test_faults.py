"""Ray Serve's side of the router, without vLLM engines: 2 replicas of a fake engine that report
digests the way ``compat/cluster.py`` does (keys hashed as vLLM hashes), behind our
``HybridRequestRouter``, called through a deployment handle from the test (so the router lives
in this process). A replica is killed mid-run: calls after it go to the survivor, the router
drops every entry of the dead replica at once and never routes by them, and when Serve starts a
replacement its digest is taken up and routing uses it. Slow (~40 s of Ray start-up); the unit
tests of ``routing.py`` check the same bookkeeping in CI."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("ray", reason="the cluster tests need the cluster extra")
pytest.importorskip("vllm", reason="prompt hashing is vLLM's")

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

HBS, BLOCK = 16, 64
APP = "faults"


def fake_engine_app():
    from ray import serve

    from vllm_hybrid.cluster import ray_api

    kwargs = {
        "policy": "state",
        "shape_path": "zamba2-2.7b",
        "throughput_tflops": 0.05,
        "overload_wait_s": 2.0,
    }

    @serve.deployment(
        num_replicas=2,
        ray_actor_options={"num_cpus": 0},
        request_router_config=ray_api.router_config(
            "vllm_hybrid.cluster.serve_router.HybridRequestRouter", kwargs, 0.2
        ),
        health_check_period_s=1,
    )
    class FakeEngine:
        def __init__(self):
            self.key = ray_api.current_replica_key()
            self.actor = serve.get_replica_context().replica_id.to_full_id_str()
            self.states, self.kv = set(), set()

        async def record_routing_stats(self):
            return {
                "digest": {
                    "taken_at": time.time(),
                    "hash_block_size": HBS,
                    "block_size": BLOCK,
                    "hash_algo": "sha256",
                    "none_hash": None,
                    "states": sorted(self.states),
                    "kv": sorted(self.kv),
                }
            }

        async def http(self, route, *_):
            from vllm_hybrid.adapters.vllm.compat.cluster import prompt_hashes

            keys = prompt_hashes(list(route.token_ids), route.cache_salt, HBS, "sha256")
            self.states.add(keys[-1])
            self.kv.update(keys[BLOCK // HBS - 1 :: BLOCK // HBS])
            yield (self.key, self.actor)

    return FakeEngine.bind()


def call(handle, route):
    """(replica key, actor name) of the replica that served ``route``."""
    (item,) = list(handle.options(stream=True).http.remote(route))  # to its end: completed
    return item


def test_a_killed_replica_is_dropped_and_routing_recovers():
    import ray
    from ray import serve

    from vllm_hybrid.cluster.routing import RouteRequest, live_router

    ray.init(num_cpus=2, include_dashboard=False)
    try:
        handle = serve.run(fake_engine_app(), name=APP, route_prefix=None)
        prompt = tuple(range(100, 300))
        home, actor = call(handle, RouteRequest("a1", prompt, session="a"))
        router = live_router(APP)
        assert router is not None
        deadline = time.monotonic() + 30
        while len(router.digests) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(router.digests) == 2
        deadline = time.monotonic() + 10  # until home's digest holds the state of turn 1
        while router.hits(RouteRequest("p", prompt + (1,)), home)[0] < 192:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        turn2 = prompt + tuple(range(400, 450))
        assert call(handle, RouteRequest("a2", turn2, session="a"))[0] == home

        (survivor,) = set(router.digests) - {home}
        ray.kill(ray.get_actor(actor, namespace="serve"), no_restart=True)
        served = []
        deadline = time.monotonic() + 60
        while len(served) < 4 and time.monotonic() < deadline:
            try:
                served.append(
                    call(handle, RouteRequest(f"a{3 + len(served)}", turn2, session="a"))[0]
                )
            except ray.exceptions.RayError:
                time.sleep(0.2)  # a call that reached the dead replica before Ray said so
        assert len(served) == 4 and home not in served  # (the replacement may be up already)
        assert home not in router.digests and home not in router.speculative
        assert all(f.replica != home for f in router.inflight.values())
        dead_at = len(router.records)

        deadline = time.monotonic() + 60  # Serve starts a replacement; its digest arrives
        while len(router.digests) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(router.digests) == 2 and home not in router.digests
        (new,) = set(router.digests) - {survivor}  # the replacement has a new replica id
        for i in range(6):  # fresh sessions spread over both live replicas again
            call(handle, RouteRequest(f"n{i}", tuple(range(1000 * i, 1000 * i + 100))))
        later = [r.replica for r in router.records[dead_at:]]
        assert home not in later and new in later
    finally:
        serve.shutdown()
        ray.shutdown()
