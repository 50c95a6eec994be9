"""SGLang's weight-update endpoints on `troupe serve`: from disk and from a trainer over the
update group, weight_version in /v1/models and every response, refusals as 400s."""

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from troupe import WeightSender, describe
from conftest import fixture, read_safetensors, reference


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(port: int, path: str, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.fixture
def server(other_model):
    path, _ = other_model("llama-gqa")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "troupe", "serve", "--model", path,
                             "--port", str(port), "--enable-admin-api",
                             "--kv-cache-memory", str(2 << 20), "--tensor-parallel-size", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if call(port, "/health")[0] == 200:
                break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("troupe serve did not come up")
    yield port, path
    proc.terminate()
    proc.wait(timeout=30)


def greedy_tokens(port: int, ref: dict) -> list:
    out = []
    for p in ref["prompts"]:
        status, body = call(port, "/v1/completions", {
            "prompt": p["token_ids"], "max_tokens": 32, "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        out.append(body)
    return out


def tokens_of(replies: list) -> list:
    return [r["choices"][0]["token_ids"] for r in replies]


def test_updates_through_the_server(server):
    port, path = server
    ref = reference("llama-gqa")
    status, models = call(port, "/v1/models")
    assert status == 200 and models["data"][0]["weight_version"] == 0
    before = greedy_tokens(port, ref)
    assert all(r["weight_version"] == 0 for r in before)
    status, body = call(port, "/update_weights_from_disk", {"model_path": fixture("qwen2-bias")})
    assert status == 400 and "differs" in body["error"]["message"]
    status, body = call(port, "/update_weights_from_disk", {"model_path": fixture("llama-gqa")})
    assert status == 200 and body["success"] and body["weight_version"] == 1
    after = greedy_tokens(port, ref)
    assert all(r["weight_version"] == 1 for r in after)
    assert tokens_of(after) == [p["greedy"] for p in ref["prompts"]]
    assert tokens_of(before) != tokens_of(after)
    assert call(port, "/v1/models")[1]["data"][0]["weight_version"] == 1
    assert call(port, "/flush_cache", {})[0] == 200
    status, body = call(port, "/update_weights_from_tensor", {"serialized_named_tensors": []})
    assert status == 400 and "WeightSender" in body["error"]["message"]

    # From this process as the trainer, over the group (the server's two ranks join it).
    group_port = free_port()
    joined = {}
    t = threading.Thread(target=lambda: joined.update(r=call(port, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": group_port, "rank_offset": 1,
        "world_size": 3, "group_name": "g", "backend": "gloo"})))
    t.start()
    sender = WeightSender("127.0.0.1", group_port, 3)
    t.join()
    assert joined["r"][0] == 200, joined
    weights = read_safetensors(path + "/model.safetensors")  # back to the other model
    names, dtypes, shapes = describe(weights)
    result = {}
    t = threading.Thread(target=lambda: result.update(r=call(port, "/update_weights_from_distributed", {
        "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": "g"})))
    t.start()
    sender.send(weights)
    t.join()
    assert result["r"][0] == 200 and result["r"][1]["weight_version"] == 2, result
    again = greedy_tokens(port, ref)
    assert tokens_of(again) == tokens_of(before)
    status, body = call(port, "/update_weights_from_distributed",
                        {"names": ["x"], "dtypes": ["float32"], "shapes": "no"})
    assert status == 400
