"""Tensor parallelism on CPU (gloo) with real rank processes: the same greedy tokens as one rank and
as transformers, served through the openai SDK, a dead rank taking its replica down cleanly, two
"nodes" on loopback, and a clear error for a size that does not split the model.

Float32 throughout: a row-parallel all-reduce sums the same products in a different order than one
rank's matmul, which the tiny test models' logit gaps (tests/hf_models.py) are far above.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from hf_models import hf_greedy, load_hf_model, tokenizer_vocab_size
from live_server import LiveServer, child_processes, free_rendezvous_ports
from tidal.gpu.engine import Engine
from tidal.wire import AddRequest, EngineConfig, SamplingParams

NUM_NEW_TOKENS = 6
# mixed lengths; a batch token budget of 16 makes the long one prefill in chunks beside the decodes
PROMPTS = [[0, 1013, 318, 2047, 57, 4000, 911], list(range(100, 141)), [0, 8]]

CASES = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    # one KV head for two ranks (replicated), and a vocabulary that does not split evenly (padded)
    "llama-kv1-odd-vocab": {"num_key_value_heads": 1, "vocab_size": tokenizer_vocab_size() + 1},
}


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """An in-process rank 0 takes its share of the cores (torch.set_num_threads): give them back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def run_engine(model_dir: str, tensor_parallel_size: int, prompts: list[list[int]] = PROMPTS,
               max_num_batched_tokens: int = 16) -> list[list[int]]:
    """Greedy tokens of ``prompts`` from an in-process engine; rank 0 is this process."""
    engine = Engine(EngineConfig(model=model_dir, dtype="float32", tensor_parallel_size=tensor_parallel_size,
                                 block_size=4, num_kv_blocks=256, max_num_batched_tokens=max_num_batched_tokens))
    try:
        params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
        for rid, prompt in enumerate(prompts):
            engine.add_request(AddRequest(rid, prompt, params, 0, 0.0))
        tokens: list[list[int]] = [[] for _ in prompts]
        while engine.has_work():
            engine.step()
            report = engine.take_report()
            for out in report.outputs if report else ():
                tokens[out.request_id].extend(out.token_ids)
        assert engine.block_manager.num_used_blocks == 0
        return tokens
    finally:
        if engine.runner.tp is not None:
            engine.runner.tp.close()


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_give_the_same_greedy_tokens_as_one_and_as_transformers(case, hf_model_dir):
    model_dir = hf_model_dir(case.split("-")[0], seed=list(CASES).index(case), **CASES[case])
    one_rank = run_engine(model_dir, 1)
    two_ranks = run_engine(model_dir, 2)
    hf = load_hf_model(model_dir)
    expected = [hf_greedy(hf, prompt, NUM_NEW_TOKENS) for prompt in PROMPTS]
    assert two_ranks == one_rank == expected


def test_a_long_prefill_travels_in_a_broadcast_of_its_own(hf_model_dir):
    """400 tokens in one step: the batch's payload exceeds the fixed first broadcast."""
    model_dir = hf_model_dir("qwen2")
    prompt = [(7 * i) % 8000 + 10 for i in range(400)]
    hf = hf_greedy(load_hf_model(model_dir), prompt, NUM_NEW_TOKENS)
    assert run_engine(model_dir, 2, [prompt], max_num_batched_tokens=512) == [hf]


def test_each_rank_holds_only_its_shard(hf_model_dir):
    """Half the heads, half the MLP, half the vocabulary, its own KV heads; the cache sizes agree."""
    from tidal.gpu.model_runner import ModelRunner

    model_dir = hf_model_dir("llama")
    runner = ModelRunner(EngineConfig(model=model_dir, dtype="float32", tensor_parallel_size=2,
                                      kv_cache_memory_bytes=1 << 20))
    try:
        attn = runner.model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
        assert tuple(attn.qkv_proj.weight.shape) == ((2 + 1 + 1) * 16, 64)
        assert tuple(attn.o_proj.weight.shape) == (64, 2 * 16)
        assert tuple(runner.model.model.layers[0].mlp.down_proj.weight.shape) == (64, 64)
        assert runner.model.model.embed_tokens.shape[0] == -(-tokenizer_vocab_size() // 2)
        assert runner.kv_caches[0][0].shape[2] == 1
        # 1 MiB per rank of 1-head blocks: twice the blocks one rank with both heads would get
        assert runner.num_blocks == (1 << 20) // (2 * 2 * 16 * 1 * 16 * 4)
    finally:
        runner.tp.close()


def test_shards_are_packed_like_whole_layers(hf_model_dir):
    """bf16 on a CPU that packs weights: every shard (a layers.Linear) is packed, as one rank's layers are."""
    from tidal.gpu.model.layers import Linear, packs_weights
    from tidal.gpu.model_runner import ModelRunner

    if not packs_weights(torch.bfloat16, "cpu"):
        pytest.skip("this CPU does not prepack bf16 weights")
    runner = ModelRunner(EngineConfig(model=hf_model_dir("qwen2"), dtype="bfloat16", tensor_parallel_size=2,
                                      num_kv_blocks=16))
    try:
        linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
        assert len(linears) > 4 and all(m.weight is None for m in linears)  # only the packed layouts remain
    finally:
        runner.tp.close()


# ---------------------------------------------------------------------- served


@pytest.fixture(scope="module")
def served_model(tmp_path_factory):
    from hf_models import make_hf_model

    return make_hf_model("qwen3", tmp_path_factory.mktemp("tp-served"))


def rank_pids(engine_pid: int) -> list[int]:
    return [c.pid for c in child_processes(engine_pid, "tidal.gpu.parallel.worker")]


@pytest.mark.slow
def test_a_served_two_rank_request_through_the_openai_sdk(served_model):
    import openai
    from tokenizers import Tokenizer

    with LiveServer("--model", served_model, "--tensor-parallel-size", "2", "--dtype", "float32") as server:
        (rank,) = rank_pids(server.engine_pid())
        rank_process = psutil.Process(rank)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
        prompt = PROMPTS[0]
        completion = client.completions.create(model=served_model, prompt=prompt, max_tokens=NUM_NEW_TOKENS,
                                               temperature=0)
        expected = hf_greedy(load_hf_model(served_model), prompt, NUM_NEW_TOKENS)
        tokenizer = Tokenizer.from_file(os.path.join(served_model, "tokenizer.json"))
        assert completion.choices[0].text == tokenizer.decode(expected)
        assert completion.usage.completion_tokens == NUM_NEW_TOKENS

        # a client that leaves mid-stream: rank 0's scheduler drops it (rank 1 needs no word of it),
        # its blocks come free, and the next request on the same prompt is still exact
        stream = client.completions.create(model=served_model, prompt=PROMPTS[1], max_tokens=200, stream=True)
        next(iter(stream))
        stream.close()
        server.wait_idle()
        again = client.completions.create(model=served_model, prompt=prompt, max_tokens=NUM_NEW_TOKENS,
                                          temperature=0)
        assert again.choices[0].text == completion.choices[0].text
    assert server.process.returncode == 0
    assert not rank_process.is_running() or rank_process.status() == psutil.STATUS_ZOMBIE  # gone with its server


# ---------------------------------------------------------------------- a rank dies

TP_FLAGS = ("--tensor-parallel-size", "2", "--min-step-time", "0.05", "--num-kv-blocks", "128",
            "--tokenizer-workers", "1")


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def restarts(metrics: dict[str, float]) -> float:
    return sum(v for k, v in metrics.items() if k.startswith("tidal:replica_restarts{"))


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow
def test_a_killed_rank_fails_its_streams_and_restarts_bring_the_replica_back():
    from cancellation.cancel_helpers import RawHttp, completion_body, poll, scrape_health, unique_prompt

    with LiveServer(*TP_FLAGS, "--engine-restarts", "2") as server:
        engine = server.engine_pid()
        (rank,) = rank_pids(engine)
        stream = RawHttp(server.port, "/v1/completions", completion_body(unique_prompt(8, seed=1), 200))
        stream.next_chunk()
        os.kill(rank, signal.SIGKILL)

        events = stream.rest_of_stream()  # the engine noticed at once: the stream ends with an error
        stream.close()
        assert events[-1] == "[DONE]" and '"engine_error"' in events[-2], events[-3:]
        wait_until(lambda: gone(engine), 10, "rank 0 exits after its rank 1 died")
        assert "tensor-parallel rank 1" in server.log() and "SIGKILL" in server.log()

        poll(server, lambda m: m["tidal:replicas_live"] == 1 and restarts(m) == 1, timeout=60)
        new_engine = server.engine_pid()
        assert new_engine != engine and len(rank_pids(new_engine)) == 1 and scrape_health(server) == 200
        ok = RawHttp(server.port, "/v1/completions", completion_body(unique_prompt(8, seed=2), 4, stream=False))
        assert ok.read_head() == 200 and ok.read_json()["usage"]["completion_tokens"] == 4
        ok.close()

        # the other way round: a killed rank 0 leaves no rank behind
        (new_rank,) = rank_pids(new_engine)
        os.kill(new_engine, signal.SIGKILL)
        wait_until(lambda: gone(new_rank), 10, "rank 1 dies with its rank 0")
        poll(server, lambda m: m["tidal:replicas_live"] == 1 and restarts(m) == 2, timeout=60)
    assert server.process.returncode == 0


@pytest.mark.slow
def test_without_restarts_a_killed_rank_stops_the_server_with_code_3():
    server = LiveServer(*TP_FLAGS)
    server.start()
    try:
        engine = server.engine_pid()
        (rank,) = rank_pids(engine)
        os.kill(rank, signal.SIGKILL)
        assert server.process.wait(timeout=30) == 3
        assert gone(engine)
    finally:
        server.stop()


@pytest.mark.slow
def test_two_replicas_of_two_ranks_each_meet_at_their_own_port_and_both_serve():
    import json

    from cancellation.cancel_helpers import RawHttp, completion_body, unique_prompt

    port = free_rendezvous_ports(2)
    with LiveServer(*TP_FLAGS, "--data-parallel-size", "2", "--master-port", str(port)) as server:
        engines = child_processes(server.process.pid, "tidal.gpu")
        assert len(engines) == 2 and all(len(rank_pids(e.pid)) == 1 for e in engines)
        listening = [{c.laddr.port for c in e.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
                     for e in engines]
        # replica k's rank 0 holds the rendezvous store at --master-port + k
        assert sorted(p for ports in listening for p in ports & {port, port + 1}) == [port, port + 1]
        streams = []
        for i in range(2):  # the second is routed to the other, idle replica (the first runs >= 3 s)
            stream = RawHttp(server.port, "/v1/completions", completion_body(unique_prompt(8, seed=10 + i), 60))
            stream.next_chunk()
            streams.append(stream)
        for stream in streams:
            events = stream.rest_of_stream()
            stream.close()
            assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        m = server.metrics()
        routed = {k: v for k, v in m.items() if k.startswith("tidal:requests_routed_total{") and v}
        assert list(routed.values()) == [1.0, 1.0]
        assert sum('replica="0"' in k for k in routed) == sum('replica="1"' in k for k in routed) == 1, routed


# ---------------------------------------------------------------------- two nodes on loopback


@pytest.mark.slow
def test_two_nodes_on_loopback_serve_restart_and_shut_down_together(served_model, tmp_path):
    import openai
    from tokenizers import Tokenizer

    from cancellation.cancel_helpers import poll

    port = str(free_rendezvous_ports())
    node_flags = ("--model", served_model, "--tensor-parallel-size", "2", "--dtype", "float32", "--nnodes", "2",
                  "--master-addr", "127.0.0.1", "--master-port", port, "--engine-restarts", "1")
    node1_log = open(tmp_path / "node1.log", "w+")
    node1 = subprocess.Popen([sys.executable, "-m", "tidal", "serve", *node_flags, "--node-rank", "1"],
                             stdout=node1_log, stderr=subprocess.STDOUT)
    expected = Tokenizer.from_file(os.path.join(served_model, "tokenizer.json")).decode(
        hf_greedy(load_hf_model(served_model), PROMPTS[0], NUM_NEW_TOKENS))

    def complete(server) -> str:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
        return client.completions.create(model=served_model, prompt=PROMPTS[0], max_tokens=NUM_NEW_TOKENS,
                                         temperature=0).choices[0].text

    # The bounds below are for a busy host (two nodes' ranks, a restart and its rendezvous on shared
    # cores): each wait ends at its event, so they cost nothing when the host is idle.
    try:
        with LiveServer(*node_flags, "--node-rank", "0") as server:
            # node 0 runs rank 0 only; `tidal serve --node-rank 1` became node 1's launcher of rank 1
            engine = server.engine_pid()
            assert rank_pids(engine) == []
            (rank1,) = psutil.Process(node1.pid).children()
            assert complete(server) == expected

            # rank 0 dies: node 1's rank fails its next broadcast, its launcher starts it again, and
            # it meets the restarted rank 0 at the same port
            os.kill(engine, signal.SIGKILL)
            wait_until(lambda: gone(rank1.pid), 60, "rank 1 leaves when rank 0 is gone")
            poll(server, lambda m: m["tidal:replicas_live"] == 1 and restarts(m) == 1, timeout=300)
            assert complete(server) == expected
        # node 0 shut down: rank 0 told rank 1, and the headless node exits cleanly
        assert node1.wait(timeout=120) == 0
        node1_log.seek(0)
        text = node1_log.read()
        assert "headless" in text and "restarting its ranks" in text and "Traceback" not in text, text
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
        node1_log.close()


def test_a_headless_node_whose_ranks_cannot_start_gives_up_with_code_3():
    result = subprocess.run([sys.executable, "-m", "tidal", "serve", "--model", "/no/such/model",
                             "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
                             "--master-port", str(free_rendezvous_ports())], capture_output=True, text=True, timeout=120)
    assert result.returncode == 3
    assert "cannot start: FileNotFoundError: no model directory '/no/such/model'" in result.stderr
    assert "ranks [1] failed and --engine-restarts 0 is used up; giving up" in result.stderr and "Traceback" not in result.stderr


# ---------------------------------------------------------------------- sizes that do not split


def test_a_size_that_does_not_split_the_model_is_one_line_and_exit_code_3(hf_model_dir):
    result = subprocess.run([sys.executable, "-m", "tidal", "serve", "--model", hf_model_dir("llama"),
                             "--tensor-parallel-size", "3", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 3
    assert "--tensor-parallel-size 3 does not divide the model's 4 attention heads" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.count("does not divide") == 1, result.stderr
