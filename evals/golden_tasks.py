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
import random
import sys
from pathlib import Path

from ..runtime.atomic_file import write_json_atomic, write_text_atomic
from . import golden_facts as F

GOLDEN_DIR = Path(__file__).parent / "golden"
DIGESTS_FILE = GOLDEN_DIR / "DIGESTS.json"
SEED = 1234
SHOTS = 3


def _few_shot(pairs: list[tuple[str, str]], i: int, fmt, rng: random.Random) -> str:
    """Prompt for pairs[i] with SHOTS other pairs of the same table as examples, drawn for
    this item alone. (Examples shared by a whole category were tried: the prefix cache
    then halves the time, but every item of the category answers in the same context, so
    the items are no longer independent: FP8 moved whole categories by up to 11 points
    either way, shot set by shot set, and a per-item standard error understated that.)
    An example never has the item's answer."""
    others = [p for j, p in enumerate(pairs) if j != i and p[1] != pairs[i][1]]
    lines = [f"{fmt(q)} {a}" for q, a in rng.sample(others, SHOTS)]
    lines.append(fmt(pairs[i][0]))
    return "\n".join(lines)


def _number_sequences(rng: random.Random, count: int, down: bool) -> list[tuple[str, str]]:
    """`count` distinct 5-term arithmetic sequences (4 shown, the 5th asked), positive."""
    seqs: dict[str, str] = {}
    while len(seqs) < count:
        step = rng.choice(SEQUENCE_STEPS)
        first = rng.randint(5 * step, 5 * step + 300) if down else rng.randint(1, 300)
        nums = [str(first - k * step if down else first + k * step) for k in range(5)]
        seqs.setdefault(", ".join(nums[:4]), nums[4])
    return sorted(seqs.items(), key=lambda kv: rng.random())


def _letter_sequences() -> list[tuple[str, str]]:
    """Every 5-letter run of the alphabet, forwards and backwards, steps 1-2, both cases."""
    out = []
    for step in (1, 2, -1, -2):
        for case in (str.lower, str.upper):
            for start in range(26):
                idx = [start + k * step for k in range(5)]
                if 0 <= min(idx) and max(idx) < 26:
                    letters = [case(LETTERS[i]) for i in idx]
                    out.append((", ".join(letters[:4]), letters[4]))
    return out


def _patterns(rng: random.Random, words: list[str], count: int) -> list[tuple[str, str]]:
    """`count` distinct repeating word patterns (period 2 or 3, at least two periods shown)."""
    out: dict[str, str] = {}
    while len(out) < count:
        period = rng.choice((2, 3))
        cycle = rng.sample(words, period)
        shown = (cycle * 4)[:2 * period + rng.randint(1, period)]
        out.setdefault(", ".join(shown), cycle[len(shown) % period])
    return list(out.items())


# steps of the number sequences, and how many of each direction are asked
SEQUENCE_STEPS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 15, 20, 25, 30, 50, 100)
LETTERS = "abcdefghijklmnopqrstuvwxyz"
# (a few-shot "number after/before" item is ~70 tokens, a sequence ~20: the eval's time
# goes by tokens, its standard error by the items the artifact flips)
COUNTS = {"sequence up": 600, "sequence down": 400, "pattern": 400, "number after": 250,
          "number before": 250, "copy words": 200}


def generation_rows() -> list[dict]:
    """~3,300 items that a small model mostly answers: facts both ways, copying, number and
    letter sequences, repeating patterns, the number after or before, one- and two-digit
    sums, number words, word forms. The recovery gate's standard error shrinks with the
    number of items whose outcome the artifact flips, so the set grows with items of that
    kind, generated, rather than being padded with items no model gets wrong. Harder
    arithmetic (two-digit + two-digit sums, differences, products), "which number is
    larger", next-day/month and "which letter comes after" questions were tried and
    dropped: SmolLM2-135M answered 5-27% of them."""
    rng = random.Random(SEED)
    rows = []

    def add(category: str, prompt: str, answer: str) -> None:
        rows.append({"id": f"gen-{len(rows):04d}", "category": category, "prompt": prompt,
                     "answer": answer})

    def few_shot_all(category: str, pairs: list[tuple[str, str]], fmt,
                     limit: int | None = None) -> None:
        asked = range(len(pairs)) if limit is None else sorted(rng.sample(range(len(pairs)), limit))
        for i in asked:
            add(category, _few_shot(pairs, i, fmt, rng), pairs[i][1])

    def zero_shot_all(category: str, pairs: list[tuple[str, str]], fmt) -> None:
        for shown, answer in pairs:
            add(category, fmt(shown), answer)

    few_shot_all("capital", F.CAPITALS, lambda c: f"Q: What is the capital of {c}?\nA:")
    cities = [(city, country) for country, city in F.CAPITALS
              if sum(c == city for _, c in F.CAPITALS) == 1 and not country.startswith("the ")]
    few_shot_all("country", cities, lambda c: f"Q: {c} is the capital of which country?\nA:")
    ask_sum = lambda s: f"Q: What is {s}?\nA:"
    few_shot_all("arithmetic", [(f"{a} + {b}", str(a + b)) for a in range(1, 10)
                                for b in range(1, 10)], ask_sum)
    few_shot_all("arithmetic", [(f"{t} + {u}", str(t + u)) for t in range(10, 100, 10)
                                for u in range(1, 10)], ask_sum)
    few_shot_all("arithmetic", [(f"{a} + {b}", str(a + b)) for a in range(11, 30)
                                if a % 10 for b in range(1, 10)], ask_sum)
    copy_words = F.COPY_WORDS + sorted({w for w, _ in F.PLURALS} - set(F.COPY_WORDS))
    few_shot_all("copy", [(w, w) for w in copy_words], lambda s: f"Repeat the word: {s}\nAnswer:")
    words = sorted(set(copy_words) | {c for _, c in F.COLORS})
    phrases = sorted({" ".join(rng.sample(words, 2)) for _ in range(COUNTS["copy words"])})
    few_shot_all("copy words", [(p, p) for p in phrases],
                 lambda s: f"Repeat the words: {s}\nAnswer:")
    for name, seq in F.SEQUENCES.items():
        for start in range(0, len(seq) - 4):
            shown = ", ".join(seq[start:start + 4])
            add("sequence", f"Continue the list of {name}: {shown},", seq[start + 4])
    ask_next = lambda s: f"Continue the sequence: {s},"
    zero_shot_all("sequence", _number_sequences(rng, COUNTS["sequence up"], down=False), ask_next)
    zero_shot_all("sequence", _number_sequences(rng, COUNTS["sequence down"], down=True), ask_next)
    zero_shot_all("sequence", _letter_sequences(), ask_next)
    zero_shot_all("pattern", _patterns(rng, words, COUNTS["pattern"]),
                  lambda s: f"Continue the pattern: {s},")
    few_shot_all("number after", [(str(n), str(n + 1)) for n in range(1, 1000)],
                 lambda n: f"Q: What number comes after {n}?\nA:", COUNTS["number after"])
    few_shot_all("number before", [(str(n), str(n - 1)) for n in range(2, 1000)],
                 lambda n: f"Q: What number comes before {n}?\nA:", COUNTS["number before"])
    firsts, seconds = [a for a, _ in F.OPPOSITES], [b for _, b in F.OPPOSITES]
    opposites = F.OPPOSITES + [(b, a) for a, b in F.OPPOSITES  # unambiguous reversals
                               if b not in firsts and seconds.count(b) == 1]
    few_shot_all("opposite", opposites, lambda w: f"Q: What is the opposite of \"{w}\"?\nA:")
    few_shot_all("plural", F.PLURALS,
                 lambda w: f"Write the plural of the word \"{w}\".\nAnswer:")
    few_shot_all("singular", [(b, a) for a, b in F.PLURALS],
                 lambda w: f"Write the singular of the word \"{w}\".\nAnswer:")
    few_shot_all("first letter", [(w, w[0]) for w in words],
                 lambda w: f"Q: What is the first letter of the word \"{w}\"?\nA:")
    numbers = list(enumerate(F.NUMBER_WORDS)) + list(F.TENS_WORDS.items())
    tens = {20: F.NUMBER_WORDS[20], **F.TENS_WORDS}
    numbers += [(t + u, f"{tens[t]}-{F.NUMBER_WORDS[u]}") for t in tens for u in range(1, 10)]
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
    around = lambda n, r: [str(m) for m in range(max(0, n - r), n + r)]  # wrong answers
    for down in (False, True):
        for shown, answer in _number_sequences(rng, CHOICE_NUMBER_SEQUENCES // 2, down):
            add("sequence", f"{shown},", answer, around(int(answer), 40))
    for shown, answer in _letter_sequences():
        add("sequence", f"{shown},", answer, list(LETTERS.upper() if answer.isupper() else LETTERS))
    return rows


# generated choice items (wrong choices drawn around the answer): sums of every kind and
# "the number after/before" with near misses (n +- 1, 2, 10) were tried and left out, the
# bf16 model picks them at about chance (26-46%) and they only add noise; so were items it
# rarely misses (repeating patterns, "the number after/before" with wrong choices up to 50
# away: 84-100%, FP8 flipped 0-2% of them), which cost time and only dilute
CHOICE_NUMBER_SEQUENCES = 400  # half up, half down


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


# -- the full suite's extra items (`qserve eval --suite full`) ----------------------------
# More items of the generated kinds only, each new (no prompt or query of the default
# files again), so items stay independent and the default suite stays a fixed subset. The
# fact tables are used up by the default files: a fact asked again with other examples is
# not a new item (its outcome follows the fact), and the jackknife would understate the
# standard error. Sized to settle the default model's margins at 2 standard errors as the
# default suite measured them; with these items the margins came out smaller (docs/eval-gates.md).
MORE_COUNTS = {"sequence up": 1200, "sequence down": 800, "pattern": 600, "number after": 400,
               "number before": 400, "copy words": 300}
CHOICE_MORE_NUMBER_SEQUENCES = 1600  # half up, half down


def _new_only(pairs: list[tuple[str, str]], seen: set[str], count: int) -> list[tuple[str, str]]:
    """The first `count` pairs whose shown text is not in `seen`."""
    out = [p for p in pairs if p[0] not in seen][:count]
    if len(out) < count:
        raise ValueError(f"only {len(out)} new items of {count} wanted")
    return out


def generation_more_rows() -> list[dict]:
    """~3,700 items beyond generation.jsonl, of its generated kinds: number sequences,
    repeating patterns, the number after or before, copying word pairs."""
    default = generation_rows()
    seen = {r["prompt"] for r in default}
    shown_of = lambda prompt: prompt.split(": ", 1)[1].rstrip(",")  # "Continue ...: 1, 2,"
    seen_shown = {shown_of(r["prompt"]) for r in default
                  if r["category"] in ("sequence", "pattern") and ": " in r["prompt"]}
    rng = random.Random(SEED + 2)
    rows = []

    def add(category: str, prompt: str, answer: str) -> None:
        if prompt in seen:
            return
        seen.add(prompt)
        rows.append({"id": f"gen-more-{len(rows):04d}", "category": category,
                     "prompt": prompt, "answer": answer})

    ask_next = lambda s: f"Continue the sequence: {s},"
    for down, key in ((False, "sequence up"), (True, "sequence down")):
        n = MORE_COUNTS[key]
        pairs = _number_sequences(rng, 2 * n, down)
        for shown, answer in _new_only(pairs, seen_shown, n):
            add("sequence", ask_next(shown), answer)
    copy_words = F.COPY_WORDS + sorted({w for w, _ in F.PLURALS} - set(F.COPY_WORDS))
    words = sorted(set(copy_words) | {c for _, c in F.COLORS})
    for shown, answer in _new_only(_patterns(rng, words, 2 * MORE_COUNTS["pattern"]),
                                   seen_shown, MORE_COUNTS["pattern"]):
        add("pattern", f"Continue the pattern: {shown},", answer)
    for category, pairs, fmt in (
            ("number after", [(str(n), str(n + 1)) for n in range(1, 1000)],
             lambda n: f"Q: What number comes after {n}?\nA:"),
            ("number before", [(str(n), str(n - 1)) for n in range(2, 1000)],
             lambda n: f"Q: What number comes before {n}?\nA:")):
        asked_before = {r["answer"] for r in default if r["category"] == category}
        fresh = [i for i, (_, a) in enumerate(pairs) if a not in asked_before]
        for i in sorted(rng.sample(fresh, MORE_COUNTS[category])):
            add(category, _few_shot(pairs, i, fmt, rng), pairs[i][1])
    phrases = sorted({" ".join(rng.sample(words, 2)) for _ in range(4 * MORE_COUNTS["copy words"])})
    asked = {r["answer"] for r in default if r["category"] == "copy words"}
    new = [p for p in phrases if p not in asked][:MORE_COUNTS["copy words"]]
    pairs = [(p, p) for p in new]
    for i in range(len(pairs)):
        add("copy words", _few_shot(pairs, i, lambda s: f"Repeat the words: {s}\nAnswer:", rng),
            pairs[i][1])
    return rows


def choice_more_rows() -> list[dict]:
    """1,600 number-sequence items beyond choice.jsonl (the generated kind of that file
    whose outcome FP8 flips; its fact kinds are used up there)."""
    seen = {r["query"] for r in choice_rows()}
    rng = random.Random(SEED + 3)
    rows = []
    around = lambda n, r: [str(m) for m in range(max(0, n - r), n + r)]
    for down in (False, True):
        n = CHOICE_MORE_NUMBER_SEQUENCES // 2
        pairs = _number_sequences(rng, 2 * n, down)
        for shown, answer in _new_only(pairs, {q.rstrip(",") for q in seen}, n):
            options, gold = _choices(answer, around(int(answer), 40), rng)
            rows.append({"id": f"mc-more-{len(rows):04d}", "category": "sequence",
                         "query": f"{shown},", "choices": options, "gold": gold})
    return rows


BUILDERS = {
    "generation.jsonl": generation_rows,
    "choice.jsonl": choice_rows,
    "agreement_prompts.jsonl": agreement_rows,
    "generation_more.jsonl": generation_more_rows,
    "choice_more.jsonl": choice_more_rows,
}


def render(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def golden_digests() -> dict[str, str]:
    """The recorded sha256 of every golden file (DIGESTS.json)."""
    return json.loads(DIGESTS_FILE.read_text())


def write_all(root: Path = GOLDEN_DIR) -> dict[str, str]:
    for name, build in BUILDERS.items():
        write_text_atomic(root / name, render(build()))
    digests = {p.name: file_digest(p) for p in sorted(root.glob("*.jsonl"))}
    write_json_atomic(root / "DIGESTS.json", digests)
    return digests


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m qserve.evals.golden_tasks --write")
    for name, digest in write_all().items():
        print(f"{digest}  {name}")
