"""Generate the bundled toy corpus: short templated English documents, one per line.

Every document mixes fixed facts (capitals, animal sounds, colours, opposites, counting) with
randomly filled templates (small stories, simple sums). The facts repeat, so a tiny model from
scratch learns them within a minute or two and a greedy sample like "the capital of france is"
visibly turns into "paris"; the templates give it grammar to learn. The validation split is drawn
from the same distribution with another seed.

    python examples/data/make_data.py        # rewrites train.txt and validation.txt beside this file
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

CAPITALS = {
    "france": "paris", "spain": "madrid", "italy": "rome", "germany": "berlin", "japan": "tokyo",
    "china": "beijing", "egypt": "cairo", "peru": "lima", "kenya": "nairobi", "canada": "ottawa",
    "norway": "oslo", "greece": "athens", "ireland": "dublin", "poland": "warsaw", "india": "delhi",
    "chile": "santiago", "cuba": "havana", "russia": "moscow", "portugal": "lisbon", "austria": "vienna",
}
SOUNDS = {
    "cow": "moo", "dog": "woof", "cat": "meow", "duck": "quack", "sheep": "baa", "owl": "hoot",
    "lion": "roar", "snake": "hiss", "frog": "croak", "horse": "neigh", "bee": "buzz", "mouse": "squeak",
}
COLOURS = {
    "sky": "blue", "grass": "green", "snow": "white", "coal": "black", "sun": "yellow", "blood": "red",
    "sea": "blue", "banana": "yellow", "carrot": "orange", "night": "dark", "leaf": "green", "cherry": "red",
}
OPPOSITES = {
    "hot": "cold", "big": "small", "fast": "slow", "up": "down", "happy": "sad", "old": "young",
    "light": "dark", "early": "late", "full": "empty", "open": "closed", "wet": "dry", "loud": "quiet",
}
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
           "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
           "nineteen", "twenty"]
NAMES = ["anna", "ben", "clara", "david", "emma", "felix", "grace", "henry", "iris", "jack", "lena", "max",
         "nora", "oscar", "paula", "sam"]
PLACES = ["market", "park", "library", "beach", "school", "garden", "station", "bakery", "museum", "river"]
ITEMS = ["apples", "books", "pears", "cakes", "shells", "flowers", "stamps", "pencils", "cookies", "stones"]
FEELINGS = ["happy", "tired", "hungry", "calm", "excited", "sleepy"]


def fact(rng: random.Random) -> str:
    kind = rng.randrange(5)
    if kind == 0:
        country, city = rng.choice(list(CAPITALS.items()))
        return f"the capital of {country} is {city} ."
    if kind == 1:
        animal, sound = rng.choice(list(SOUNDS.items()))
        return rng.choice([f"the {animal} says {sound} .", f"a {animal} says {sound} ."])
    if kind == 2:
        thing, colour = rng.choice(list(COLOURS.items()))
        return f"the {thing} is {colour} ."
    if kind == 3:
        word, other = rng.choice(list(OPPOSITES.items()))
        if rng.random() < 0.5:
            word, other = other, word
        return f"the opposite of {word} is {other} ."
    start = rng.randrange(0, 15)
    length = rng.randrange(3, 6)
    return "counting : " + " ".join(NUMBERS[start:start + length]) + " ."


def story(rng: random.Random) -> str:
    name = rng.choice(NAMES)
    friend = rng.choice([n for n in NAMES if n != name])
    place, item = rng.choice(PLACES), rng.choice(ITEMS)
    a, b = rng.randrange(1, 10), rng.randrange(1, 10)
    return (f"{name} went to the {place} with {friend} . {name} found {NUMBERS[a]} {item} and {friend} found "
            f"{NUMBERS[b]} {item} . together they had {NUMBERS[a + b]} {item} . {name} was "
            f"{rng.choice(FEELINGS)} .")


def document(rng: random.Random) -> str:
    parts = [fact(rng) for _ in range(rng.randrange(1, 4))]
    if rng.random() < 0.5:
        parts.insert(rng.randrange(len(parts) + 1), story(rng))
    return " ".join(parts)


def write(path: Path, count: int, seed: int) -> None:
    rng = random.Random(seed)
    path.write_text("\n".join(document(rng) for _ in range(count)) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--train", type=int, default=2400, help="training documents")
    parser.add_argument("--validation", type=int, default=200, help="validation documents")
    args = parser.parse_args()
    write(args.out_dir / "train.txt", args.train, seed=0)
    write(args.out_dir / "validation.txt", args.validation, seed=1)


if __name__ == "__main__":
    main()
