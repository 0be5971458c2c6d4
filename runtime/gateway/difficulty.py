"""The difficulty router behind `model: "auto"`: small model for easy requests, large otherwise.

A request's difficulty is scored from cheap features of its text (lengths, turns, code and
math, task verbs such as extract / classify / prove / write a program, constraints, the
kind of question; FEATURE_NAMES) by a logistic regression trained on labelled prompts that
ship with qserve (`python -m qserve.runtime.gateway.difficulty_train`). No model is called
and numpy is not needed: scoring a request takes microseconds of pure Python.

The score estimates the probability that the small model answers the request worse than
the large one; `decide` sends the request to the small model when the score is below the
configured threshold, and says why in a short, header-safe `reason`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..formats.errors import QserveError

MODEL_FORMAT = "qserve-difficulty"
MODEL_VERSION = 1
MODEL_FILE = "difficulty_model.json"
# characters of the last user message that the pattern features read (its start and end):
# lengths count the whole text, the rest stays microseconds for any request size
SCAN_CHARS = 4000


class DifficultyModelError(QserveError):
    """The difficulty model (or its labels) cannot be read or does not fit this code."""


# task phrases, by the feature that counts them: a phrase is one or more words as _WORD
# splits lowercased text ("don't" -> "don t", "tl;dr" -> "tl dr"), matched consecutively
PHRASES: dict[str, tuple[str, ...]] = {
    "verb_extract": (
        "extract", "extracts", "extracting", "extraction", "pull out", "find all", "list all",
        "list every", "identify the", "identify all", "identify every", "which names",
        "which dates", "what are the names", "what is the name", "what is the date",
        "what is the email", "what is the phone", "what is the price"),
    "verb_format": (
        "format", "formats", "formatted", "formatting", "reformat", "reformatted", "convert",
        "converts", "converted", "conversion", "json", "csv", "yaml", "xml", "markdown table",
        "table", "uppercase", "upper case", "lowercase", "lower case", "title case",
        "capitalize", "capitalise", "alphabetize", "alphabetise", "alphabetical",
        "sort these", "sort the", "sort this", "bullet list", "bulleted list",
        "bullet points", "iso 8601", "date format", "snake case", "camel case", "repeat",
        "copy"),
    "verb_classify": (
        "classify", "classifies", "classification", "categorize", "categorise",
        "categorization", "sentiment", "label this", "label the", "label each",
        "positive or negative", "spam", "which category", "what category",
        "detect the language", "what language", "is this a", "is this an", "tag this",
        "tag each"),
    "verb_translate": ("translate", "translates", "translated", "translating", "translation"),
    "verb_summarize": ("summarize", "summarise", "summarizes", "summarizing", "summary",
                       "tl dr", "tldr", "in brief", "key points"),
    "verb_lookup": (
        "capital of", "who wrote", "who invented", "who painted", "who discovered",
        "who founded", "who was", "when did", "when was", "what year", "define",
        "definition", "stand for", "stands for", "chemical symbol", "boiling point",
        "abbreviation", "how many", "population of", "currency of", "plural of",
        "opposite of", "synonym", "antonym", "spell", "spelling"),
    "short_answer": (
        "one word", "single word", "only the", "only return", "only output", "only answer",
        "just the", "yes or no", "true or false", "one sentence", "in a word", "answer with",
        "no explanation", "nothing else", "one line"),
    "verb_reason": (
        "prove", "proof", "derive", "derivation", "explain why", "why does", "why do",
        "why is", "why are", "why would", "why did", "step by step", "justify", "reasoning",
        "reason about", "analyze", "analyse", "analysis", "tradeoff", "tradeoffs",
        "trade off", "trade offs", "compare and contrast", "pros and cons", "critique",
        "evaluate", "what if", "implication", "implications", "argue", "argument"),
    "verb_code": (
        "program", "programs", "function", "script", "implement", "implementation",
        "implements", "debug", "debugging", "refactor", "refactoring", "bug", "algorithm",
        "algorithms", "time complexity", "unit test", "unit tests", "thread safe",
        "concurrency", "concurrent", "regex", "python", "javascript", "typescript", "rust",
        "golang", "c++", "java", "sql", "api", "endpoint", "compile", "compiler",
        "recursion", "recursive", "this code", "the code", "my code", "write code",
        "code that", "code to", "class that", "data structure"),
    "verb_long_form": (
        "essay", "story", "article", "blog post", "report", "poem", "cover letter", "speech",
        "proposal", "design a", "design an", "design the", "plan for", "outline", "chapter",
        "screenplay", "detailed", "in depth", "comprehensive", "thorough", "business plan",
        "curriculum", "lesson plan"),
    "math_words": (
        "integral", "derivative", "derivatives", "equation", "equations", "theorem", "lemma",
        "probability", "matrix", "matrices", "eigenvalue", "eigenvalues", "eigenvector",
        "polynomial", "solve for", "optimize", "optimise", "optimization", "expected value",
        "prime", "primes", "modulo", "factorial", "recurrence", "induction", "limit of",
        "converge", "converges"),
    "log_constraints": (
        "must", "should", "at least", "at most", "no more than", "exactly", "without",
        "do not", "don t", "make sure", "ensure", "each", "every", "include", "avoid",
        "only use", "limit"),
}
_PHRASE_INDEX: dict[str, list[tuple[str, tuple[str, ...]]]] = {}
for _feature, _phrases in PHRASES.items():
    for _phrase in _phrases:
        _first, *_rest = _phrase.split()
        _PHRASE_INDEX.setdefault(_first, []).append((_feature, tuple(_rest)))

_FACTOID_FIRST = frozenset(("what", "who", "when", "where", "which"))
_FACTOID_HOW = frozenset(("many", "much", "old", "far", "long", "tall", "big"))
_OPEN_FIRST = frozenset(("why", "explain", "describe", "discuss"))
_OPEN_HOW = frozenset(("do", "does", "can", "could", "would", "should", "is", "are", "to"))
# a number and a unit of asked-for length: "500 words", "a 3-page", "5 paragraphs"
_LENGTH_UNITS = {"words": 200, "word": 200, "pages": 3, "page": 3, "paragraphs": 3,
                 "paragraph": 3, "sections": 3, "steps": 5}

_WORD = re.compile(r"[a-z0-9+#]+")
_SHOT_LINE = re.compile(r"^[ \t]*(?:q|a|question|answer|input|output|example|text|label)[ \t]*:",
                        re.IGNORECASE | re.MULTILINE)
_LIST_LINE = re.compile(r"^[ \t]*(?:[-*\u2022]|\d+[.)])[ \t]+", re.MULTILINE)
_NUMBER = re.compile(r"\d+")
_ARITH = re.compile(r"\d[ \t]*[-+*/\u00d7^%=][ \t]*\d")
_CODE_LINE = re.compile(r"^(?: {4}|\t)\S|[;{}][ \t]*$|^[ \t]*(?:def|class|import|return|fn|func|"
                        r"#include|public|private|const|let|var)\b", re.MULTILINE)
_CODE_SYMBOLS = "{}[]();=<>|&$#\\`"

# (name, what a high value reads as, what a low value reads as): the reason names the
# strongest one or two features behind a decision with these phrases
FEATURES: tuple[tuple[str, str, str], ...] = (
    ("log_chars_last", "long request", "short request"),
    ("log_chars_context", "long context", "little context"),
    ("user_turns", "many turns", "one turn"),
    ("has_system", "system prompt", "no system prompt"),
    ("log_lines", "many lines", "few lines"),
    ("code_block", "code", "no code"),
    ("code_lines", "code", "no code"),
    ("symbol_share", "symbol-heavy", "plain text"),
    ("log_numbers", "many numbers", "few numbers"),
    ("max_number_digits", "large numbers", "small numbers"),
    ("arithmetic", "arithmetic", "no arithmetic"),
    ("math_words", "math", "no math"),
    ("verb_extract", "extraction", "no extraction"),
    ("verb_format", "formatting", "no formatting"),
    ("verb_classify", "classification", "no classification"),
    ("verb_translate", "translation", "no translation"),
    ("verb_summarize", "summary", "no summary"),
    ("verb_lookup", "lookup", "no lookup"),
    ("short_answer", "short answer asked", "no short answer asked"),
    ("verb_reason", "reasoning", "no reasoning"),
    ("verb_code", "programming", "no programming"),
    ("verb_long_form", "long-form writing", "no long-form writing"),
    ("asks_long", "long output asked", "no long output asked"),
    ("log_constraints", "many constraints", "few constraints"),
    ("list_lines", "list items", "no list items"),
    ("factoid_question", "factoid question", "not a factoid question"),
    ("open_question", "open question", "not an open question"),
    ("log_shot_lines", "few-shot examples", "no few-shot examples"),
    ("log_commas_last_line", "long list to continue", "short list to continue"),
    ("ends_open", "continuation", "not a continuation"),
    ("non_ascii_share", "non-ASCII text", "ASCII text"),
)
FEATURE_NAMES: tuple[str, ...] = tuple(name for name, _, _ in FEATURES)


def message_text(content) -> str:
    """The text of one message's content: a string, or the "text" of each text part of an
    OpenAI content list (images and other parts carry no text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content
                         if isinstance(part, dict) and isinstance(part.get("text"), str))
    return ""


def _scanned(text: str) -> str:
    """The part of a long text that the pattern features read: its start and its end."""
    if len(text) <= 2 * SCAN_CHARS:
        return text
    return text[:SCAN_CHARS] + "\n" + text[-SCAN_CHARS:]


def _question_kind(words: list[str]) -> tuple[float, float]:
    """(factoid, open) for a line's words: what/who/when/.../how many vs why/how do/explain."""
    if words[:1] == ["q"]:
        words = words[1:]
    first, second = (words + ["", ""])[:2]
    factoid = first in _FACTOID_FIRST or (first == "how" and second in _FACTOID_HOW)
    open_ = first in _OPEN_FIRST or (first == "how" and second in _OPEN_HOW)
    return float(factoid), float(open_)


def features_of_messages(messages: list[dict]) -> list[float]:
    """The feature vector (FEATURE_NAMES order) of OpenAI chat messages. The request's task
    is read from its last user message; the earlier messages count as context."""
    last, context, user_turns, has_system = "", 0, 0, 0.0
    for message in messages if isinstance(messages, list) else ():
        if not isinstance(message, dict):
            continue
        text = message_text(message.get("content"))
        role = message.get("role")
        if role == "user":
            user_turns += 1
            context += len(last)
            last = text
        else:
            has_system = 1.0 if role in ("system", "developer") else has_system
            context += len(text)
    scan = _scanned(last).strip()
    lower = scan.lower()
    words = _WORD.findall(lower)
    counts = dict.fromkeys(PHRASES, 0)
    long_ask = False
    for i, word in enumerate(words):
        for feature, rest in _PHRASE_INDEX.get(word, ()):
            if not rest or tuple(words[i + 1:i + 1 + len(rest)]) == rest:
                counts[feature] += 1
        least = _LENGTH_UNITS.get(word)
        if least is not None and i > 0 and words[i - 1].isdigit():
            long_ask = long_ask or int(words[i - 1]) >= least
    first_line, _, _ = lower.partition("\n")
    last_line = lower.rpartition("\n")[2]
    kind_first = _question_kind(_WORD.findall(first_line))
    kind_last = _question_kind(_WORD.findall(last_line)) if last_line != first_line else kind_first
    numbers = _NUMBER.findall(scan)
    size = max(len(scan), 1)
    values = {
        "log_chars_last": math.log1p(len(last)),
        "log_chars_context": math.log1p(context),
        "user_turns": float(min(user_turns, 10)),
        "has_system": has_system,
        "log_lines": math.log1p(scan.count("\n")),
        "code_block": 1.0 if "```" in scan else 0.0,
        "code_lines": math.log1p(len(_CODE_LINE.findall(scan))),
        "symbol_share": sum(scan.count(ch) for ch in _CODE_SYMBOLS) / size,
        "log_numbers": math.log1p(len(numbers)),
        "max_number_digits": float(min(max(map(len, numbers), default=0), 12)),
        "arithmetic": math.log1p(len(_ARITH.findall(scan))),
        "asks_long": float(long_ask),
        "list_lines": math.log1p(len(_LIST_LINE.findall(scan))),
        "factoid_question": max(kind_first[0], kind_last[0]),
        "open_question": max(kind_first[1], kind_last[1]),
        "log_shot_lines": math.log1p(len(_SHOT_LINE.findall(scan))),
        "log_commas_last_line": math.log1p(last_line.count(",")),
        "ends_open": 1.0 if scan.endswith((",", ":")) else 0.0,
        "non_ascii_share": (len(scan) - len(scan.encode("ascii", "ignore"))) / size,
    }
    for feature, n in counts.items():
        values[feature] = math.log1p(n) if feature == "log_constraints" else float(n > 0)
    return [values[name] for name in FEATURE_NAMES]


def prompt_messages(prompt: str) -> list[dict]:
    """A plain (completion) prompt as the one user message it is scored as."""
    return [{"role": "user", "content": prompt}]


@dataclass(frozen=True)
class DifficultyDecision:
    """Where one request goes, and why (the reason is short and ASCII, for a header)."""

    target: str  # "small" | "large"
    score: float  # estimated probability that the small model answers poorly, in [0, 1]
    reason: str  # e.g. "score=0.18<0.50 (short request, extraction)"


def _sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def _numbers(doc: dict, key: str, n: int, path: Path) -> list[float]:
    values = doc.get(key)
    if (not isinstance(values, list) or len(values) != n
            or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)):
        raise DifficultyModelError(
            f"{path}: \"{key}\" must be a list of {n} finite numbers (one per feature)")
    return [float(v) for v in values]


class DifficultyRouter:
    """Scores requests with a trained logistic regression over FEATURE_NAMES."""

    def __init__(self, mean: list[float], scale: list[float], weights: list[float],
                 bias: float, source: str = "<memory>") -> None:
        n = len(FEATURE_NAMES)
        if not (len(mean) == len(scale) == len(weights) == n):
            raise DifficultyModelError(f"{source}: expected {n} values per feature list")
        if any(s <= 0 for s in scale):
            raise DifficultyModelError(f"{source}: \"scale\" values must be positive")
        self.source = source
        # logit = bias + sum(w_i * (f_i - mean_i)), with w_i the weight per raw unit
        self._mean = list(mean)
        self._w = [w / s for w, s in zip(weights, scale)]
        self._b = bias

    @classmethod
    def load(cls, path: str | Path | None = None) -> "DifficultyRouter":
        """The router of a model file written by difficulty_train; None reads the model
        shipped with qserve. DifficultyModelError, naming the file, if it is missing,
        not JSON, or made for other features or another format version."""
        shipped = path is None
        where = Path(str(resources.files(__package__) / "data" / MODEL_FILE)) if shipped \
            else Path(path)
        try:
            text = where.read_text(encoding="utf-8")
        except OSError as exc:
            what = "the shipped difficulty model" if shipped else "the difficulty model"
            raise DifficultyModelError(f"{where}: cannot read {what} "
                                       f"({exc.strerror or exc})") from exc
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DifficultyModelError(f"{where}: not a difficulty model: invalid JSON "
                                       f"({exc.msg}, line {exc.lineno})") from exc
        if not isinstance(doc, dict) or doc.get("format") != MODEL_FORMAT:
            raise DifficultyModelError(f"{where}: not a difficulty model (no \"format\": "
                                       f"\"{MODEL_FORMAT}\")")
        if doc.get("version") != MODEL_VERSION:
            raise DifficultyModelError(
                f"{where}: difficulty model version {doc.get('version')!r}, this qserve reads "
                f"version {MODEL_VERSION}; retrain with "
                "`python -m qserve.runtime.gateway.difficulty_train`")
        if doc.get("features") != list(FEATURE_NAMES):
            raise DifficultyModelError(
                f"{where}: the model was trained on other features than this qserve computes; "
                "retrain with `python -m qserve.runtime.gateway.difficulty_train`")
        n = len(FEATURE_NAMES)
        bias = doc.get("bias")
        if not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise DifficultyModelError(f"{where}: \"bias\" must be a finite number")
        return cls(_numbers(doc, "mean", n, where), _numbers(doc, "scale", n, where),
                   _numbers(doc, "weights", n, where), float(bias), source=str(where))

    def _logit_parts(self, messages: list[dict]) -> tuple[float, list[float]]:
        """The logit and each feature's part of it (relative to the training mean)."""
        f = features_of_messages(messages)
        parts = [w * (v - m) for w, v, m in zip(self._w, f, self._mean)]
        return self._b + sum(parts), parts

    def score(self, messages: list[dict]) -> float:
        """Estimated probability, in [0, 1], that the small model answers these chat
        messages worse than the large one."""
        return _sigmoid(self._logit_parts(messages)[0])

    def score_prompt(self, prompt: str) -> float:
        """score() of a plain (completion) prompt, taken as one user message."""
        return self.score(prompt_messages(prompt))

    def decide(self, messages: list[dict], threshold: float) -> DifficultyDecision:
        """"small" when score < threshold, else "large". The threshold is a number in
        [0, 1] (0 sends everything to the large model, 1 nearly everything to the small)."""
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) \
                or not 0.0 <= threshold <= 1.0:
            raise ValueError(f"difficulty threshold must be a number in [0, 1], "
                             f"not {threshold!r}")
        logit, parts = self._logit_parts(messages)
        score = _sigmoid(logit)
        small = score < threshold
        return DifficultyDecision(
            target="small" if small else "large", score=score,
            reason=f"score={score:.2f}{'<' if small else '>='}{threshold:.2f} "
                   f"({self._why(parts, small)})")

    def decide_prompt(self, prompt: str, threshold: float) -> DifficultyDecision:
        """decide() for a plain (completion) prompt."""
        return self.decide(prompt_messages(prompt), threshold)

    def _why(self, parts: list[float], small: bool) -> str:
        """The one or two features that pushed hardest toward the decision, in words: a
        feature above its training mean reads as its "high" phrase, below as its "low"."""
        order = sorted(range(len(parts)), key=lambda i: parts[i] if small else -parts[i])
        words = []
        for i in order[:2]:
            if parts[i] == 0 or (parts[i] < 0) != small:
                break
            _, high, low = FEATURES[i]
            words.append(high if (parts[i] > 0) == (self._w[i] > 0) else low)
        return ", ".join(words) if words else "no strong feature"
