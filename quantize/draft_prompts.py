"""Chat instructions the target answers to make training data for a hidden-state draft head.

The head learns from the target's own greedy answers (self-distillation), so it needs
prompts, not answers: instruction templates x topics, drawn with a fixed seed. The topics
avoid those of the golden agreement prompts (evals/golden/agreement_prompts.jsonl), which
the speculative-decoding benchmark measures acceptance on: no topic word appears in them
but the generic GENERIC_WORDS (tests/quantize/test_draft_prompts.py checks it).
"""

from __future__ import annotations

import random

TOPICS = (
    "glaciers", "the immune system", "bridges", "the stock market", "jazz music", "deserts",
    "coral reefs", "the internet", "earthquakes", "the French Revolution", "black holes",
    "vaccines", "rainforests", "solar panels", "the Great Wall of China", "dinosaurs", "coffee",
    "tea ceremonies", "the Olympic Games", "democracy", "recycling", "wind turbines",
    "ancient Egypt", "the Renaissance", "tides", "climate change", "the Amazon river", "owls",
    "whales", "mountains", "football", "the violin", "gardening", "the Industrial Revolution",
    "the periodic table", "gravity", "magnets", "the brain", "space stations", "satellites",
    "lightning", "rainbows", "bicycles", "trains", "airports", "libraries", "museums",
    "computers", "smartphones", "robots", "artificial intelligence", "spiders", "elephants",
    "penguins", "Jupiter", "comets", "hurricanes", "friendship", "time management",
    "public speaking", "saving money", "healthy eating", "running", "yoga", "poetry", "novels",
    "photography", "painting", "cheese making", "rice farming", "fishing", "forests", "rivers",
    "lakes", "islands", "the Arctic", "Antarctica", "the Sahara", "castles", "pyramids",
    "knights", "samurai", "Vikings", "the Silk Road", "maps", "compasses", "clocks",
    "calendars", "banks", "taxes", "elections", "courts", "newspapers", "radio", "television",
    "cinema", "video games", "board games", "sorting algorithms", "databases", "spreadsheets",
    "email", "passwords", "cloud computing", "nuclear power", "oil", "plastics", "glass",
    "steel", "cotton", "silk", "wool",
)

# topic words the agreement prompts also use, in other senses ("the periodic table" /
# "a hash table", "computers" / "computer science", "time management" / "once upon a time")
GENERIC_WORDS = frozenset({"table", "computer", "time"})

TEMPLATES = (
    "Explain {t} to a ten-year-old.", "Write a short paragraph about {t}.",
    "What are three interesting facts about {t}?", "Give me a brief history of {t}.",
    "Why is {t} important?", "Write a short poem about {t}.", "Describe {t} in detail.",
    "What are the pros and cons of {t}?", "How does {t} work?",
    "Write a short story that involves {t}.", "List some common misconceptions about {t}.",
    "Tell me about {t}.", "What should a beginner know about {t}?",
    "Summarize what scientists know about {t}.", "Compare {t} and {u}.",
)

# put before a snippet of calibration text
SNIPPET_INSTRUCTIONS = (
    "Explain the following in simple words:\n\n", "Summarize this text:\n\n",
    "What does this mean?\n\n", "Rewrite this more clearly:\n\n",
    "Give an example of the following:\n\n", "Answer briefly: what is described here?\n\n",
)


def instructions(n: int, seed: int = 0) -> list[str]:
    """n distinct instructions (a repeat would only repeat the target's greedy answer),
    reproducible for a seed; fewer only if the templates and topics run out."""
    rng = random.Random(seed)
    out, seen = [], set()
    for _ in range(50 * n):
        if len(out) == n:
            break
        t, u = rng.sample(TOPICS, 2)
        text = rng.choice(TEMPLATES).format(t=t, u=u)
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out
