"""A built-in set of short chat instructions, written for this project.

They are deliberately small tasks a 135M-parameter instruct model can attempt in a few dozen
tokens (one sentence, a short list, a definition, a rewrite), varied in kind so that a judge has
something to compare. ``REFERENCE_ANSWERS`` holds a clearly good short answer for some of them; the
judge's calibration pairs (good vs empty / off-topic / repetitive / truncated) are built from them.
"""

from __future__ import annotations

PROMPTS: tuple[str, ...] = (
    # explain / define
    "Explain what a rainbow is in one sentence.",
    "What is photosynthesis? Answer briefly.",
    "Define the word 'gravity' for a child.",
    "What does a thermometer measure?",
    "Explain why the sky is blue in two sentences.",
    "What is the difference between weather and climate?",
    "What is a noun? Give one example.",
    "Why do we need sleep? Answer in one sentence.",
    "What is the capital of France, and what river runs through it?",
    "Explain what a computer virus is in simple words.",
    "What is the boiling point of water at sea level?",
    "Why do leaves change color in autumn?",
    # lists
    "Name three fruits that are red.",
    "List three tips for staying healthy.",
    "Give three reasons to learn a second language.",
    "Name four planets in our solar system.",
    "List three things you can do to save water at home.",
    "Name three animals that live in the ocean.",
    "Give two examples of renewable energy.",
    "List three common kitchen tools.",
    "Name three colors of the rainbow.",
    "List three ways to be kind to a friend.",
    # writing
    "Write a short greeting for a birthday card.",
    "Write one sentence describing a sunny morning.",
    "Write a two-line poem about the moon.",
    "Write a polite email subject line asking for a meeting.",
    "Write a short thank-you note to a teacher.",
    "Describe a cat in one sentence.",
    "Write a slogan for a bicycle shop.",
    "Write a one-sentence story about a lost key.",
    "Write a short weather report for a rainy day.",
    "Describe your ideal weekend in two sentences.",
    # rewrite / transform
    "Rewrite this sentence more politely: 'Give me the book.'",
    "Make this sentence shorter: 'In my personal opinion, I think that the movie was very good.'",
    "Turn this into a question: 'The train leaves at noon.'",
    "Correct the spelling: 'I recieved the pakage yesterday.'",
    "Summarize in one sentence: 'Bees collect nectar from flowers and turn it into honey, "
    "which they store in their hives to eat during winter.'",
    "Translate 'good morning' into Spanish.",
    "Give the opposite of the word 'ancient'.",
    "Give a synonym for the word 'happy'.",
    # advice / how-to
    "How do I boil an egg?",
    "Give me one tip for studying better.",
    "How can I fall asleep faster?",
    "What should I pack for a day at the beach?",
    "How do I make a cup of tea?",
    "Suggest a name for a pet goldfish.",
    "What is a good way to start a conversation with someone new?",
    "How can I keep my houseplants alive?",
    # simple facts / reasoning
    "How many days are in a week?",
    "What is 7 plus 5?",
    "Which is heavier, a kilogram of feathers or a kilogram of iron?",
    "What comes after Tuesday?",
    "How many legs does a spider have?",
    "If I have three apples and eat one, how many are left?",
    "What season comes after winter?",
    "Is the sun a star or a planet?",
    "What do bees make?",
    "Which ocean is the largest?",
    "What is the main ingredient of bread?",
    "What gas do people need to breathe?",
)

# A clearly good short answer for some prompts (used to build the judge's calibration pairs).
REFERENCE_ANSWERS: dict[str, str] = {
    "Explain what a rainbow is in one sentence.":
        "A rainbow is an arc of colors in the sky that appears when sunlight is bent and reflected "
        "by raindrops.",
    "What is photosynthesis? Answer briefly.":
        "Photosynthesis is the process plants use to turn sunlight, water and carbon dioxide into "
        "sugar and oxygen.",
    "What does a thermometer measure?": "A thermometer measures temperature, how hot or cold something is.",
    "Why do we need sleep? Answer in one sentence.":
        "We need sleep so our body and brain can rest, repair themselves and store memories.",
    "What is the capital of France, and what river runs through it?":
        "The capital of France is Paris, and the Seine river runs through it.",
    "Why do leaves change color in autumn?":
        "In autumn trees stop making green chlorophyll, so the yellow and orange pigments in the "
        "leaves become visible.",
    "Name three fruits that are red.": "Three red fruits are strawberries, cherries and raspberries.",
    "List three tips for staying healthy.":
        "1. Eat plenty of fruit and vegetables. 2. Exercise regularly. 3. Get enough sleep.",
    "Name four planets in our solar system.": "Four planets in our solar system are Mercury, Venus, Earth and Mars.",
    "Name three animals that live in the ocean.": "Dolphins, sharks and octopuses all live in the ocean.",
    "Give two examples of renewable energy.": "Two examples of renewable energy are solar power and wind power.",
    "List three common kitchen tools.": "Three common kitchen tools are a knife, a cutting board and a frying pan.",
    "Write a short greeting for a birthday card.":
        "Happy birthday! Wishing you a wonderful day filled with joy, laughter and cake.",
    "Write one sentence describing a sunny morning.":
        "The morning sun spilled warm golden light across the quiet street as the birds began to sing.",
    "Describe a cat in one sentence.":
        "A cat is a small, furry animal with soft paws, sharp claws and a curious, independent nature.",
    "Rewrite this sentence more politely: 'Give me the book.'": "Could you please give me the book?",
    "Turn this into a question: 'The train leaves at noon.'": "Does the train leave at noon?",
    "Translate 'good morning' into Spanish.": "'Good morning' in Spanish is 'buenos días'.",
    "How do I boil an egg?":
        "Place the egg in a pot of water, bring it to a boil, then simmer for about nine minutes and "
        "cool it in cold water.",
    "How do I make a cup of tea?":
        "Boil water, pour it over a tea bag in a cup, let it steep for three to five minutes, then "
        "remove the bag and add milk or sugar if you like.",
    "How many legs does a spider have?": "A spider has eight legs.",
    "What season comes after winter?": "Spring comes after winter.",
    "What do bees make?": "Bees make honey and beeswax.",
    "Which ocean is the largest?": "The Pacific Ocean is the largest ocean on Earth.",
    "What is the main ingredient of bread?": "The main ingredient of bread is flour, usually made from wheat.",
    "What gas do people need to breathe?": "People need oxygen to breathe.",
    "Give me one tip for studying better.":
        "Study in short, focused sessions with breaks in between, and test yourself on what you learned.",
    "How can I keep my houseplants alive?":
        "Give them the right amount of light, water them only when the soil is dry, and use a pot "
        "with drainage holes.",
}


def builtin_prompts() -> list[str]:
    """The built-in instructions, in a fixed order."""
    return list(PROMPTS)


CALIBRATION_KINDS = ("empty", "offtopic", "offtopic2", "rep_word", "repetitive", "truncated")


def calibration_pairs(kinds: tuple[str, ...] = CALIBRATION_KINDS, limit: int | None = None) -> list[tuple[str, str, str, str]]:
    """(kind, instruction, good answer, bad answer) built from ``REFERENCE_ANSWERS``.

    Kinds of bad answer: ``empty``; ``offtopic`` (the reference answer of another prompt);
    ``offtopic2`` (one fixed fluent sentence about something else); ``rep_word`` (the first word
    twenty times); ``repetitive`` (the first three words eight times); ``truncated`` (the first
    40 % of the words, at least two).
    """
    unknown = [k for k in kinds if k not in CALIBRATION_KINDS]
    if unknown:
        raise ValueError(f"unknown calibration kind(s) {unknown}; valid: {', '.join(CALIBRATION_KINDS)}")
    items = list(REFERENCE_ANSWERS.items())[:limit]
    everything = list(REFERENCE_ANSWERS.items())
    pairs = []
    for i, (prompt, good) in enumerate(items):
        words = good.split()
        bad = {
            "empty": "",
            "offtopic": everything[(i + 7) % len(everything)][1],
            "offtopic2": "I like to play football with my friends on Sunday.",
            "rep_word": " ".join([words[0]] * 20),
            "repetitive": " ".join(words[:3] * 8),
            "truncated": " ".join(words[: max(2, len(words) * 2 // 5)]),
        }
        pairs.extend((kind, prompt, good, bad[kind]) for kind in kinds)
    return pairs
