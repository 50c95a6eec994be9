"""troupe serve through the official openai client: greedy completions equal transformers'
tokens (streamed or not), chat of a model without a template fails cleanly, a wrong key or
model raises the client's own errors, /metrics parses with prometheus_client and agrees
with the requests sent, and a chat with a model of each family, through its own template,
gives transformers' greedy tokens. Arguments: the troupe binary, the source tree."""

import json
import os
import subprocess
import sys
import time
import urllib.request

import openai
from prometheus_client.parser import text_string_to_metric_families

troupe, source = sys.argv[1], sys.argv[2]
fixture = os.path.join(source, "tests", "fixtures", "llama-gqa")
key = "a key long enough for the test"


def serve(model):
    """`troupe serve` of `model` as "tiny" on a free port: the process and its base URL."""
    server = subprocess.Popen(
        [troupe, "serve", "--model", model, "--kv-cache-memory", "4000000", "--port", "0",
         "--served-model-name", "tiny", "--api-key", key],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in server.stdout:
        if "on http://127.0.0.1:" in line:
            return server, f"http://127.0.0.1:{int(line.rsplit(':', 1)[1])}"
    server.kill()
    raise AssertionError(f"the server of {model} did not start")


def stop(server):
    server.terminate()
    assert server.wait(timeout=60) == 0, "the server did not drain and exit 0"


server, base = serve(fixture)
try:
    client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)

    assert [m.id for m in client.models.list().data] == ["tiny"]
    ref = json.load(open(os.path.join(fixture, "reference.json")))
    sent = tokens = 0
    for p in ref["prompts"]:
        want = p["greedy"]
        c = client.completions.create(model="tiny", prompt=p["token_ids"], max_tokens=len(want),
                                      temperature=0, extra_body={"ignore_eos": True})
        sent += 1
        tokens += len(want)
        assert c.choices[0].model_extra["token_ids"] == want, (c.choices[0], want)
        assert c.choices[0].finish_reason == "length"
        assert c.usage.completion_tokens == len(want)
        ids, usage = [], None
        for chunk in client.completions.create(model="tiny", prompt=p["token_ids"],
                                               max_tokens=len(want), temperature=0, stream=True,
                                               stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True}):
            if chunk.choices:
                ids += chunk.choices[0].model_extra["token_ids"]
            if chunk.usage:
                usage = chunk.usage
        sent += 1
        tokens += len(want)
        assert ids == want, (ids, want)
        assert usage.completion_tokens == len(want)

    # n choices, each with its index; seeded, so choice i is the request seeded seed + i.
    p = ref["prompts"][0]["token_ids"]
    c = client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=1.5, seed=3,
                                  n=3, extra_body={"ignore_eos": True})
    assert [x.index for x in c.choices] == [0, 1, 2], c
    assert c.usage.completion_tokens == 24, c.usage
    for i, x in enumerate(c.choices):
        one = client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=1.5,
                                        seed=3 + i, extra_body={"ignore_eos": True})
        assert x.model_extra["token_ids"] == one.choices[0].model_extra["token_ids"], (x, one)
    sent += 4
    tokens += 48
    try:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        raise AssertionError("a chat of a model without a chat template succeeded")
    except openai.BadRequestError as e:
        assert "chat template" in str(e), e
    try:
        client.completions.create(model="another", prompt=[1, 2])
        raise AssertionError("an unknown model was served")
    except openai.NotFoundError:
        pass
    try:
        openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).completions.create(
            model="tiny", prompt=[1, 2])
        raise AssertionError("a wrong key was let in")
    except openai.AuthenticationError:
        pass

    text = urllib.request.urlopen(base + "/metrics").read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    def value(family, sample, **labels):
        return sum(s.value for s in families[family].samples
                   if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))
    assert value("vllm:request_success", "vllm:request_success_total",
                 finished_reason="length") == sent, text
    assert value("vllm:generation_tokens", "vllm:generation_tokens_total") == tokens, text
    assert value("vllm:time_to_first_token_seconds",
                 "vllm:time_to_first_token_seconds_count") == sent, text
    assert value("vllm:num_requests_running", "vllm:num_requests_running") == 0
    print(f"openai client: {sent} completions with transformers' tokens; metrics agree")
finally:
    stop(server)

# Each family's model through its own chat template (scripts/make-chat-family-fixtures.py):
# the prompt transformers' apply_chat_template renders, and its greedy tokens, streamed or
# not.
chats = os.path.join(source, "tests", "fixtures", "chat-families")
with open(os.path.join(chats, "families.json")) as f:
    chat_families = json.load(f)
for family, ref in chat_families.items():
    server, base = serve(os.path.join(chats, family))
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
        want = ref["greedy"]
        c = client.chat.completions.create(model="tiny", messages=ref["messages"],
                                           max_tokens=len(want), temperature=0,
                                           extra_body={"ignore_eos": True})
        assert c.choices[0].model_extra["token_ids"] == want, (family, c.choices[0], want)
        assert c.usage.prompt_tokens == len(ref["prompt_token_ids"]), (family, c.usage)
        assert c.choices[0].finish_reason == "length", (family, c.choices[0])
        ids = []
        for chunk in client.chat.completions.create(model="tiny", messages=ref["messages"],
                                                    max_tokens=len(want), temperature=0,
                                                    stream=True,
                                                    extra_body={"ignore_eos": True}):
            if chunk.choices:
                ids += chunk.choices[0].model_extra.get("token_ids") or []
        assert ids == want, (family, ids, want)
    finally:
        stop(server)
print(f"openai client: chat of {len(chat_families)} families' templates and models gives "
      "transformers' greedy tokens")
