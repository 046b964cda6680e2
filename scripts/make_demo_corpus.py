"""Generate the deterministic demo corpus used by the elastictrain examples.

The text is produced from a small hand-written grammar about a coastal
village, its lighthouse keeper, passing ships and the weather. It is entirely
synthetic: every word list and sentence template below was written for this
project. The output depends only on the seed and the target size, so running
the script twice yields byte-identical files.

Example:
    python scripts/make_demo_corpus.py --out elastictrain/demo/data/corpus.txt
"""

from __future__ import annotations

import argparse
import random
import textwrap
from pathlib import Path

DEFAULT_SEED = 1729
DEFAULT_SIZE_BYTES = 150_000
DEFAULT_OUT = (
    Path(__file__).resolve().parent.parent / "elastictrain" / "demo" / "data" / "corpus.txt"
)

KEEPERS = [
    "Old Maren",
    "the keeper",
    "Tobin Vale",
    "the lamp warden",
    "Edda Rusk",
    "the night watcher",
]
VILLAGERS = [
    "the baker",
    "the net mender",
    "a fisherman",
    "the schoolteacher",
    "the miller's boy",
    "a widow from the upper lane",
    "the harbour clerk",
    "two sisters",
    "the cooper",
    "a tinker",
]
SHIPS = [
    "the Grey Heron",
    "the Saltwren",
    "a coal barge",
    "the Morning Lantern",
    "a herring boat",
    "the Ninefold",
    "a tall schooner",
    "the Patient Ann",
    "a ferry from the south",
    "the Quillback",
]
PLACES = [
    "the harbour",
    "the upper lane",
    "the chapel yard",
    "the long pier",
    "the rope walk",
    "the mill race",
    "the salt flats",
    "the north cliff",
    "the market square",
    "the tide pools",
]
THINGS = [
    "the great lamp",
    "a brass telescope",
    "the logbook",
    "a coil of rope",
    "the fog bell",
    "a tin of oil",
    "the spare wicks",
    "a basket of bread",
    "the tide table",
    "an oilskin coat",
    "a clay pipe",
    "the storm shutters",
]
WEATHER_NOUNS = ["wind", "rain", "fog", "sleet", "mist", "gale", "squall", "drizzle", "haze"]
WEATHER_ADJ = [
    "cold",
    "bitter",
    "soft",
    "grey",
    "heavy",
    "restless",
    "thin",
    "wild",
    "steady",
    "slow",
]
SKY = [
    "the sky turned the colour of pewter",
    "low clouds rolled in from the west",
    "the stars came out one by one",
    "a pale moon rose over the cliffs",
    "the horizon vanished behind a wall of cloud",
    "the light was thin and silver",
    "the clouds broke apart like wet paper",
    "the dusk came early and stayed long",
]
SEA = [
    "the sea was flat as a slate",
    "long swells broke against the rocks",
    "the tide crept up the shingle",
    "white horses ran across the bay",
    "the water was dark and heavy",
    "foam gathered in the cracks of the pier",
    "the current pulled hard toward the point",
    "the waves were small and quarrelsome",
]
TIMES = [
    "At dawn",
    "Before the bells rang",
    "Late in the afternoon",
    "Long after supper",
    "In the small hours",
    "On the third night",
    "Toward evening",
    "When the tide turned",
    "Early on market day",
    "Just before the storm",
]
VERBS_THING = [
    "polished",
    "carried",
    "mended",
    "checked",
    "wound",
    "cleaned",
    "counted",
    "fetched",
    "inspected",
    "set down",
    "picked up",
    "oiled",
]
VERBS_PLACE = [
    "walked down to",
    "hurried along",
    "climbed up to",
    "wandered through",
    "stood at the edge of",
    "waited by",
    "looked out over",
    "crossed",
]
FEELINGS = [
    "tired",
    "uneasy",
    "content",
    "restless",
    "hopeful",
    "quiet",
    "stubborn",
    "curious",
    "worried",
    "cheerful",
]
SAYINGS = [
    "A lamp is only as good as the hand that trims it",
    "The sea keeps no promises",
    "Fog lies, but the bell tells the truth",
    "Count the ships out and count them home",
    "Never trust a calm on a Friday",
    "Oil the hinge before it sings",
    "A short rope is worse than none",
    "The tide waits, but not for long",
]
QUESTIONS = [
    "Did you see her lights",
    "Will the wind hold until morning",
    "Who left the gate open",
    "Is the bread still warm",
    "How many came in tonight",
    "Where did the gulls go",
    "Has the post arrived",
    "What did the glass say",
]
REPLIES = [
    "Not yet",
    "I think so",
    "Ask the clerk",
    "Only two",
    "Nobody knows",
    "Before noon, with luck",
    "The glass is falling",
    "Go and look for yourself",
]


def _cap(text: str) -> str:
    """Upper-case the first character only (``str.capitalize`` lowers the rest)."""
    return text[:1].upper() + text[1:]


def _sentence(rng: random.Random) -> str:
    """Return one sentence built from a randomly chosen template."""
    keeper = rng.choice(KEEPERS)
    villager = rng.choice(VILLAGERS)
    ship = rng.choice(SHIPS)
    place = rng.choice(PLACES)
    thing = rng.choice(THINGS)
    when = rng.choice(TIMES)
    adj, adj2 = rng.choice(WEATHER_ADJ), rng.choice(WEATHER_ADJ)
    noun = rng.choice(WEATHER_NOUNS)
    sky, sea = rng.choice(SKY), rng.choice(SEA)
    act, go = rng.choice(VERBS_THING), rng.choice(VERBS_PLACE)
    templates = [
        f"{when}, {keeper} {act} {thing}.",
        f"The {adj} {noun} came in over {place}, and {sky}.",
        f"{_cap(ship)} rounded the point at {rng.randint(2, 11)} o'clock, and {sea}.",
        f"{_cap(villager)} {go} {place} with {thing}.",
        f'"{rng.choice(QUESTIONS)}?" asked {villager}. "{rng.choice(REPLIES)}," said {keeper}.',
        f'{_cap(keeper)} used to say, "{rng.choice(SAYINGS)}."',
        f"By then {sea}, and {keeper} felt {rng.choice(FEELINGS)}.",
        f"There were {rng.randint(2, 9)} boats off {place} that day; "
        f"{rng.choice(SHIPS)} was the last to leave.",
        f"{_cap(sky)}; still, {villager} {act} {thing} as if nothing had changed.",
        f"In the logbook {keeper} wrote: {noun}, {adj}; {ship} sighted, all well.",
        f"Nobody in {place} spoke of {ship} again, though {villager} often wondered.",
        f"{when} the {noun} eased, and {villager} {go} {place}.",
        f"It was {adj} and {adj2} weather, the kind {keeper} knew too well.",
        f"{_cap(keeper)} {go} {place} and watched for {ship}.",
    ]
    return rng.choice(templates)


def _paragraph(rng: random.Random) -> str:
    """Return a paragraph of a few sentences, wrapped to a fixed width."""
    body = " ".join(_sentence(rng) for _ in range(rng.randint(3, 7)))
    return textwrap.fill(body, width=76)


def generate_corpus(seed: int = DEFAULT_SEED, size_bytes: int = DEFAULT_SIZE_BYTES) -> str:
    """Generate the corpus text.

    Paragraphs are appended until the text reaches ``size_bytes``, so the result
    ends on a paragraph boundary and is at least that long.

    Args:
        seed: Seed for the private ``random.Random`` instance.
        size_bytes: Minimum size of the generated text in bytes.

    Returns:
        Printable ASCII text with newlines, ending in a single newline.
    """
    rng = random.Random(seed)
    chapter = 0
    parts: list[str] = []
    total = 0
    while total < size_bytes:
        if chapter == 0 or rng.random() < 0.06:
            chapter += 1
            piece = f"Chapter {chapter}\n\n"
        else:
            piece = _paragraph(rng) + "\n\n"
        parts.append(piece)
        total += len(piece)
    return "".join(parts).rstrip("\n") + "\n"


def write_corpus(out: Path, seed: int = DEFAULT_SEED, size_bytes: int = DEFAULT_SIZE_BYTES) -> int:
    """Generate the corpus and write it to ``out``.

    Args:
        out: Destination file; parent directories are created as needed.
        seed: Seed passed to :func:`generate_corpus`.
        size_bytes: Target size passed to :func:`generate_corpus`.

    Returns:
        The number of bytes written.
    """
    data = generate_corpus(seed, size_bytes).encode("ascii")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    return len(data)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output file")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="random seed")
    parser.add_argument(
        "--size-bytes", type=int, default=DEFAULT_SIZE_BYTES, help="minimum output size"
    )
    args = parser.parse_args(argv)
    written = write_corpus(args.out, args.seed, args.size_bytes)
    print(f"wrote {written} bytes to {args.out}")


if __name__ == "__main__":
    main()
