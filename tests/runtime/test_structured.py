"""Structured outputs in the engine: every constrained output validates (the `jsonschema`
package is the oracle), constrained greedy tokens do not depend on the batch, the cache,
the chunking, preemption or speculation; logit_bias; n > 1 samples forked from one
prefill. fp32 tiny Llama (a random model: it writes nonsense, but only what the grammar
allows), CPU."""

import json
import re
import sys
from pathlib import Path

import jsonschema
import pytest
import torch

from qserve.runtime.engine import EngineConfig
from qserve.runtime.llm import LLM
from qserve.runtime.loaded_model import load
from qserve.runtime.sampling_params import SamplingParams
from qserve.runtime.spec.proposer import make_config
from qserve.runtime.structured import GrammarError, GrammarSpec
from qserve.runtime.structured.compiler import GrammarCompiler
from qserve.runtime.structured.grammar_state import GrammarState

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_llama  # noqa: E402

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"]}
NESTED = {"type": "object", "properties": {
    "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                         "note": {"anyOf": [{"type": "string", "maxLength": 4},
                                                            {"type": "null"}]}},
        "required": ["id", "note"]}}}, "required": ["items"]}


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    torch.set_num_threads(1)
    return load(str(write_tiny_llama(tmp_path_factory.mktemp("structured") / "tiny")),
                torch.float32)


def _cfg(**kw):
    base = dict(num_kv_blocks=64, max_num_batched_tokens=64, kv_dtype="bf16",
                decode_impl="eager")
    base.update(kw)
    return EngineConfig(**base)


def _prompts(n, seed=0, lo=3, hi=40):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 300, (int(torch.randint(lo, hi, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def _json(schema, **kw):
    return SamplingParams(max_tokens=kw.pop("max_tokens", 96), temperature=kw.pop("temperature", 0),
                          structured=GrammarSpec.json_schema(schema), **kw)


# ------------------------------------------------------------------------------- specs
@pytest.mark.parametrize("schema, words", [
    ({"type": "array", "uniqueItems": True}, ["uniqueItems", "#"]),
    ({"type": "object", "properties": {"a": {"not": {"type": "null"}}}}, ["'not'", "#/properties/a"]),
    ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, ["allOf", "merge"]),
    ({"$ref": "https://example.com/s.json"}, ["local references"]),
    ({"type": "string", "format": "email", "maxLength": 20}, ["'maxLength'", "format"]),
    ({"type": "string", "pattern": "^a+$", "minLength": 2}, ["'minLength'", "pattern"]),
    ({"type": "object", "properties": {"a": {"type": "strin"}}}, ["invalid", "properties/a/type"]),
    ({"type": "integer", "minimum": "3"}, ["invalid", "minimum"]),
])
def test_schemas_the_engine_cannot_enforce_are_refused_naming_why(schema, words):
    with pytest.raises(GrammarError) as e:
        GrammarSpec.json_schema(schema)
    for w in words:
        assert w in str(e.value)


def test_spec_digest_ignores_formatting_but_keeps_property_order():
    a = GrammarSpec.json_schema('{"type": "object", "properties": {"x": {}, "y": {}}}')
    b = GrammarSpec.json_schema({"type": "object", "properties": {"x": {}, "y": {}}})
    c = GrammarSpec.json_schema({"type": "object", "properties": {"y": {}, "x": {}}})
    assert a == b and a.digest == b.digest
    assert c.digest != a.digest  # the output is written in the schema's property order


@pytest.mark.parametrize("spec, text", [
    (GrammarSpec.regex("[0-9]+("), "regex"),
    (GrammarSpec.grammar("root ::= \"a\" | "), "grammar"),
    (GrammarSpec.grammar("start: missing_rule"), "grammar"),
])
def test_bad_regex_and_grammars_are_grammar_errors(lm, spec, text):
    compiler = GrammarCompiler(LLM(lm, config=_cfg()).engine.tokenizer, 300)
    with pytest.raises(GrammarError, match=f"the {text} does not compile"):
        compiler.compile(spec)


def test_compile_cache_is_keyed_by_digest(lm):
    compiler = GrammarCompiler(LLM(lm, config=_cfg()).engine.tokenizer, 300)
    first = compiler.compile(GrammarSpec.json_schema(PERSON))
    again = compiler.compile(GrammarSpec.json_schema(json.dumps(PERSON, indent=2)))
    assert again is first and (compiler.misses, compiler.hits) == (1, 1)


def test_bounded_json_strings_exclude_raw_control_characters(lm):
    """A length-bounded string's characters are where the grammar engine let raw control
    characters through (invalid JSON); the compiled grammar refuses them, escapes and
    plain text still pass."""
    compiler = GrammarCompiler(LLM(lm, config=_cfg()).engine.tokenizer, 300)
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}},
              "required": ["s"]}
    compiled = compiler.compile(GrammarSpec.json_schema(schema))
    tok = compiler.tokenizer

    def allowed(text):
        state = GrammarState(compiled)
        return all(state.accept(t) for t in tok.encode(text, add_special_tokens=False))

    assert allowed('{"s": "ab')
    assert not allowed('{"s": "a\x1b')
    assert not allowed('{"s": "a\x00')


@pytest.mark.parametrize("fmt, good, bad", [
    ("date", ["2024-02-28", "1999-12-31"], ["2024-02-30", "2023-04-31", "2024-13-01"]),
    ("date-time", ["2024-01-05T10:00:00Z", "2024-01-05T10:00:00.25+02:00"],
     ["2024-02-30T10:00:00Z", "2024-01-05T10:00:00"]),
    ("time", ["23:59:59Z", "10:00:00.5-01:30"], ["10:00:005Z", "24:00:00Z"]),
    ("ipv4", ["10.0.0.1", "255.255.255.255"], ["10.0.01.1", "256.1.1.1"]),
])
def test_string_formats_admit_only_valid_values(lm, fmt, good, bad):
    compiler = GrammarCompiler(LLM(lm, config=_cfg()).engine.tokenizer, 300)
    compiled = compiler.compile(GrammarSpec.json_schema({"type": "string", "format": fmt}))

    def complete(value):
        state = GrammarState(compiled)
        ids = compiler.tokenizer.encode(json.dumps(value), add_special_tokens=False)
        return all(state.accept(t) for t in ids) and state.completed

    assert all(complete(v) for v in good)
    assert not any(complete(v) for v in bad)


# ------------------------------------------------------------------- constrained outputs
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_constrained_output_validates(lm, temperature):
    llm = LLM(lm, config=_cfg())
    prompts = _prompts(6)
    for schema in (PERSON, NESTED):
        outs = llm.generate(prompts, _json(schema, temperature=temperature, seed=5))
        for o in outs:
            assert o.finish_reason == "stop", o.text
            jsonschema.validate(json.loads(o.text), schema)


def test_regex_choice_grammar_and_json_object(lm):
    llm = LLM(lm, config=_cfg())
    p = _prompts(3, seed=1)
    cases = [(GrammarSpec.regex(r"[a-c]{2,4}-[0-9]{3}"), lambda t: re.fullmatch(r"[a-c]{2,4}-[0-9]{3}", t)),
             (GrammarSpec.choice(["yes", "no", "maybe"]), lambda t: t in ("yes", "no", "maybe")),
             (GrammarSpec.grammar('root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'),
              lambda t: re.fullmatch(r"\(\d+(\+\d+)*\)", t)),
             (GrammarSpec.grammar('start: "x" NUM\nNUM: /[0-9]{2}/'), lambda t: re.fullmatch(r"x\d\d", t))]
    for spec, check in cases:
        for o in llm.generate(p, SamplingParams(max_tokens=40, temperature=0.7, seed=2,
                                                structured=spec)):
            assert o.finish_reason == "stop" and check(o.text), (spec.kind, o.text)


def test_json_object_is_any_object(lm):
    llm = LLM(lm, config=_cfg())
    close = llm.engine.tokenizer.encode('"}', add_special_tokens=False)
    # a random model rarely closes what it opens: a bias towards '"' and '}' makes it
    bias = {t: 4.0 for t in close}
    for o in llm.generate(_prompts(3, seed=1), SamplingParams(
            max_tokens=60, temperature=0.7, seed=2, logit_bias=bias,
            structured=GrammarSpec.json_object())):
        assert o.finish_reason == "stop" and isinstance(json.loads(o.text), dict), o.text


def test_max_tokens_before_the_grammar_ends_is_length_and_marked_incomplete(lm):
    llm = LLM(lm, config=_cfg())
    params = _json(PERSON, max_tokens=4)
    outs = list(llm.stream(_prompts(1)[0], params))
    assert outs[-1].finish_reason == "length"
    engine_outs = []
    llm.engine.add_request("x", _prompts(1)[0], params)
    while llm.engine.has_unfinished:
        engine_outs += llm.engine.step()
    assert engine_outs[-1].finished and engine_outs[-1].grammar_incomplete
    llm.engine.add_request("y", _prompts(1)[0], _json(PERSON))
    while llm.engine.has_unfinished:
        engine_outs += llm.engine.step()
    assert engine_outs[-1].finish_reason == "stop" and not engine_outs[-1].grammar_incomplete


def test_constrained_greedy_is_batch_cache_chunk_and_preemption_invariant(lm):
    prompts = _prompts(6, seed=3, lo=20, hi=60)
    alone = [LLM(lm, config=_cfg()).generate([p], _json(PERSON))[0].token_ids for p in prompts]
    # in a batch with unconstrained neighbours, 4-token prompt chunks, a pool small enough
    # to preempt, and every prompt twice (the second time from the prefix cache)
    llm = LLM(lm, config=_cfg(num_kv_blocks=10, max_num_batched_tokens=4))
    plain = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    for _ in range(2):
        mixed = llm.generate(prompts + prompts[:3], [_json(PERSON)] * 6 + [plain] * 3)
        assert [o.token_ids for o in mixed[:6]] == alone
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.tokens_cached > 0


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_grammar_composes_with_speculative_decoding(lm, temperature):
    prompts = _prompts(4, seed=4)
    params = _json(PERSON, temperature=temperature, seed=11)
    plain = LLM(lm, config=_cfg()).generate(prompts, params)
    spec = make_config("ngram", 4, min_n=1)
    llm = LLM(lm, config=_cfg(speculative=spec))
    outs = llm.generate(prompts, params)
    for o in outs:
        jsonschema.validate(json.loads(o.text), PERSON)
    if temperature == 0:  # greedy: speculation changes nothing
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    counters = llm.engine.spec.counters
    assert counters.proposed > 0  # drafts were scored (and cut to the grammar)
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


# -------------------------------------------------------------------------- logit_bias
def test_logit_bias_forces_and_bans_tokens(lm):
    llm = LLM(lm, config=_cfg())
    p = _prompts(1, seed=6)[0]
    base = llm.generate([p], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    forced = llm.generate([p], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                              logit_bias={77: 100}))[0]
    assert forced.token_ids == [77] * 5
    banned = llm.generate([p], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                              logit_bias={base.token_ids[0]: -100}))[0]
    assert banned.token_ids[0] != base.token_ids[0]
    # the returned logprobs stay the raw model's (as without a bias)
    lp = llm.generate([p], SamplingParams(max_tokens=1, temperature=0, logprobs=0,
                                          logit_bias={77: 100}))[0].logprobs[0]
    raw = llm.generate([p], SamplingParams(max_tokens=1, temperature=0, logprobs=0))[0]
    assert lp.token_id == 77 and lp.logprob < raw.logprobs[0].logprob


def test_logit_bias_is_validated():
    with pytest.raises(ValueError, match="in \\[-100, 100\\]"):
        SamplingParams(logit_bias={5: 101})
    with pytest.raises(ValueError, match="token ids"):
        SamplingParams(logit_bias={-1: 1})


def test_logit_bias_outside_the_vocabulary_is_refused(lm):
    llm = LLM(lm, config=_cfg())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.engine.add_request("r", [5, 6], SamplingParams(logit_bias={300: 1}))


# ------------------------------------------------------------------------------ n > 1
@pytest.mark.parametrize("prompt_len", [16, 21])  # whole blocks, and a partly filled last one
def test_n_samples_fork_one_prefill_and_equal_seeded_singles(lm, prompt_len):
    p = _prompts(1, seed=7, lo=prompt_len, hi=prompt_len + 1)[0]
    llm = LLM(lm, config=_cfg(enable_prefix_caching=False))
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=40, n=4, ignore_eos=True)
    outs = llm.generate([p], params)
    assert llm.engine.num_forked == 3
    assert llm.engine.tokens_computed == prompt_len + 4 * 11  # one prefill, then decodes
    singles = [LLM(lm, config=_cfg()).generate([p], params.for_sample(i))[0].token_ids
               for i in range(4)]
    assert [o.token_ids for o in outs] == singles
    assert len({tuple(s) for s in singles}) > 1  # different seeds, different samples
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_n_samples_each_follow_their_grammar(lm):
    llm = LLM(lm, config=_cfg())
    outs = llm.generate(_prompts(2, seed=8), _json(NESTED, temperature=1.0, seed=3, n=3))
    assert len(outs) == 6 and llm.engine.num_forked == 4
    for o in outs:
        jsonschema.validate(json.loads(o.text), NESTED)


def test_a_sample_without_blocks_to_fork_runs_on_its_own(lm):
    p = _prompts(1, seed=9, lo=21, hi=22)[0]  # a partly filled last block to copy
    params = SamplingParams(max_tokens=3, temperature=0.5, seed=1, n=2, ignore_eos=True)
    llm = LLM(lm, config=_cfg(num_kv_blocks=2))  # the prompt's 2 blocks: none for a copy
    outs = llm.generate([p], params)
    assert llm.engine.num_forked == 0
    singles = [LLM(lm, config=_cfg()).generate([p], params.for_sample(i))[0].token_ids
               for i in range(2)]
    assert [o.token_ids for o in outs] == singles


def test_aborting_the_first_sample_lets_the_others_run(lm):
    llm = LLM(lm, config=_cfg())
    p = _prompts(1, seed=10)[0]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.engine.add_request("a", p, params)
    llm.engine.add_request("a-1", p, params, fork_of="a")
    llm.engine.abort_request("a")
    outs = []
    while llm.engine.has_unfinished:
        outs += llm.engine.step()
    assert [o.request_id for o in outs if o.finished] == ["a-1"]
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_engine_requests_are_single_samples(lm):
    llm = LLM(lm, config=_cfg())
    with pytest.raises(ValueError, match="for_sample"):
        llm.engine.add_request("r", [5, 6], SamplingParams(n=2))


def test_the_schema_corpus_compiles_and_every_finished_output_validates(lm):
    """The benchmark's corpus (35 schemas) on the tiny model, greedy: everything it
    finishes is valid, string formats included (the real models' runs are the benchmark's,
    docs/structured-outputs.md). A bias towards '"' keeps the random model's strings short."""
    from qserve.runtime.benchmark.schema_corpus import CORPUS, validate

    llm = LLM(lm, config=_cfg(num_kv_blocks=1024, max_num_batched_tokens=256))
    quote = {t: 3.0 for t in llm.engine.tokenizer.encode('"', add_special_tokens=False)}
    params = [SamplingParams(max_tokens=300, temperature=0, logit_bias=quote,
                             structured=GrammarSpec.json_schema(c.schema)) for c in CORPUS]
    outs = llm.generate([[5, 6, 7]] * len(CORPUS), params)
    finished = [(c, o) for c, o in zip(CORPUS, outs) if o.finish_reason == "stop"]
    assert len(finished) >= len(CORPUS) - 3
    for case, o in finished:
        validate(json.loads(o.text), case.schema)


def test_jump_forward_drafts_the_forced_tokens_and_changes_no_token(lm):
    prompts = _prompts(5, seed=12)
    params = _json(NESTED)
    off = LLM(lm, config=_cfg(jump_forward_tokens=0))
    on = LLM(lm, config=_cfg(jump_forward_tokens=8))
    want = off.generate(prompts, params)
    got = on.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    jf = on.engine.jump_forward
    assert jf.accepted > 0 and jf.emitted > jf.steps  # forced runs took a step each
    assert off.engine.jump_forward.proposed == 0
    sampled = dict(temperature=0.9, seed=3)  # sampled requests sample token by token
    assert [o.token_ids for o in on.generate(prompts, _json(NESTED, **sampled))] == \
        [o.token_ids for o in off.generate(prompts, _json(NESTED, **sampled))]
    assert on.engine.blocks.num_free_blocks == on.engine.blocks.num_blocks


def test_jump_forward_stops_when_too_few_forced_tokens_are_accepted(lm, monkeypatch):
    from qserve.runtime import engine as engine_module

    monkeypatch.setattr(engine_module, "JUMP_FORWARD_TRIAL", 4)
    llm = LLM(lm, config=_cfg(jump_forward_min_acceptance=1.01))  # no model can pass
    llm.generate(_prompts(4, seed=13), _json(NESTED))
    proposed = llm.engine.jump_forward.proposed
    assert 4 <= proposed <= 3 + 4 * 8  # the trial, then at most one step of 4 requests
    llm.generate(_prompts(4, seed=14), _json(NESTED))
    assert llm.engine.jump_forward.proposed == proposed
