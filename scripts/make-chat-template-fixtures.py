"""Chat-template fixtures: the real templates of the families troupe runs (from the
llama.cpp tree in the llama-cpp-python sdist, models/templates, which copies them from each
model's tokenizer_config.json, and its tests/test-chat-template.cpp for Mistral's v3 template
(Mistral-7B-Instruct-v0.3, Mistral-Large-2407) and Phi-4's; Gemma 3's and SmolLM2's from
their tokenizer_config.json and GGUF file), rendered by transformers' own renderer for
several conversations, into tests/fixtures/chat-templates/renderings.json.

    python scripts/make-chat-template-fixtures.py LLAMA_CPP_TEMPLATES_DIR [SMOLLM2_GGUF]

Needs transformers (and jinja2, gguf). With SmolLM2's GGUF file, its renderings also carry
the token ids apply_chat_template gives with SmolLM2's tokenizer. A conversation a template refuses is recorded with the
message of its raise_exception."""
import json
import os
import re
import shutil
import sys

import jinja2
from transformers.utils.chat_template_utils import render_jinja_template

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "fixtures", "chat-templates")

# name: (file in llama.cpp's models/templates, bos_token, eos_token)
TEMPLATES = {
    "llama-3.1": ("meta-llama-Llama-3.1-8B-Instruct", "<|begin_of_text|>", "<|eot_id|>"),
    "llama-3.2": ("meta-llama-Llama-3.2-3B-Instruct", "<|begin_of_text|>", "<|eot_id|>"),
    "mistral-nemo": ("mistralai-Mistral-Nemo-Instruct-2407", "<s>", "</s>"),
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct", None, "<|im_end|>"),
    "qwen3": ("Qwen-Qwen3-0.6B", None, "<|im_end|>"),
    "gemma-2": ("google-gemma-2-2b-it", "<bos>", "<eos>"),
    "phi-3.5": ("microsoft-Phi-3.5-mini-instruct", "<s>", "<|endoftext|>"),
    "deepseek-r1-distill": ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
                            "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "smollm3": ("HuggingFaceTB-SmolLM3-3B", None, "<|im_end|>"),
}

# name: (the test's name in llama.cpp's tests/test-chat-template.cpp, bos_token, eos_token)
TEST_TEMPLATES = {
    "mistral-v3": ("Mistral-Large-Instruct-2407 (mistralai 'v3' template; modified to have "
                   "system prompt at start)", "<s>", "</s>"),
    "phi-4": ("phi-4", None, "<|im_end|>"),
}


def test_template(templates_dir, name):
    """The template string of llama.cpp's chat-template test `name` (a C string literal)."""
    path = os.path.join(templates_dir, "..", "..", "tests", "test-chat-template.cpp")
    with open(path, encoding="utf-8") as f:
        source = f.read()
    marker = '/* .name= */ "' + name + '",'
    at = source.index(marker)
    start = source.index('/* .template_str= */ ', at) + len('/* .template_str= */ ')
    literal = re.match(r'(?:U8C\()?"((?:[^"\\]|\\.)*)"', source[start:]).group(1)
    return literal.encode("utf-8").decode("unicode_escape")


# Gemma 3's template (google/gemma-3-4b-it, tokenizer_config.json).
GEMMA3 = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n")

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city, now.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city's name, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city"],
        },
    },
}

CONVERSATIONS = {
    "single": [{"role": "user", "content": "What is the capital of France?"}],
    "system": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "  Name three primes.  "},
    ],
    "multi-turn": [
        {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "Tell me a joke\nabout cats."},
    ],
    "non-ascii": [
        {"role": "user", "content": "Grüß dich! Wie geht's? 你好，世界 😀"},
        {"role": "assistant", "content": "Très bien, merci — et toi ? ✓"},
        {"role": "user", "content": "«Ещё раз», s'il te plaît: \"quoted\" \\ back\\slash"},
    ],
    "thinking-history": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<think>\nTwo and two.\n</think>\n\n4"},
        {"role": "user", "content": "And 3+3?"},
    ],
    "tools": [
        {"role": "system", "content": "You can look things up."},
        {"role": "user", "content": "Weather in Zürich?"},
    ],
    "tool-call": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "a1b2c3d4e", "type": "function",
                         "function": {"name": "get_weather",
                                      "arguments": {"city": "Paris", "unit": "celsius"}}}]},
        {"role": "tool", "tool_call_id": "a1b2c3d4e", "name": "get_weather",
         "content": "{\"temperature\": 21.5, \"sky\": \"clear\"}"},
    ],
    "not-alternating": [
        {"role": "user", "content": "One."},
        {"role": "user", "content": "Two."},
    ],
}

# Extra variables: a fixed date for Llama 3.x (else today's), Qwen3's thinking switch.
CASES = [(name, {}) for name in CONVERSATIONS]
CASES.append(("single", {"enable_thinking": False}))
TOOL_CASES = {"tools", "tool-call"}


def main():
    templates_dir = sys.argv[1]
    os.makedirs(OUT, exist_ok=True)
    sources = {}
    for name, (file, bos, eos) in TEMPLATES.items():
        with open(os.path.join(templates_dir, file + ".jinja"), encoding="utf-8") as f:
            sources[name] = (f.read(), bos, eos)
    sources["gemma-3"] = (GEMMA3, "<bos>", "<eos>")
    for name, (test, bos, eos) in TEST_TEMPLATES.items():
        sources[name] = (test_template(templates_dir, test), bos, eos)
    smollm2 = None
    if len(sys.argv) > 2:
        import gguf
        from transformers import AutoTokenizer
        reader = gguf.GGUFReader(sys.argv[2])
        field = reader.fields["tokenizer.chat_template"]
        text = bytes(field.parts[field.data[0]]).decode("utf-8")
        sources["smollm2"] = (text, "<|im_start|>", "<|im_end|>")
        smollm2 = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(sys.argv[2])),
                                                gguf_file=os.path.basename(sys.argv[2]))
        # transformers' GGUF reader gives "smollm" files GPT-2's pre-tokenizer alone, which
        # joins a digit to the whitespace before it ("\n\n4"); SmolLM2's own tokenizer.json
        # splits digits first (llama.cpp's "smollm" pre-tokenizer, chosen by the hash of that
        # tokenizer's output, does the same; llama-tokenize agrees).
        from tokenizers import pre_tokenizers
        smollm2.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    cases = []
    for name, (text, bos, eos) in sorted(sources.items()):
        with open(os.path.join(OUT, name + ".jinja"), "w", encoding="utf-8") as f:
            f.write(text)
        for conversation, extra in CASES:
            kwargs = dict(extra)
            kwargs["date_string"] = "26 Jul 2024"
            tools = [WEATHER_TOOL] if conversation in TOOL_CASES else None
            case = {"template": name, "conversation": conversation, "variables": kwargs,
                    "bos_token": bos, "eos_token": eos, "tools": tools}
            try:
                rendered, _ = render_jinja_template(
                    [CONVERSATIONS[conversation]], tools=tools, chat_template=text,
                    add_generation_prompt=True, bos_token=bos, eos_token=eos, **kwargs)
                case["rendered"] = rendered[0]
                if name == "smollm2" and smollm2 is not None:
                    # The ids apply_chat_template gives with SmolLM2's own tokenizer.
                    case["token_ids"] = smollm2.apply_chat_template(
                        CONVERSATIONS[conversation], tools=tools, tokenize=True,
                        add_generation_prompt=True, return_dict=False, **kwargs)
            except jinja2.exceptions.TemplateError as e:
                case["error"] = str(e)
            cases.append(case)
    with open(os.path.join(OUT, "renderings.json"), "w", encoding="utf-8") as f:
        json.dump({"conversations": CONVERSATIONS, "cases": cases}, f, ensure_ascii=False,
                  indent=1)
    print(f"{len(cases)} renderings of {len(sources)} templates")


if __name__ == "__main__":
    main()
