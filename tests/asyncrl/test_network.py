"""A service bound to every interface publishes its node's address ($ASYNCRL_NODE_IP, which the launcher's
actors set), and answers there: the asyncrl service base (the orchestrator here), the env SDK's own server,
and the embedded Redis. 127.0.0.3 stands for the node's address: the whole of 127/8 reaches loopback, and
a URL that said 0.0.0.0 or 127.0.0.1 would not equal it. tests/test_multi_host.py does the same across two
real network namespaces."""

from __future__ import annotations

import httpx
import redis

import asyncrl.network
from asyncrl.network import GLOO_INTERFACE_ENV, NODE_IP_ENV, advertised_host, http_url, use_gloo_interface_towards
from asyncrl_run.redis_server import EmbeddedRedis
from tests.services import ServiceProcess

NODE = "127.0.0.3"


def test_a_wildcard_bind_is_advertised_by_the_node_address_and_any_other_as_itself(monkeypatch):
    monkeypatch.setenv(NODE_IP_ENV, NODE)
    assert advertised_host("0.0.0.0") == advertised_host("") == NODE
    assert advertised_host("127.0.0.1") == "127.0.0.1" and advertised_host("10.1.2.3") == "10.1.2.3"
    assert http_url("0.0.0.0", 80) == f"http://{NODE}:80" and http_url("::1", 80) == "http://[::1]:80"
    monkeypatch.delenv(NODE_IP_ENV)
    assert advertised_host("0.0.0.0") not in ("0.0.0.0", "")  # the routing interface's address (or loopback)


def test_gloo_binds_the_interface_towards_the_broadcast_master_unless_the_user_chose_one(monkeypatch):
    """Without it, gloo on a host whose name resolves to no address binds loopback, and a broadcast from
    another host cannot connect (tests/test_multi_host.py's distributed push saw exactly that)."""
    monkeypatch.delenv(GLOO_INTERFACE_ENV, raising=False)
    monkeypatch.setattr(asyncrl.network, "_chosen_gloo_interface", None)
    use_gloo_interface_towards("127.0.0.1")
    assert asyncrl.network.os.environ[GLOO_INTERFACE_ENV] == "lo"
    monkeypatch.setenv(GLOO_INTERFACE_ENV, "eth7")  # the user's choice stands
    use_gloo_interface_towards("127.0.0.1")
    assert asyncrl.network.os.environ[GLOO_INTERFACE_ENV] == "eth7"


def test_services_bound_to_every_interface_publish_and_answer_at_the_node_address(tmp_path, monkeypatch):
    monkeypatch.setenv(NODE_IP_ENV, NODE)
    server = EmbeddedRedis(tmp_path / "redis", aof=False, host="0.0.0.0").start()
    services = []
    try:
        assert server.url.startswith(f"redis://{NODE}:")
        assert redis.Redis.from_url(server.url).ping()
        services.append(ServiceProcess("orchestrator.server", ["--redis-url", server.url, "--run", "net", "--llm-url",
                                                               "http://127.0.0.1:9/v1", "--host",
                                                               "0.0.0.0"], tmp_path, name="orchestrator"))
        services.append(ServiceProcess("envs.serve", ["--env", "tests.orchestrator.timed_env.TimedEnv", "--host",
                                                      "0.0.0.0"], tmp_path, name="env"))
        for service in services:
            assert service.url.startswith(f"http://{NODE}:"), service.url
            assert httpx.get(f"{service.url}/health", timeout=10).status_code == 200
    finally:
        for service in services:
            service.stop()
        server.stop()
