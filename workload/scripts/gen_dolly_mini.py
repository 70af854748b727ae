"""Generate workload/tpuft_workload/data/dolly-mini.jsonl: a small dolly-15k-shaped dataset.

Records have instruction / context / response / category like databricks-dolly-15k, with
lengths varied from a few words to a few hundred (log-normal, long tail), built from a
small vocabulary of facts so a tiny model can visibly learn it. Deterministic (seeded):

    python workload/scripts/gen_dolly_mini.py            # writes the shipped file
    python workload/scripts/gen_dolly_mini.py --n 300 --out /tmp/x.jsonl
"""
from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tpuft_workload" / "data" / "dolly-mini.jsonl"

THINGS = {
    # name: (color, place, size, food, sound)
    "cat": ("grey", "house", "small", "fish", "meows"),
    "dog": ("brown", "yard", "medium", "meat", "barks"),
    "cow": ("black", "farm", "large", "grass", "moos"),
    "owl": ("white", "forest", "small", "mice", "hoots"),
    "horse": ("brown", "stable", "large", "hay", "neighs"),
    "duck": ("yellow", "pond", "small", "bread", "quacks"),
    "lion": ("golden", "savanna", "large", "zebras", "roars"),
    "frog": ("green", "pond", "tiny", "flies", "croaks"),
    "sheep": ("white", "farm", "medium", "grass", "bleats"),
    "bee": ("yellow", "garden", "tiny", "nectar", "buzzes"),
    "wolf": ("grey", "forest", "medium", "deer", "howls"),
    "pig": ("pink", "farm", "medium", "corn", "oinks"),
}
CITIES = {
    "Paris": ("France", "Seine", "art"), "Rome": ("Italy", "Tiber", "history"),
    "Cairo": ("Egypt", "Nile", "pyramids"), "London": ("England", "Thames", "theatre"),
    "Vienna": ("Austria", "Danube", "music"), "Tokyo": ("Japan", "Sumida", "technology"),
    "Lisbon": ("Portugal", "Tagus", "tiles"), "Prague": ("Czechia", "Vltava", "bridges"),
}
FILLER = [
    "This is a well known fact.", "Many people learn this at school.",
    "It is easy to remember once you see it.", "Books and teachers often repeat it.",
    "You can check it in any encyclopedia.", "Travellers often notice it first.",
    "Children like to talk about it.", "It has been true for a long time.",
    "Scientists have studied it for many years.", "It appears in many old stories.",
]
CATEGORIES = ["open_qa", "closed_qa", "classification", "information_extraction",
              "brainstorming", "summarization", "general_qa", "creative_writing"]


def _animal_fact(rng: random.Random, name: str) -> str:
    color, place, size, food, sound = THINGS[name]
    return rng.choice([
        f"The {name} is {color} and lives on the {place}." if place == "farm" else
        f"The {name} is {color} and lives in the {place}.",
        f"A {size} {name} eats {food}.",
        f"The {name} {sound} when it is hungry.",
        f"A {name} is a {size} animal that eats {food}.",
    ])


def _city_fact(rng: random.Random, city: str) -> str:
    country, river, fame = CITIES[city]
    return rng.choice([
        f"{city} is the capital of {country}.",
        f"The river {river} flows through {city}.",
        f"{city} is famous for {fame}.",
        f"{city} in {country} is known for {fame} and the river {river}.",
    ])


def _paragraph(rng: random.Random, n_sentences: int, subject_facts) -> str:
    out = []
    for _ in range(n_sentences):
        out.append(subject_facts() if rng.random() < 0.7 else rng.choice(FILLER))
    return " ".join(out)


def _length(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(round(math.exp(rng.gauss(math.log(median), sigma))))))


def make_record(rng: random.Random) -> dict:
    category = rng.choice(CATEGORIES)
    animal = rng.choice(sorted(THINGS))
    city = rng.choice(sorted(CITIES))
    is_animal = rng.random() < 0.5
    about = animal if is_animal else city

    def facts() -> str:
        return _animal_fact(rng, animal) if is_animal else _city_fact(rng, city)

    n = _length(rng, median=4, sigma=0.9, lo=1, hi=40)  # sentences in the response
    context = ""
    if category in ("closed_qa", "information_extraction", "summarization"):
        context = _paragraph(rng, _length(rng, 5, 0.8, 2, 40), facts)
    instruction = {
        "open_qa": f"What do you know about the {about}?" if about in THINGS else f"What do you know about {about}?",
        "closed_qa": "Using the passage, answer the question: what is described here?",
        "classification": f"Is the {about} an animal or a city?" if about in THINGS else f"Is {about} an animal or a city?",
        "information_extraction": "List the facts mentioned in the passage.",
        "brainstorming": f"Give some ideas about the {about}." if about in THINGS else f"Give some ideas for a trip to {about}.",
        "summarization": "Summarize the passage in a few sentences.",
        "general_qa": f"Tell me about {about}.",
        "creative_writing": f"Write a short story about {about}.",
    }[category]
    if category == "classification":
        response = (f"The {about} is an animal." if about in THINGS else f"{about} is a city.")
        if n > 1:
            response += " " + _paragraph(rng, n - 1, facts)
    else:
        response = _paragraph(rng, n, facts)
    return {"instruction": instruction, "context": context, "response": response, "category": category}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--seed", type=int, default=15)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w") as f:
        for _ in range(a.n):
            f.write(json.dumps(make_record(rng), sort_keys=True) + "\n")
    print(f"wrote {a.n} records to {a.out}")


if __name__ == "__main__":
    main()
