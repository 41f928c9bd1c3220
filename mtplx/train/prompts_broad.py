"""Broad training prompts: chat, how-to, creative writing, code in several languages, maths
word problems, summarisation / extraction over passages composed here, classification,
rewriting and multi-turn follow-ups -- built deterministically from a seed and word lists.

Every word list (and every family's template list with four or more templates) is split,
seeded, into a training part and a held-out part; held-out prompts use only held-out fillers
and held-out templates, so no held-out prompt shares a filler word or template with training.
``benchmarks/prompts`` (the measurement set) is never used here.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from mtplx.train.prompts import Prompt

WORDS: dict[str, tuple[str, ...]] = {
    "subject": (
        "volcanoes", "the stock market", "honey bees", "quantum computing", "the Roman Empire",
        "sleep", "jazz", "recycling", "glaciers", "vaccines", "the Internet", "chess",
        "electric cars", "coffee", "sourdough bread", "the Moon", "tides", "meditation",
        "inflation", "photosynthesis", "solar power", "bridges", "the printing press",
        "octopuses", "time zones", "tax returns", "the violin", "deserts", "maps",
        "nuclear fusion", "public transport", "mushrooms", "the Olympics", "cryptography",
        "friendship", "libraries", "weather forecasts", "submarines", "origami", "the brain",
        "rivers", "credit scores", "wolves", "video games", "architecture", "memory",
        "satellites", "podcasts", "vitamins", "earthquakes",
    ),
    "task": (
        "make a budget", "learn to swim", "write a cover letter", "clean a cast iron pan",
        "start a vegetable garden", "prepare for a job interview", "change a flat tire",
        "improve my handwriting", "set up a home network", "train a puppy", "back up my files",
        "cook rice on the stove", "study for an exam", "plan a road trip", "fall asleep faster",
        "negotiate a salary", "paint a room", "learn to juggle", "write a good email subject",
        "reduce food waste", "start running", "organize my closet", "make cold brew coffee",
        "remember people's names", "give a short speech", "fix a squeaky door",
        "keep houseplants alive", "learn basic Spanish", "make a paper airplane",
        "choose a laptop",
    ),
    "name": (
        "Alice", "Ben", "Chen", "Diana", "Omar", "Priya", "Lucas", "Mia", "Kenji", "Sofia",
        "Noah", "Amara", "Ivan", "Grace", "Mateo", "Leila", "Tom", "Hana", "Samuel", "Zoe",
        "Ravi", "Elena", "Jonas", "Fatima", "Hugo",
    ),
    "city": (
        "Lisbon", "Nairobi", "Osaka", "Denver", "Krakow", "Lima", "Dublin", "Hanoi",
        "Toronto", "Cairo", "Oslo", "Perth", "Seville", "Bogota", "Seoul", "Austin",
        "Marseille", "Accra", "Vienna", "Manila",
    ),
    "job": (
        "nurse", "software engineer", "baker", "teacher", "architect", "pilot", "journalist",
        "electrician", "pharmacist", "gardener", "accountant", "chef", "librarian",
        "photographer", "mechanic", "biologist",
    ),
    "item": (
        "apples", "notebooks", "pencils", "tickets", "cupcakes", "shirts", "plants",
        "batteries", "books", "mugs", "candles", "stickers", "oranges", "cookies", "chairs",
        "lamps", "socks", "eggs",
    ),
    "product": (
        "wireless headphones", "a coffee maker", "a running shoe", "a laptop stand",
        "a water bottle", "a desk lamp", "a backpack", "a blender", "an e-reader",
        "a phone case", "a yoga mat", "a rice cooker", "a smart watch", "a tent",
    ),
    "animal": (
        "cats", "elephants", "owls", "dolphins", "ants", "penguins", "foxes", "crows",
        "sharks", "horses", "frogs", "bats", "turtles", "giraffes", "squirrels",
    ),
    "lang": (
        "Python", "JavaScript", "C", "Java", "Rust", "Go", "C++", "TypeScript", "Bash",
        "Ruby", "Kotlin", "SQL",
    ),
    "code_task": (
        "reverses a string", "checks whether a number is prime", "returns the largest element "
        "of a list", "counts the vowels in a string", "computes the factorial of n",
        "merges two sorted lists", "removes duplicates from a list", "checks whether a word is "
        "a palindrome", "converts Celsius to Fahrenheit", "computes the average of a list of "
        "numbers", "finds the second smallest number in an array", "computes the n-th Fibonacci "
        "number", "splits a sentence into words", "reads a file and counts its lines",
        "sums the digits of an integer", "capitalizes the first letter of every word",
        "flattens a nested list", "checks whether two strings are anagrams",
        "returns the greatest common divisor of two numbers", "implements binary search",
    ),
    "form": (
        "haiku", "limerick", "short poem", "short story", "song chorus", "fable",
        "diary entry", "dialogue between two friends", "product description",
        "motivational speech", "bedtime story", "news headline and first paragraph",
        "postcard message", "riddle",
    ),
    "mood": (
        "happy", "funny", "sad", "mysterious", "hopeful", "calm", "dramatic", "nostalgic",
        "playful", "serious",
    ),
    "feeling": (
        "nervous", "bored", "overwhelmed", "excited", "stuck", "tired", "curious", "lonely",
        "unmotivated", "stressed",
    ),
    "constraint": (
        "on a tight budget", "without any special tools", "as a student", "in a small "
        "apartment", "if I only have weekends", "with kids around", "in winter",
        "as quickly as possible", "without spending money", "at my age",
    ),
    "situation": (
        "starting a new job", "moving to a new city", "my exams next week", "learning to code",
        "a difficult conversation with my boss", "running my first race", "my wedding speech",
        "planning a party", "working from home", "going back to school",
    ),
}  # fmt: skip

SENTENCES: tuple[str, ...] = (
    "I think we should meet tomorrow to discuss the project.",
    "The weather was really bad so we stayed inside all day.",
    "She don't like going to the gym in the morning.",
    "Please send me the report before Friday.",
    "Our team finished the work two days early.",
    "The new cafe on the corner has great coffee but slow service.",
    "He has been learning the guitar for three years.",
    "Can you tell me where the train station is?",
    "We was going to the beach but it started raining.",
    "The meeting has been moved to next Tuesday at 10 am.",
    "I loved the movie, although the ending was a bit confusing.",
    "The package arrived damaged and two items were missing.",
    "My brother and me went fishing last weekend.",
    "The library will be closed for renovations until March.",
    "This phone's battery lasts all day and the camera is excellent.",
    "They are planning to open a second store next year.",
)

REVIEWS: tuple[str, ...] = (
    "Absolutely loved it, would buy again.",
    "It broke after two days. Very disappointed.",
    "Decent quality for the price, nothing special.",
    "The service was slow and the food was cold.",
    "Fantastic experience, the staff were so friendly!",
    "Not worth the money at all.",
    "It works as described and shipping was fast.",
    "I waited an hour and nobody helped me.",
    "Best purchase I have made this year.",
    "The instructions were confusing but it works fine now.",
)


@dataclass(frozen=True)
class Pool:
    """Word lists (one part of the train / held-out split) and a random stream."""

    words: dict[str, list[str]]
    sentences: list[str]
    reviews: list[str]
    rng: random.Random

    def pick(self, key: str) -> str:
        return self.rng.choice(self.words[key])


def _passage(p: Pool) -> str:
    """A short composed passage: biography, news, meeting notes, product or trip."""
    r = p.rng
    name, other, city = p.pick("name"), p.pick("name"), p.pick("city")
    year, n, m = r.randint(1950, 2023), r.randint(2, 40), r.randint(3, 12)
    kind = r.randrange(5)
    if kind == 0:
        return (
            f"{name} was born in {city} in {year}. After studying for {m} years, {name} "
            f"became a {p.pick('job')} and later worked with {other} on a project about "
            f"{p.pick('subject')}. In {year + n}, {name} won a local award and now teaches "
            f"part-time while writing a book about {p.pick('subject')}."
        )
    if kind == 1:
        return (
            f"{city} city council announced on Monday that {n} new parks will open by {year + 1}."
            f" The plan, led by {name}, will cost about {m} million dollars. Some residents "
            f"welcomed the news, while {other}, a local {p.pick('job')}, said the money should "
            f"go to public transport first. A public meeting is planned for next month."
        )
    if kind == 2:
        return (
            f"Meeting notes, {m} May: {name} reported that sales of {p.pick('item')} rose by "
            f"{n} percent. {other} will prepare the budget for the {city} office by Friday. The "
            f"team agreed to hire a {p.pick('job')} and to review the {p.pick('subject')} "
            f"project in {m} weeks. Next meeting: Thursday at {r.randint(9, 16)}:00."
        )
    if kind == 3:
        return (
            f"Meet {p.pick('product')}: designed in {city}, it weighs only {n * 10} grams and "
            f"runs for {m} hours on one charge. It comes in {r.randint(2, 6)} colours and costs "
            f"{n + 20} dollars. Reviewers praise its build quality but note that setup takes a "
            f"while. A two-year warranty is included."
        )
    return (
        f"Last summer {name} and {other} spent {m} days travelling from {city} to "
        f"{p.pick('city')}. They covered about {n * 50} kilometres by train and bus, stayed in "
        f"{r.randint(3, 8)} different hostels and spent around {n * 30} dollars on food. The "
        f"highlight was a visit to a museum about {p.pick('subject')}."
    )


def _snippet(p: Pool) -> tuple[str, str]:
    """(language, a short code snippet) to explain or fix."""
    r = p.rng
    n = r.randint(2, 9)
    snippets = (
        ("Python", f"def f(xs):\n    return [x * {n} for x in xs if x % 2 == 0]"),
        ("Python", f"total = 0\nfor i in range({n}, {n * 5}):\n    total += i\nprint(total)"),
        ("JavaScript", f"const g = (a) => a.filter(x => x > {n}).map(x => x * 2);"),
        (
            "C",
            f"int f(int n) {{\n  int s = 0;\n  while (n > 0) {{ s += n % {n + 1}; n /= 10; }}"
            "\n  return s;\n}",
        ),
        ("SQL", f"SELECT name, COUNT(*) FROM orders WHERE amount > {n * 10} GROUP BY name;"),
        ("Bash", f'for f in *.txt; do wc -l "$f"; done | sort -n | head -{n}'),
        (
            "Java",
            "public int max(int[] a) {\n  int m = a[0];\n  for (int x : a) if (x > m) m = x;"
            "\n  return m;\n}",
        ),
        ("Rust", f"fn f(v: &[i32]) -> i32 {{ v.iter().filter(|x| **x > {n}).sum() }}"),
    )
    return r.choice(snippets)


def _fam_chat(p: Pool) -> list[str]:
    s, a = p.pick("subject"), p.pick("animal")
    return [
        f"What do you think is the most interesting thing about {s}?",
        f"Tell me a fun fact about {a}.",
        f"I'm feeling {p.pick('feeling')} about {p.pick('situation')}. Any advice?",
        f"Why do {a} behave the way they do?",
        f"Can you recommend a good way to get started with {s}?",
        f"Hi! How are you today? I want to talk about {s}.",
        f"What would happen if {s} disappeared tomorrow?",
        f"Is it true that {a} are smarter than people think?",
        f"As a {p.pick('job')}, should I care about {s}?",
        f"My friend {p.pick('name')} says {s} is overrated. What do you think?",
        f"Compare {s} and {p.pick('subject')} in a few sentences.",
        f"I'm visiting {p.pick('city')} next month. What should I know before I go?",
    ]


def _fam_howto(p: Pool) -> list[str]:
    t = p.pick("task")
    return [
        f"How do I {t}?",
        f"Give me step-by-step instructions to {t}.",
        f"What are common mistakes people make when they {t}?",
        f"I have one hour. What's the fastest way to {t}?",
        f"Explain how to {t} to a complete beginner.",
        f"How can I {t} {p.pick('constraint')}?",
        f"I'm a {p.pick('job')} with little free time. How do I {t}?",
        f"What tools or materials do I need to {t}?",
    ]


def _fam_creative(p: Pool) -> list[str]:
    f, m, s = p.pick("form"), p.pick("mood"), p.pick("subject")
    return [
        f"Write a {m} {f} about {s}.",
        f"Write a {f} about {p.pick('animal')} who live in {p.pick('city')}.",
        f"Write a {f} in which {p.pick('name')}, a {p.pick('job')}, discovers something.",
        f"Write a {m} {f} for a friend who is {p.pick('feeling')}.",
    ]


def _fam_code(p: Pool) -> list[str]:
    lang, task = p.pick("lang"), p.pick("code_task")
    code_lang, code = _snippet(p)
    return [
        f"Write a {lang} function that {task}.",
        f"Explain what this {code_lang} code does:\n\n```\n{code}\n```",
        f"How would I write a program in {lang} that {task}? Please include comments.",
        f"Is there a bug in this {code_lang} code? Explain and fix it.\n\n```\n{code}\n```",
        f"What is the difference between a list and a dictionary in {lang}?",
        f"Write unit tests in {lang} for a function that {task}.",
    ]


def _fam_maths(p: Pool) -> list[str]:
    r = p.rng
    a, b, c = r.randint(2, 30), r.randint(2, 20), r.randint(31, 200)
    name, item = p.pick("name"), p.pick("item")
    price = r.randint(2, 15)
    return [
        f"{name} buys {a} {item} at {price} dollars each and pays with a {c}-dollar bill. "
        "How much change does she get?",
        f"Solve for x: {a}x + {b} = {c}.",
        f"A train travels at {a * 5} km/h for {b} hours. How far does it go?",
        f"What is {b * 5} percent of {c}? Show your work.",
        f"The scores of a class are {a}, {b}, {c % 100} and {a + b}. What is the average?",
        f"{name} has {c} {item} and gives away {a} of them every day. After how many days "
        "will there be fewer than "
        f"{b} left?",
        f"What is {a * 13} multiplied by {b}?",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    ]


def _fam_summary(p: Pool) -> list[str]:
    text = _passage(p)
    return [
        f"Summarize the following text in one sentence:\n\n{text}",
        f"Give me a short summary of this:\n\n{text}",
        f"{text}\n\nSummarize the text above in three bullet points.",
        f"What is the main point of this passage?\n\n{text}",
    ]


def _fam_extract(p: Pool) -> list[str]:
    text = _passage(p)
    return [
        f"Extract all the names of people mentioned in this text:\n\n{text}",
        f"List every number that appears in the following text and what it refers to:\n\n{text}",
        f'From the text below, return a JSON object with the keys "people", "places" and '
        f'"numbers".\n\n{text}',
        f"{text}\n\nAnswer from the text only: who is mentioned and what did they do?",
    ]


def _fam_classify(p: Pool) -> list[str]:
    review, sentence = p.rng.choice(p.reviews), p.rng.choice(p.sentences)
    return [
        f'Is the following review positive, negative or neutral?\n\n"{review}"',
        f'Classify this sentence as a question, a statement or a request: "{sentence}"',
        f'Which category does "{p.pick("product")}" belong to: electronics, kitchen, sports '
        "or clothing? Explain briefly.",
        f'What is the sentiment of this customer message? "{review}"',
        f'Is "{p.pick("subject")}" a topic of science, history, art or everyday life?',
        f'A customer wrote this about {p.pick("product")}: "{review}" Is the customer happy? '
        "Answer yes or no, then explain.",
        f"Label each of these as an animal, a city or a job: {p.pick('animal')}, "
        f"{p.pick('city')}, {p.pick('job')}, {p.pick('animal')}.",
        f'Is this sentence formal or informal? "{sentence}"',
    ]


def _fam_rewrite(p: Pool) -> list[str]:
    s = p.rng.choice(p.sentences)
    return [
        f'Rewrite this sentence in a more formal tone: "{s}"',
        f'Fix any grammar mistakes in this sentence: "{s}"',
        f'Translate into French: "{s}"',
        f'Make this sentence shorter and clearer: "{s}"',
        f"Rewrite the following text for a ten-year-old:\n\n{_passage(p)}",
        f'Paraphrase this sentence in two different ways: "{s}"',
    ]


FAMILIES: dict[str, Callable[[Pool], list[str]]] = {
    "chat": _fam_chat,
    "howto": _fam_howto,
    "creative": _fam_creative,
    "code": _fam_code,
    "maths": _fam_maths,
    "summary": _fam_summary,
    "extract": _fam_extract,
    "classify": _fam_classify,
    "rewrite": _fam_rewrite,
}

FOLLOW_UPS: tuple[str, ...] = (
    "Can you give me an example?",
    "Can you explain that more simply?",
    "Thanks! Can you make it shorter?",
    "Why is that?",
    "Could you turn that into a numbered list?",
    "What else should I know?",
    "Great. Now write it as a short email to my team.",
    "Can you say more about the first point?",
)

REPLIES: tuple[str, ...] = (
    "Sure! Here is a short answer: it depends on the details, but the main idea is to start "
    "small, stay consistent and check your progress.",
    "Good question. In short, there are a few key points to keep in mind, and the most "
    "important one is to understand the basics first.",
    "Here you go: the answer is clear once you break the problem into steps.",
)


def _split(items: list[str], rng: random.Random, share: float) -> tuple[list[str], list[str]]:
    items = list(items)
    rng.shuffle(items)
    cut = max(1, round(len(items) * share))
    return items[cut:], items[:cut]


def _family_templates(name: str, index: int) -> bool:
    """Whether template ``index`` of family ``name`` is held out (every fourth, offset by the
    family, for families with four templates or more)."""
    return index % 4 == len(name) % 4


def split_pools(
    seed: int = 0, heldout_share: float = 0.25
) -> tuple[dict[bool, Pool], dict[bool, list[str]]]:
    """({held_out: word pool}, {held_out: follow-up questions}): every list split, seeded."""
    rng = random.Random(f"broad-{seed}")
    train_words, held_words = {}, {}
    for key, values in WORDS.items():
        train_words[key], held_words[key] = _split(list(values), rng, heldout_share)
    train_sent, held_sent = _split(list(SENTENCES), rng, heldout_share)
    train_rev, held_rev = _split(list(REVIEWS), rng, heldout_share)
    train_follow, held_follow = _split(list(FOLLOW_UPS), rng, heldout_share)
    pools = {
        True: Pool(held_words, held_sent, held_rev, random.Random(f"broad-held-{seed}")),
        False: Pool(train_words, train_sent, train_rev, random.Random(f"broad-train-{seed}")),
    }
    return pools, {True: held_follow, False: train_follow}


def build_broad_prompts(
    seed: int = 0, *, num_train: int = 3000, num_heldout: int = 60, heldout_share: float = 0.25
) -> tuple[list[Prompt], list[Prompt]]:
    """(training prompts, held-out prompts), deterministic in ``seed``; families round-robin
    (every family equally often, shuffled), about one prompt in eight multi-turn (a prior
    exchange, then a follow-up). ``Prompt.kind`` is the family (``multi-<family>`` for
    multi-turn), ``Prompt.topic`` the family's first filler-free template index."""
    pools, follow_ups = split_pools(seed, heldout_share)

    def make(held: bool, count: int) -> list[Prompt]:
        pool, out, seen = pools[held], [], set()
        follow = follow_ups[held]
        names = list(FAMILIES)
        attempts = 0
        while len(out) < count and attempts < 50 * count:
            attempts += 1
            family = names[len(out) % len(names)]
            texts = FAMILIES[family](pool)
            allowed = [
                (i, t)
                for i, t in enumerate(texts)
                if len(texts) < 4 or _family_templates(family, i) == held
            ]
            index, text = pool.rng.choice(allowed)
            if pool.rng.random() < 0.125:
                first = pool.rng.choice(FAMILIES[pool.rng.choice(names)](pool))
                history = (("user", first), ("assistant", pool.rng.choice(REPLIES)))
                prompt = Prompt(f"multi-{family}", str(index), pool.rng.choice(follow), history)
            else:
                prompt = Prompt(family, str(index), text)
            key = (prompt.text, prompt.history)
            if key not in seen:
                seen.add(key)
                out.append(prompt)
        return out

    train, heldout = make(False, num_train), make(True, num_heldout)
    heldout_keys = {(p.text, p.history) for p in heldout}
    assert not any((p.text, p.history) in heldout_keys for p in train)
    return train, heldout
