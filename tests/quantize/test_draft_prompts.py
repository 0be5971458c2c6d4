"""The hidden-draft head's training instructions stay off the benchmark's prompts."""

import json
import re
from pathlib import Path

from qserve.quantize.draft_prompts import CODE_TASKS, GENERIC_WORDS, TOPICS, instructions

AGREEMENT = Path(__file__).resolve().parents[2] / "evals" / "golden" / "agreement_prompts.jsonl"
STOP = {"the", "of", "and", "a", "in"}


def _stems(text: str) -> set[str]:
    words = set(re.findall(r"[a-z]+", text.lower())) - STOP
    return {w[:-1] if w.endswith("s") and len(w) > 4 else w for w in words}


def test_no_topic_word_of_the_agreement_prompts_but_the_generic_ones():
    prompts = [json.loads(line)["prompt"].lower() for line in AGREEMENT.read_text().splitlines()
               if line]
    shared = {w for t in TOPICS for w in _stems(t)
              if any(re.search(r"\b" + re.escape(w), p) for p in prompts)}
    assert shared == GENERIC_WORDS
    assert not set(instructions(1536)) & set(prompts)
    # the programming tasks share only function words and generic verbs with them (none of
    # their subjects: fibonacci, numpy, installing packages)
    code = {w for t in CODE_TASKS for w in _stems(t)
            if any(re.search(r"\b" + re.escape(w), p) for p in prompts)}
    assert code <= {"an", "by", "compute", "how", "is", "list", "n", "print", "to"}


def test_instructions_are_reproducible_and_varied():
    a, b = instructions(100, seed=3), instructions(100, seed=3)
    assert a == b and a != instructions(100, seed=4)
    many = instructions(1536)
    assert len(many) == len(set(many)) == 1536  # distinct: a repeat teaches nothing new
    code = [m for m in many if any(t in m for t in CODE_TASKS)]
    openings = [m for m in many if not m.rstrip().endswith((".", "?"))]  # bare openings
    assert 30 <= len(code) <= 60 and len(openings) > 200
