"""Structured outputs with SmolLM2's tokenizer: 30+ JSON schemas, regexes, a Lark grammar, and greedy
guided == greedy unguided when the free output already conforms.

The 32 schemas x n=4 at temperature 1.0 run twice: on the embedded SmolLM2 itself (slow-marked, one
batch of 128 sequences, ~12 s on 2 quiet cores), and on a random-weight model that has SmolLM2's tokenizer
(49,152 tokens, the embedded model's GGUF vocabulary and merges): the grammar sees exactly the token set
it sees when serving the embedded model, and the random model picks among the allowed tokens almost
uniformly, so it walks far more of each grammar than a trained model, which keeps to the likely paths.
The embedded model also runs the regexes, the grammar and the greedy equality tests.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest

from engine_helpers import drain

from model_factory import random_model
from pagedserve.models.loading.loader import LoadedModel
from pagedserve.runtime.config import EngineConfig
from pagedserve.runtime.engine.llm_engine import LLMEngine
from pagedserve.runtime.sampling_params import SamplingParams
from pagedserve.runtime.structured_outputs_params import StructuredOutputsParams as SO
from structured_schemas import SCHEMAS, validate


run_all = drain  # bounded; integrity after every step; no block held at the end


def check_json(name, text):
    validate(json.loads(text), SCHEMAS[name])


@pytest.fixture(scope="module")
def random_smollm2(smollm2_loaded):
    tok = smollm2_loaded.tokenizer
    cfg, weights = random_model(seed=3, layers=1, vocab=smollm2_loaded.config.vocab_size)
    cfg = dataclasses.replace(cfg, eos_token_ids=tok.eos_token_ids, bos_token_id=tok.bos_token_id)
    return LoadedModel(config=cfg, weights=weights, tokenizer=tok, path=Path("random-smollm2"),
                       name="random-smollm2", load_seconds=0.0, from_cache=False)


def test_32_schemas_n4_temperature_1(random_smollm2):
    assert len(SCHEMAS) >= 30
    engine = LLMEngine(EngineConfig(device="cpu", num_kv_blocks=1024, seed=0), loaded=random_smollm2)
    tok = random_smollm2.tokenizer
    for i, name in enumerate(SCHEMAS):
        engine.add_request(name, tok.encode(f"A {name} as JSON:"),
                           SamplingParams(n=4, temperature=1.0, seed=i, max_tokens=200,
                                          structured_outputs=SO(json=SCHEMAS[name])))
    out = run_all(engine)
    for name in SCHEMAS:
        assert len(out[name].outputs) == 4
        for c in out[name].outputs:
            assert c.finish_reason == "stop", (name, c.text)
            check_json(name, c.text)


@pytest.mark.slow
def test_32_schemas_n4_temperature_1_on_the_embedded_model(smollm2_loaded):
    """Every schema, 4 samples each at temperature 1.0, as one batch (all 128 sequences in flight together).
    max_tokens is generous (the longest output is ~80 tokens) but bounded: an output cut by it fails here."""
    assert len(SCHEMAS) >= 30
    engine = LLMEngine(EngineConfig(device="cpu", seed=0, kv_cache_memory_bytes=512 << 20), loaded=smollm2_loaded)
    tok = smollm2_loaded.tokenizer
    for i, name in enumerate(SCHEMAS):
        prompt = tok.apply_chat_template([{"role": "user", "content": f"Write a {name.replace('_', ' ')} as JSON."}],
                                         tokenize=True)
        engine.add_request(name, prompt, SamplingParams(n=4, temperature=1.0, seed=i, max_tokens=160,
                                                        structured_outputs=SO(json=SCHEMAS[name])))
    running = []
    finished = drain(engine, max_steps=2_000, integrity=False,
                     on_step=lambda e, _: running.append(len(e.scheduler.running)))
    peak = max(running)
    assert engine.kv_manager.usage().num_used_blocks == 0
    assert peak == 4 * len(SCHEMAS)  # batched: every sample decoding in the same steps
    cut = [(name, c.text) for name in SCHEMAS for c in finished[name].outputs if c.finish_reason != "stop"]
    assert not cut, f"{len(cut)} outputs did not complete their schema within max_tokens: {cut}"
    for name in SCHEMAS:
        assert len(finished[name].outputs) == 4
        for c in finished[name].outputs:
            check_json(name, c.text)


REGEXES = {
    "iso_date": r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "email": r"[a-z][a-z0-9._]{0,15}@[a-z]{2,12}\.(com|org|net|fr)",
    "ipv4": r"((25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])",
    "phone": r"\+1 \([2-9][0-9]{2}\) [0-9]{3}-[0-9]{4}",
}
REGEX_PROMPTS = {"iso_date": "The meeting is on", "email": "Write to me at", "ipv4": "The server's IP address is",
                 "phone": "Call us at"}
ARITHMETIC = r"""
start: expr
expr: term (("+" | "-") term){0,3}
term: factor (("*" | "/") factor){0,2}
factor: NUMBER | "(" expr ")"
NUMBER: /0|[1-9][0-9]{0,2}/
"""
FEW_SHOT = ('Convert to JSON.\nInput: Bob is 42\nOutput:\n{"name": "Bob", "age": 42}\n'
            'Input: Carol is 7\nOutput:\n{"name": "Carol", "age": 7}\nInput: {who} is {age}\nOutput:\n')
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
PEOPLE = [("Alice", 31), ("Dan", 58), ("Eve", 23)]


@pytest.fixture(scope="module")
def embedded(smollm2_loaded):
    """Every embedded-model request of the tests below, run as one batch by one engine (the engine is
    batch invariant, so each output is what it would be alone), once for the module."""
    engine = LLMEngine(EngineConfig(device="cpu", seed=0, kv_cache_memory_bytes=256 << 20), loaded=smollm2_loaded)
    tok = smollm2_loaded.tokenizer
    for i, (name, regex) in enumerate(REGEXES.items()):
        engine.add_request(name, tok.encode(REGEX_PROMPTS[name]), SamplingParams(
            n=2, temperature=1.0, seed=i, max_tokens=40, structured_outputs=SO(regex=regex)))
    engine.add_request("choice", tok.encode("Is water wet? Answer:"), SamplingParams(
        n=3, temperature=1.0, seed=7, max_tokens=8, structured_outputs=SO(choice=["yes", "no", "maybe"])))
    engine.add_request("lark", tok.encode("Compute:"), SamplingParams(
        n=3, temperature=1.0, seed=8, max_tokens=60, structured_outputs=SO(grammar=ARITHMETIC)))
    for who, age in PEOPLE:
        prompt = tok.encode(FEW_SHOT.replace("{who}", who).replace("{age}", str(age)))
        engine.add_request(f"free-{who}", prompt, SamplingParams.greedy(max_tokens=24))
        engine.add_request(f"json-{who}", prompt,
                           SamplingParams.greedy(max_tokens=24, structured_outputs=SO(json=PERSON)))
    return run_all(engine)


@pytest.mark.slow
def test_regexes_choice_and_grammar_on_the_embedded_model(embedded):
    for name, regex in REGEXES.items():
        for c in embedded[name].outputs:
            assert re.fullmatch(regex, c.text) and c.finish_reason == "stop", (name, c.text)
    assert all(c.text in ("yes", "no", "maybe") for c in embedded["choice"].outputs)
    for c in embedded["lark"].outputs:
        # Python's own parser as the independent check: numbers, + - * / and parentheses only.
        tree = ast.parse(c.text, mode="eval")
        ok = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)
        assert all(isinstance(n, ok) for n in ast.walk(tree)), c.text
        assert c.finish_reason == "stop"


@pytest.mark.slow
def test_greedy_guided_equals_greedy_unguided_when_it_conforms(embedded):
    """The mask never removes the argmax when the free output is in the language: guided greedy yields the
    free greedy tokens up to where the grammar is complete, then stops."""
    for who, _ in PEOPLE:
        free, guided = embedded[f"free-{who}"].outputs[0], embedded[f"json-{who}"].outputs[0]
        end = free.text.index("}") + 1  # the free output conforms up to its first closing brace
        json.loads(free.text[:end])
        assert guided.finish_reason == "stop" and guided.text == free.text[:end]
        assert guided.token_ids == free.token_ids[: len(guided.token_ids)]
