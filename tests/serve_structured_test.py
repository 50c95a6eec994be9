"""Structured output through troupe serve and the official openai client, on SmolLM2: 200
chat completions, 32 at a time, under JSON schemas (nested objects, arrays, enums, numbers,
strings with escapes; response_format and vLLM's guided_json): every answer parses and
validates with the jsonschema package; JSON-object mode and a choice. Arguments: the troupe
binary, the source tree. Exits 77 (skipped) without SmolLM2 in the model cache."""

import concurrent.futures
import json
import os
import subprocess
import sys

import jsonschema
import openai

troupe = sys.argv[1]
cache = os.environ.get("TROUPE_MODEL_CACHE",
                       os.path.join(os.path.expanduser("~"), ".cache", "troupe", "models"))
model = os.path.join(cache, "SmolLM2-135M-Instruct.Q4_1.gguf")
if not os.path.exists(model):
    print(f"skipped: {model} is not in the model cache (scripts/fetch-smollm2.sh fetches it)")
    sys.exit(77)

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer"},
            "email": {"type": "string", "maxLength": 60},
            "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30},
                        "maxItems": 4},
        },
        "required": ["name", "age", "hobbies"],
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "status": {"enum": ["pending", "shipped", "delivered"]},
            "total": {"type": "number"},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 20},
                        "quantity": {"type": "integer"},
                        "price": {"type": "number"},
                    },
                    "required": ["sku", "quantity", "price"],
                },
            },
            "address": {
                "type": "object",
                "properties": {
                    "street": {"type": "string", "maxLength": 50},
                    "city": {"type": "string", "maxLength": 30},
                    "zip": {"type": ["string", "null"], "maxLength": 10},
                },
                "required": ["city"],
            },
        },
        "required": ["id", "status", "items"],
    },
    "quote": {
        "type": "object",
        "properties": {
            "text": {"type": "string", "maxLength": 80},
            "author": {"type": "string", "maxLength": 40},
            "path": {"type": "string", "maxLength": 40},
            "tags": {"type": "array", "items": {"enum": ["wisdom", "humor", "code"]},
                     "maxItems": 3},
        },
        "required": ["text", "author", "path"],
    },
    "point": {
        "$defs": {"coordinate": {"type": "number"}},
        "type": "object",
        "properties": {
            "x": {"$ref": "#/$defs/coordinate"},
            "y": {"$ref": "#/$defs/coordinate"},
            "label": {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]},
            "visible": {"type": "boolean"},
        },
        "required": ["x", "y", "visible"],
    },
}
PROMPTS = {
    "person": "Describe a fictional person as JSON: name, age, email and hobbies.",
    "order": "Write an online shop order as JSON with a status, items and an address.",
    "quote": ('Give a famous quote as JSON. It contains "double quotes", a backslash \\ '
              "and a Windows path like C:\\Users\\me."),
    "point": "Give a point on a map as JSON with x, y, a label and whether it is visible.",
}

server = subprocess.Popen(
    [troupe, "serve", "--model", model, "--port", "0", "--kv-cache-memory", "200000000",
     "--max-num-seqs", "32", "--served-model-name", "smollm2", "--cpu-precision", "fast"],
    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
try:
    base = None
    for line in server.stdout:
        if "on http://127.0.0.1:" in line:
            base = f"http://127.0.0.1:{int(line.rsplit(':', 1)[1])}"
            break
    assert base, "the server did not start"
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)

    def ask(i):
        names = list(SCHEMAS)
        name = names[i % len(names)]
        schema = SCHEMAS[name]
        messages = [{"role": "user", "content": PROMPTS[name]}]
        common = dict(model="smollm2", messages=messages, max_tokens=1500, temperature=0.6,
                      seed=i)
        if i % 5 == 4:  # vLLM's own field
            c = client.chat.completions.create(extra_body={"guided_json": schema}, **common)
        else:
            c = client.chat.completions.create(
                response_format={"type": "json_schema",
                                 "json_schema": {"name": name, "schema": schema}},
                **common)
        text = c.choices[0].message.content
        assert c.choices[0].finish_reason == "stop", (i, c.choices[0].finish_reason, text)
        try:
            value = json.loads(text)
        except ValueError:
            print("not JSON:", repr(text))
            raise
        jsonschema.validate(value, schema)
        return name, text

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(ask, range(200)))
    escaped = sum(1 for name, text in answers if name == "quote" and "\\" in text)
    # JSON mode: an object; nothing bounds its size (SmolLM2 may nest without end), so
    # only an answer that ended must parse.
    mode = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "A JSON object, please."}],
        max_tokens=60, temperature=0, response_format={"type": "json_object"})
    text = mode.choices[0].message.content
    assert text.lstrip().startswith("{"), text
    if mode.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict), text
    choice = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Is the sky blue?"}],
        max_tokens=10, temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].message.content in ("yes", "no"), choice
    try:
        client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "string",
                                                                      "pattern": "a+"}}})
        raise AssertionError("a schema with a pattern was taken")
    except openai.BadRequestError as e:
        assert "pattern" in str(e), e
    print(f"structured output: {len(answers)} answers parse and validate "
          f"({escaped} quotes with escapes), a choice, a refused keyword")
finally:
    server.terminate()
    assert server.wait(timeout=60) == 0, "the server did not drain and exit 0"
