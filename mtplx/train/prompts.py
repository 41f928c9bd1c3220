"""A varied prompt set built programmatically: templates x topics, split into a training set
and a disjoint held-out set (held-out prompts use topics that never appear in training)."""

from __future__ import annotations

import random
from dataclasses import dataclass

TOPICS: tuple[str, ...] = (
    "photosynthesis",
    "the French Revolution",
    "black holes",
    "climate change",
    "vaccines",
    "the water cycle",
    "machine learning",
    "the Roman Empire",
    "volcanoes",
    "coffee",
    "electric cars",
    "the human heart",
    "chess",
    "renewable energy",
    "honey bees",
    "the stock market",
    "jazz music",
    "the Moon landing",
    "earthquakes",
    "sleep",
    "the Internet",
    "dinosaurs",
    "recycling",
    "gardening",
    "the immune system",
    "inflation",
    "the Great Wall of China",
    "rainbows",
    "antibiotics",
    "bicycles",
    "the printing press",
    "ocean tides",
    "meditation",
    "solar panels",
    "the Olympic Games",
    "cloud computing",
    "bread baking",
    "migratory birds",
    "the Renaissance",
    "glaciers",
    "public libraries",
    "blockchain",
    "the periodic table",
    "rain forests",
    "time zones",
    "password security",
    "the pyramids of Egypt",
    "wind turbines",
    "healthy breakfasts",
    "the solar system",
    "coral reefs",
    "democracy",
    "running a marathon",
    "spreadsheets",
    "the theory of evolution",
    "learning a new language",
    "volunteering",
    "hurricanes",
    "the camera",
    "composting",
    "electricity",
    "friendship",
    "the Amazon river",
    "nuclear power",
    "smartphones",
    "teamwork",
    "the Silk Road",
    "penguins",
    "tea",
    "space telescopes",
    "saving money",
    "DNA",
    "board games",
    "trains",
    "photography",
)

TEMPLATES: dict[str, tuple[str, ...]] = {
    "question": (
        "What is {t}?",
        "Why is {t} important?",
        "How does {t} work?",
        "Can you explain {t} to a ten-year-old?",
        "What are the most common misconceptions about {t}?",
        "What is the history of {t}?",
    ),
    "instruction": (
        "Write a short paragraph about {t}.",
        "Write a short poem about {t}.",
        "Give me three tips related to {t}.",
        "Describe {t} in simple words.",
        "Write a friendly email to a colleague about {t}.",
        "Write a short story that involves {t}.",
    ),
    "code": (
        "Write a Python function that stores facts about {t} in a dictionary and prints them.",
        "Write a Python class that represents {t}, with a docstring and two methods.",
        "Write a short Python script that counts the words in a text about {t}.",
        "Show a Python example that sorts a list of items related to {t}.",
    ),
    "summary": (
        "Summarize the main ideas of {t} in a few sentences.",
        "Give a one-paragraph summary of {t} for a newspaper.",
        "Summarize the pros and cons of {t}.",
    ),
    "list": (
        "List five facts about {t}.",
        "List the key terms someone should know about {t}.",
        "Make a numbered list of steps to learn about {t}.",
        "List three questions a student might ask about {t}.",
    ),
}


@dataclass(frozen=True)
class Prompt:
    """One user message, with the template kind it came from and its topic; ``history``
    holds earlier turns of a multi-turn conversation as (role, content) pairs."""

    kind: str
    topic: str
    text: str
    history: tuple[tuple[str, str], ...] = ()


def build_prompts(
    seed: int = 0, *, num_train: int = 600, num_heldout: int = 40, heldout_topics: int = 8
) -> tuple[list[Prompt], list[Prompt]]:
    """(training prompts, held-out prompts), deterministic in ``seed``.

    ``heldout_topics`` topics are drawn (seeded) and used ONLY by held-out prompts, so no
    held-out prompt shares its topic, let alone its text, with a training prompt."""
    rng = random.Random(seed)
    topics = list(TOPICS)
    rng.shuffle(topics)
    held, train_topics = topics[:heldout_topics], topics[heldout_topics:]

    def combos(chosen: list[str]) -> list[Prompt]:
        out = [
            Prompt(kind, topic, template.format(t=topic))
            for kind, templates in TEMPLATES.items()
            for template in templates
            for topic in chosen
        ]
        rng.shuffle(out)
        return out

    train = combos(train_topics)[:num_train]
    heldout = combos(held)[:num_heldout]
    assert not {p.text for p in train} & {p.text for p in heldout}
    return train, heldout
