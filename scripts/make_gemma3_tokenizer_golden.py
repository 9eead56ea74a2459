"""Golden token ids of the packaged Gemma 3 270M's tokenizer, from transformers' own GGUF tokenizer.

Writes tests/data/goldens/gemma3-270m_tokenizer.json ({"model", "transformers_version", "gguf_sha256", "cases":
[{"text", "ids", "ids_no_special", "decoded"}], "chat_template", "chat": [{"messages", "add_generation_prompt",
"text", "ids"}]}), the format scripts/make_goldens.py uses for SmolLM2, which tests/models/test_gguf_sentencepiece.py
compares pagedserve's tokenizer against.

The packaged file is the base model: its GGUF carries no tokenizer.chat_template. The chat cases render Gemma 3's
instruction-tuned template (as google/gemma-3-*-it ship it in tokenizer_config.json) with this tokenizer, so
that the project's chat_template module is checked against transformers on Gemma's template too.

Run with the oracle venv (transformers), from the repository root, on the joined file (pagedserve joins it into
`<cache dir>/packaged/<sha256>/gemma-3-270m-q4_k_m.gguf` on first use of `--model gemma3-270m`):

    /work/oracle-venv/bin/python scripts/make_gemma3_tokenizer_golden.py --gguf PATH_TO_JOINED.gguf
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import transformers
from transformers import AutoTokenizer

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "goldens" / "gemma3-270m_tokenizer.json"

# ASCII, accents (composed and decomposed), CJK, emoji (with a skin-tone modifier and a ZWJ sequence), code with
# spaces, tabs and newlines, digits, runs of spaces and newlines, control tokens written inline, bytes only the
# byte fallback spells.
CASES = [
    "Hello world",
    "The capital of France is Paris.",
    " leading space, and  two   three    four spaces",
    "trailing spaces   ",
    "café, naïve, façade, Ångström, Straße, déjà vu",
    "cafe\u0301 (a combining accent)",
    "日本語のテキストを分割します。中文也可以。한국어도.",
    "Emoji: 🙂👍🏽 👨\u200d👩\u200d👧 🇫🇷",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "\tindented\twith\ttabs\n\n\n\nfour newlines",
    "digits 0123456789, 3.14159, 1,000,000 and -42",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<bos>an inline bos and an <eos>",
    "rare bytes: \x00\x01\x7f \u0378 \U0001fae8 \ufffd",
    "mixed: naïve 日本 🙂 x=1\n",
    "",
]


# Gemma 3's chat template, as google/gemma-3-*-it ship it in tokenizer_config.json.
CHAT_TEMPLATE = (
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
    "{%- endif -%}\n"
)

CHAT_CASES = [
    ([{"role": "user", "content": "What is the capital of France?"}], True),
    ([{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "  Best colour?  "}], True),
    ([{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello. 日本語 🙂"},
      {"role": "user", "content": "def f():\n    pass"}], False),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, required=True, help="the joined gemma-3-270m-q4_k_m.gguf")
    args = parser.parse_args()
    path = args.gguf.resolve()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    cases = []
    for text in CASES:
        ids = tok(text, add_special_tokens=True)["input_ids"]
        cases.append({"text": text, "ids": ids, "ids_no_special": tok(text, add_special_tokens=False)["input_ids"],
                      "decoded": tok.decode(ids, skip_special_tokens=False)})
    tok.chat_template = CHAT_TEMPLATE
    chat = []
    for messages, add_gen in CHAT_CASES:
        text = tok.apply_chat_template(messages, add_generation_prompt=add_gen, tokenize=False)
        ids = tok.apply_chat_template(messages, add_generation_prompt=add_gen, tokenize=True, return_dict=False)
        chat.append({"messages": messages, "add_generation_prompt": add_gen, "text": text, "ids": list(ids)})
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    golden = {"model": "gemma3-270m", "transformers_version": transformers.__version__, "gguf_sha256": digest,
              "tokenizer_class": type(tok).__name__, "cases": cases, "chat_template": CHAT_TEMPLATE, "chat": chat}
    OUT.write_text(json.dumps(golden, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({len(cases)} cases, transformers {transformers.__version__})")


if __name__ == "__main__":
    main()
