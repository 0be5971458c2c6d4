"""Build the golden task datasets (evals/golden/*.jsonl) from the fact tables.

    generation.jsonl   {"id", "category", "prompt", "answer"}: few-shot completion prompts
                       with one short known answer, scored by exact match (greedy, until a
                       newline). Categories: capitals, arithmetic, copying, sequence
                       continuation, opposites, plurals (short instructions).
    choice.jsonl       {"id", "category", "query", "choices", "gold"}: multiple choice scored
                       by the log-likelihood of each choice after the query.
    agreement_prompts.jsonl  {"id", "prompt"}: open prompts whose greedy continuation is
                       compared with the bf16 reference's (evals/reference_outputs.py).

Deterministic: the same tables and seed give byte-identical files. `DIGESTS.json` holds
the sha256 of every golden file; the eval report names them.

    python -m qserve.evals.golden_tasks --write     rebuild the files and DIGESTS.json
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from pathlib import Path

from . import golden_facts as F

GOLDEN_DIR = Path(__file__).parent / "golden"
DIGESTS_FILE = GOLDEN_DIR / "DIGESTS.json"
SEED = 1234
SHOTS = 3


def _few_shot(pairs: list[tuple[str, str]], i: int, fmt, rng: random.Random) -> str:
    """Prompt for pairs[i] with SHOTS other pairs of the same table as examples.
    fmt(question_part) -> (question line, answer prefix)."""
    others = [p for j, p in enumerate(pairs) if j != i and p[1] != pairs[i][1]]
    lines = []
    for q, a in rng.sample(others, SHOTS):
        lines.append(f"{fmt(q)} {a}")
    lines.append(fmt(pairs[i][0]))
    return "\n".join(lines)


def generation_rows() -> list[dict]:
    """~1,200 items that a small model mostly answers (facts both ways, single-digit sums,
    copying, sequences, word forms). The recovery gate's standard error shrinks with the
    number of items whose outcome the artifact flips, so every category grows, rather
    than the set being padded with items no model gets wrong. Harder arithmetic (two-digit
    sums, differences, products), "which number is larger" and next-day/month questions
    were tried and dropped: SmolLM2-135M answered 5-27% of them."""
    rng = random.Random(SEED)
    rows = []

    def add(category: str, prompt: str, answer: str) -> None:
        rows.append({"id": f"gen-{len(rows):04d}", "category": category, "prompt": prompt,
                     "answer": answer})

    def few_shot_all(category: str, pairs: list[tuple[str, str]], fmt) -> None:
        for i, (_, answer) in enumerate(pairs):
            add(category, _few_shot(pairs, i, fmt, rng), answer)

    few_shot_all("capital", F.CAPITALS, lambda c: f"Q: What is the capital of {c}?\nA:")
    cities = [(city, country) for country, city in F.CAPITALS
              if sum(c == city for _, c in F.CAPITALS) == 1 and not country.startswith("the ")]
    few_shot_all("country", cities, lambda c: f"Q: {c} is the capital of which country?\nA:")
    sums = [(f"{a} + {b}", str(a + b)) for a in range(1, 10) for b in range(1, 10)]
    few_shot_all("arithmetic", sums, lambda s: f"Q: What is {s}?\nA:")
    copy_words = F.COPY_WORDS + sorted({w for w, _ in F.PLURALS} - set(F.COPY_WORDS))
    words = [(w, w) for w in copy_words]
    few_shot_all("copy", words, lambda s: f"Repeat the word: {s}\nAnswer:")
    for name, seq in F.SEQUENCES.items():
        for start in range(0, len(seq) - 4):
            shown = ", ".join(seq[start:start + 4])
            add("sequence", f"Continue the list of {name}: {shown},", seq[start + 4])
    for step in (1, 2, 3, 4, 5, 10, 20, 25, 50, 100):
        for start in range(1, 31):
            nums = [str(start + k * step) for k in range(5)]
            add("sequence", f"Continue the sequence: {', '.join(nums[:4])},", nums[4])
    for step in (1, 2, 5, 10):
        for start in range(50, 100, 5):
            nums = [str(start - k * step) for k in range(5)]
            add("sequence", f"Continue the sequence: {', '.join(nums[:4])},", nums[4])
    firsts, seconds = [a for a, _ in F.OPPOSITES], [b for _, b in F.OPPOSITES]
    opposites = F.OPPOSITES + [(b, a) for a, b in F.OPPOSITES  # unambiguous reversals
                               if b not in firsts and seconds.count(b) == 1]
    few_shot_all("opposite", opposites, lambda w: f"Q: What is the opposite of \"{w}\"?\nA:")
    few_shot_all("plural", F.PLURALS,
                 lambda w: f"Write the plural of the word \"{w}\".\nAnswer:")
    few_shot_all("singular", [(b, a) for a, b in F.PLURALS],
                 lambda w: f"Write the singular of the word \"{w}\".\nAnswer:")
    numbers = list(enumerate(F.NUMBER_WORDS)) + list(F.TENS_WORDS.items())
    few_shot_all("number word", [(str(n), w) for n, w in numbers],
                 lambda n: f"Write the number {n} in words.\nAnswer:")
    few_shot_all("number word", [(w, str(n)) for n, w in numbers],
                 lambda w: f"Write \"{w}\" as a number.\nAnswer:")
    return rows


def _choices(answer: str, pool: list[str], rng: random.Random, n: int = 4) -> tuple[list[str], int]:
    wrong = sorted({p for p in pool if p != answer})
    options = rng.sample(wrong, n - 1) + [answer]
    rng.shuffle(options)
    return options, options.index(answer)


def choice_rows() -> list[dict]:
    rng = random.Random(SEED + 1)
    rows = []

    def add(category: str, query: str, answer: str, pool: list[str]) -> None:
        options, gold = _choices(answer, pool, rng)
        rows.append({"id": f"mc-{len(rows):04d}", "category": category, "query": query,
                     "choices": options, "gold": gold})

    cities = [c for _, c in F.CAPITALS]
    for country, city in F.CAPITALS:
        add("capital", f"The capital of {country} is", city, cities)
    opposites = [b for _, b in F.OPPOSITES]
    for a, b in F.OPPOSITES:
        add("opposite", f"The opposite of \"{a}\" is", b, opposites)
    categories = sorted({c for _, c in F.CATEGORIES})
    for item, cat in F.CATEGORIES:
        article = "An" if item[0] in "aeiou" else "A"
        add("category", f"{article} {item} is a kind of", cat, categories)
    colors = sorted({c for _, c in F.COLORS})
    for thing, color in F.COLORS:
        add("color", f"The color of {thing} is", color, colors)
    sounds = [s for _, s in F.ANIMAL_SOUNDS]
    for animal, sound in F.ANIMAL_SOUNDS:
        add("animal sound", f"The {animal}", sound, sounds)
    plurals = [p for _, p in F.PLURALS]
    for word, plural in F.PLURALS:
        add("plural", f"One {word}, two", plural, plurals)
    for name, seq in F.SEQUENCES.items():
        for start in range(0, len(seq) - 3):
            add("sequence", ", ".join(seq[start:start + 3]) + ",", seq[start + 3], seq)
    for a in range(1, 10):
        for b in range(1, 10):
            if (a * 9 + b) % 3 == 0:  # a third of the single-digit sums
                add("arithmetic", f"{a} + {b} =", str(a + b), [str(n) for n in range(2, 19)])
    return rows


AGREEMENT_PROMPTS = [
    "The history of the printing press",
    "Once upon a time, in a small village by the sea,",
    "The three most important things to know about photosynthesis are",
    "Here is a short recipe for pancakes:",
    "def fibonacci(n):",
    "The main difference between a virus and a bacterium is",
    "Dear hiring manager,",
    "The water cycle begins when",
    "In 1969, the first humans",
    "A good night's sleep matters because",
    "The rules of chess are simple:",
    "To install a Python package, you",
    "The Roman Empire fell because",
    "My favourite season is autumn, because",
    "An apple a day",
    "The Pythagorean theorem states that",
    "How to make a paper airplane:",
    "The city of Paris is famous for",
    "Electric cars work by",
    "The best way to learn a new language is",
    "Volcanoes form when",
    "import numpy as np\n",
    "The moon orbits the Earth",
    "Bees are important to farmers because",
    "A list of five colours: red,",
    "The quick brown fox",
    "In computer science, a hash table",
    "The ocean covers most of the planet, and",
    "To write a good essay, first",
    "The heart pumps blood",
    "Shakespeare wrote many plays, including",
    "When water freezes, it",
]


def agreement_rows() -> list[dict]:
    return [{"id": f"agree-{i:03d}", "prompt": p} for i, p in enumerate(AGREEMENT_PROMPTS)]


BUILDERS = {
    "generation.jsonl": generation_rows,
    "choice.jsonl": choice_rows,
    "agreement_prompts.jsonl": agreement_rows,
}


def _write_atomic(path: Path, data: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(data, encoding="utf-8")
    os.replace(tmp, path)


def render(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def golden_digests() -> dict[str, str]:
    """The recorded sha256 of every golden file (DIGESTS.json)."""
    return json.loads(DIGESTS_FILE.read_text())


def write_all(root: Path = GOLDEN_DIR) -> dict[str, str]:
    for name, build in BUILDERS.items():
        _write_atomic(root / name, render(build()))
    digests = {p.name: file_digest(p) for p in sorted(root.glob("*.jsonl"))}
    _write_atomic(root / "DIGESTS.json", json.dumps(digests, indent=1) + "\n")
    return digests


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m qserve.evals.golden_tasks --write")
    for name, digest in write_all().items():
        print(f"{digest}  {name}")
