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
    # ... and more: with only the topics above the head agreed with the target on 0.66 of
    # held-out positions (the same topics) but 0.42 on the golden answers (other topics)
    "kangaroos", "octopuses", "honey badgers", "wolves", "dolphins", "sharks", "crows",
    "parrots", "butterflies", "ants", "frogs", "turtles", "camels", "giraffes", "bats",
    "jellyfish", "mushrooms", "cacti", "bamboo", "oak trees", "wheat", "potatoes",
    "chocolate", "bread baking", "pasta", "sushi", "spices", "olive oil",
    "vegetarian cooking", "soup", "the piano", "the guitar", "drums", "opera", "hip hop",
    "classical music", "folk songs", "ballet", "theatre", "sculpture", "architecture",
    "pottery", "origami", "knitting", "woodworking", "calligraphy", "comic books",
    "fairy tales", "mythology", "the Greek gods", "the Aztecs", "the Incas", "the Maya",
    "medieval Europe", "the Ottomans", "the Mongols", "ancient China", "ancient India",
    "the Cold War", "the space race", "inflation", "interest rates", "credit cards",
    "insurance", "startups", "marketing", "negotiation", "leadership", "teamwork",
    "job interviews", "productivity", "habits", "motivation", "meditation", "stress",
    "anxiety", "happiness", "kindness", "honesty", "courage", "patience", "curiosity",
    "creativity", "memory", "dreams", "emotions", "childhood", "parenting", "grandparents",
    "pets", "dogs", "cats", "horses", "bird watching", "hiking", "camping", "sailing",
    "surfing", "skiing", "swimming", "tennis", "basketball", "baseball", "cricket",
    "cycling races", "marathons", "boxing", "martial arts", "gymnastics", "muscles",
    "the lungs", "digestion", "the kidneys", "hormones", "genes", "DNA", "evolution",
    "fossils", "cells", "bacteria", "antibiotics", "hospitals", "nurses", "dentists",
    "eyesight", "hearing", "allergies", "nutrition", "vitamins", "exercise", "posture",
    "chemistry", "physics", "biology", "geology", "astronomy", "economics", "psychology",
    "sociology", "philosophy", "ethics", "logic", "statistics", "probability", "algebra",
    "geometry", "calculus", "prime numbers", "fractions", "infinity", "cryptography",
    "encryption", "operating systems", "compilers", "web browsers", "search engines",
    "social media", "open source software", "version control", "unit testing", "debugging",
    "recursion", "graphs", "networks", "routers", "Bluetooth", "batteries", "engines",
    "jet aircraft", "helicopters", "rockets", "submarines", "ships", "canals", "tunnels",
    "skyscrapers", "roads", "traffic lights", "public transport", "cities of the future",
    "farming", "irrigation", "soil", "fertilizer", "beekeeping", "vineyards", "chickens",
    "cows", "fisheries", "weather forecasts", "clouds", "snow", "fog", "droughts", "floods",
    "wildfires", "tornadoes", "the ozone layer", "renewable energy", "geothermal energy",
    "hydroelectric dams", "light bulbs", "lasers", "microscopes", "telescopes", "cameras",
    "printers", "drones", "self-driving vehicles", "virtual reality", "semiconductors",
    "the speed of light", "sound waves", "magnetism", "friction", "energy", "heat", "ice",
    "crystals", "diamonds", "gold", "copper", "aluminium", "concrete", "paint", "ink",
    "perfume", "soap", "textiles", "fashion", "shoes", "hats", "uniforms", "festivals",
    "weddings", "birthdays", "holidays", "travel", "tourism", "passports", "grammar",
    "punctuation", "dictionaries", "translation", "storytelling", "journalism",
    "advertising", "podcasts", "blogs", "letters", "diaries", "biographies",
    "detective stories", "fantasy novels", "libraries of the past", "Mars rovers", "the Sun",
    "stars", "galaxies", "asteroids",
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
    # a bare opening to continue, as people also send (no instruction in it)
    "The story of {t}", "{T} is interesting because", "Here is a short guide to {t}:",
    "The first thing to know about {t} is", "Three things about {t}:", "{T} works by",
    "Many people think that {t}", "A day spent with {t}",
)

# programming tasks (one instruction in CODE_SHARE asks for one): the target answers some
# prompts with code, which answers to the templates above rarely contain
CODE_TASKS = (
    "reverses a string", "counts the vowels in a word", "merges two sorted lists",
    "checks whether a number is prime", "finds the largest value in a dictionary",
    "removes duplicates from a list", "reads a CSV file and prints each row",
    "converts Celsius to Fahrenheit", "returns the factorial of n",
    "checks whether a word is a palindrome", "sorts a list of names by length",
    "counts how often each word occurs in a text", "computes the average of a list",
    "flattens a nested list", "validates an email address",
)
CODE_TEMPLATES = (
    "Write a Python function that {c}.", "How would I write code that {c}?",
    "Show a short program that {c}, with comments.",
)
CODE_SHARE = 8

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
        if rng.randrange(CODE_SHARE) == 0:
            text = rng.choice(CODE_TEMPLATES).format(c=rng.choice(CODE_TASKS))
        else:
            t, u = rng.sample(TOPICS, 2)
            text = rng.choice(TEMPLATES).format(t=t, u=u, T=t[0].upper() + t[1:])
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out
