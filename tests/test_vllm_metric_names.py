"""--vllm-metric-names: the engine gauges under vLLM's names equal tidal's own, on a live server with a
request running (what the Gateway API Inference Extension's endpoint picker reads, docs/scaling.md)."""

from __future__ import annotations

import json
import socket

from live_server import LiveServer, parse_metrics

PAIRS = (("vllm:num_requests_waiting", "tidal:num_requests_waiting"),
         ("vllm:num_requests_running", "tidal:num_requests_running"),
         ("vllm:kv_cache_usage_perc", "tidal:kv_cache_usage_perc"),
         ("vllm:gpu_cache_usage_perc", "tidal:kv_cache_usage_perc"))


def test_vllm_named_gauges_equal_tidals_while_requests_run():
    with LiveServer("--vllm-metric-names", "--min-step-time", "0.05", "--max-num-seqs", "1", "--no-ui") as server:
        idle = server.metrics()
        for vllm, tidal in PAIRS:
            assert idle[vllm] == idle[tidal] == 0
        body = json.dumps({"prompt": "Hello", "max_tokens": 100, "ignore_eos": True, "stream": True}).encode()
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n" % len(body) + body)
        clients = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
        try:
            for client in clients:  # one runs (--max-num-seqs 1), the other waits in the engine
                client.sendall(request)
            m = server.wait_for(lambda m: m["tidal:num_requests_running"] == 1 and m["tidal:num_requests_waiting"] == 1)
            for vllm, tidal in PAIRS:
                assert m[vllm] == m[tidal], vllm
            assert m["vllm:kv_cache_usage_perc"] > 0
        finally:
            for client in clients:
                client.close()
        server.wait_idle()


def test_without_the_flag_no_vllm_names(tmp_path):
    # the default server of the api tests is not at hand here: a Metrics render is the same code
    from tidal.observe.metrics import Metrics
    from tidal.wire import EngineStats

    text = Metrics("m").render(EngineStats(num_total_blocks=4), 0).decode()
    assert "vllm:" not in text
    assert "vllm:num_requests_waiting" in Metrics("m", vllm_names=True).render(EngineStats(), 0).decode()
    assert parse_metrics(text)["tidal:num_requests_waiting"] == 0
