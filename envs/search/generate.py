"""Generates the search env's corpus and multi-hop questions (envs/search/data/), reproducibly.

A fictional world keeps answers unique and unknowable without retrieval: countries with capitals,
cities (country, river, founding year), people (birth city and year, profession) and companies
(founder, headquarters city, product, founding year). Every person founds at most one company and
every city hosts at most one headquarters, so each question below has exactly one answer. One
document per entity states its facts; a question needs two or three of them.

    python -m envs.search.generate     # writes data/corpus.jsonl and data/questions.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).with_name("data")
ONSETS = ("b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "kr", "l", "m", "n", "p", "r", "s", "st", "t", "tr",
          "v", "z", "th", "sh")
VOWELS = ("a", "e", "i", "o", "u", "ae", "io", "ou")
CODAS = ("", "", "n", "r", "l", "s", "th", "nd", "rk", "x")
PROFESSIONS = ("architect", "chemist", "engineer", "painter", "physician", "poet", "sailor", "astronomer",
               "botanist", "merchant")
PRODUCTS = ("glass lenses", "steam valves", "copper wire", "wool blankets", "clock springs", "paper maps",
            "salt crackers", "canvas sails", "iron stoves", "ink pens", "river barges", "silk rope")


@dataclass
class World:
    countries: dict  # name -> {"capital"}
    cities: dict  # name -> {"country", "river", "founded"}
    people: dict  # name -> {"city", "born", "profession"}
    companies: dict  # name -> {"founder", "city", "product", "founded"}


class Names:
    """Pronounceable fictional names, never repeated within one world."""

    def __init__(self, rng: random.Random):
        self.rng, self.used = rng, set()

    def __call__(self, syllables: int) -> str:
        while True:
            name = "".join(self.rng.choice(ONSETS) + self.rng.choice(VOWELS) + self.rng.choice(CODAS)
                           for _ in range(syllables)).capitalize()
            if name not in self.used and len(name) >= 4:
                self.used.add(name)
                return name


def make_world(rng: random.Random, n_countries=10, n_cities=80, n_people=150, n_companies=60) -> World:
    name = Names(rng)
    rivers = [name(2) for _ in range(20)]
    countries = {name(3): {} for _ in range(n_countries)}
    cities = {name(2): {"country": c, "river": rng.choice(rivers), "founded": rng.randint(900, 1700)}
              for c in list(countries) * (n_cities // n_countries)}
    for country in countries:
        countries[country]["capital"] = rng.choice([c for c, v in cities.items() if v["country"] == country])
    people = {f"{name(2)} {name(2)}": {"city": rng.choice(list(cities)), "born": rng.randint(1800, 1990),
                                       "profession": rng.choice(PROFESSIONS)} for _ in range(n_people)}
    founders, hqs = rng.sample(list(people), n_companies), rng.sample(list(cities), n_companies)
    companies = {f"{name(2)} {rng.choice(('Works', 'Company', 'Guild', 'Mills', 'Trading'))}":
                 {"founder": f, "city": h, "product": rng.choice(PRODUCTS),
                  "founded": people[f]["born"] + rng.randint(20, 50)} for f, h in zip(founders, hqs)}
    return World(countries, cities, people, companies)


def documents(world: World) -> list[dict]:
    founded_by = {v["founder"]: c for c, v in world.companies.items()}
    docs = []
    for country, v in world.countries.items():
        members = sorted(c for c, cv in world.cities.items() if cv["country"] == country)
        docs.append((country, f"{country} is a country. Its capital is {v['capital']}. Its cities include "
                              f"{', '.join(members)}."))
    for city, v in world.cities.items():
        docs.append((city, f"{city} is a city in {v['country']}, founded in {v['founded']}. The river {v['river']} "
                           f"flows through {city}."))
    for person, v in world.people.items():
        article = "an" if v["profession"][0] in "aeiou" else "a"
        text = f"{person} is {article} {v['profession']} born in {v['born']} in the city of {v['city']}."
        if person in founded_by:
            text += f" {person} founded {founded_by[person]}."
        docs.append((person, text))
    for company, v in world.companies.items():
        docs.append((company, f"{company} makes {v['product']}. It was founded in {v['founded']} by {v['founder']} "
                              f"and has its headquarters in {v['city']}."))
    return [{"doc_id": f"d{i:04d}", "title": title, "text": text} for i, (title, text) in enumerate(docs)]


def questions(world: World, rng: random.Random, per_template: int) -> list[dict]:
    """Multi-hop questions with their unique answers and the hop count."""
    W, hq = world, {v["city"]: c for c, v in world.companies.items()}
    templates = [
        (W.companies, 3, lambda c: f"In which country was the founder of {c} born?",
         lambda c: W.cities[W.people[W.companies[c]["founder"]]["city"]]["country"]),
        (W.people, 3, lambda p: f"What is the capital of the country where {p} was born?",
         lambda p: W.countries[W.cities[W.people[p]["city"]]["country"]]["capital"]),
        (W.companies, 2, lambda c: f"Which river flows through the city where {c} has its headquarters?",
         lambda c: W.cities[W.companies[c]["city"]]["river"]),
        (W.companies, 2, lambda c: f"In what year was the founder of {c} born?",
         lambda c: str(W.people[W.companies[c]["founder"]]["born"])),
        (hq, 2, lambda city: f"What is the profession of the founder of the company headquartered in {city}?",
         lambda city: W.people[W.companies[hq[city]]["founder"]]["profession"]),
        (W.people, 2, lambda p: f"In what year was the city where {p} was born founded?",
         lambda p: str(W.cities[W.people[p]["city"]]["founded"])),
    ]
    out = []
    for kind, (pool, hops, ask, answer) in enumerate(templates):
        for subject in rng.sample(sorted(pool), per_template):
            out.append({"question": ask(subject), "answer": answer(subject), "hops": hops, "template": kind})
    rng.shuffle(out)
    return [{"task_id": f"q-{i:04d}", **q} for i, q in enumerate(out)]


def generate(seed: int = 0, per_template: int = 50) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    world = make_world(rng)
    return documents(world), questions(world, rng, per_template)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-template", type=int, default=50)
    parser.add_argument("--out", type=Path, default=DATA)
    args = parser.parse_args()
    corpus, qs = generate(args.seed, args.per_template)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("corpus.jsonl", corpus), ("questions.jsonl", qs)):
        (args.out / name).write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    print(f"wrote {len(corpus)} documents and {len(qs)} questions to {args.out}")


if __name__ == "__main__":
    main()
