"""Synthetic workloads: random token-id prompts with lengths uniform in a range (nano-vllm's offline workload)."""

from __future__ import annotations

import random
from dataclasses import dataclass


def parse_range(text: str) -> tuple[int, int]:
    """"128" -> (128, 128); "100-1024" or "100,1024" -> (100, 1024)."""
    parts = text.replace(",", "-").split("-")
    try:
        low, high = (int(parts[0]), int(parts[-1]))
    except ValueError:
        raise ValueError(f"a length range is N or LOW-HIGH, got {text!r}") from None
    if len(parts) > 2 or low < 1 or high < low:
        raise ValueError(f"a length range is N or LOW-HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return low, high


FIRST_ID, LAST_ID = 100, 32000  # prompt ids come from [FIRST_ID, min(vocab, LAST_ID)): past the special tokens


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def shifted(self, k: int, vocab_size: int) -> "Workload":
        """The same lengths with every prompt token moved k * 1009 places within random_workload's range of ids: a
        run of it finds nothing of an earlier run's prompts in the prefix cache (k = 0: this workload)."""
        low, high = FIRST_ID, min(vocab_size, LAST_ID)
        offset = (1009 * k) % (high - low)
        if k and not offset:  # a range of a multiple of 1009 ids
            offset = 1
        prompts = [[low + (t - low + offset) % (high - low) for t in p] for p in self.prompts]
        return Workload(prompts, list(self.output_lens))


def random_workload(num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int],
                    vocab_size: int, seed: int = 0, avoid_ids: set[int] = frozenset()) -> Workload:
    rng = random.Random(seed)
    usable = [t for t in range(FIRST_ID, min(vocab_size, LAST_ID)) if t not in avoid_ids]
    prompts = [[rng.choice(usable) for _ in range(rng.randint(*input_len))] for _ in range(num_prompts)]
    outputs = [rng.randint(*output_len) for _ in range(num_prompts)]
    return Workload(prompts, outputs)


# Input-grounded work (speculative decoding's case): the prompt holds a passage the answer repeats. The passages
# are this project's own text, long enough that the answer is still copying when the output length is reached.
PASSAGES = (
    "The harbour town wakes before the sun. Fishing boats leave the long stone pier one after another, their "
    "engines coughing in the cold air, while the baker on the corner pulls the first trays of bread from an oven "
    "that has been warm since midnight. By seven the market square is full: crates of silver fish on crushed ice, "
    "baskets of apples from the hill farms, coils of rope, tin buckets, and a man who sharpens knives on a stone "
    "wheel he turns with his foot. Children run between the stalls on their way to school, and the old women who "
    "sit by the fountain every morning argue about the weather, the price of coffee and whose grandson will marry "
    "first. At noon the boats come back, gulls circling over them, and the whole town smells of salt and diesel "
    "and fresh bread until the wind turns in the afternoon and carries it all out to sea.",
    "A good recipe for a simple loaf needs only four things: flour, water, salt and yeast. Mix five hundred grams "
    "of strong white flour with ten grams of salt and seven grams of dried yeast in a large bowl. Pour in three "
    "hundred and fifty millilitres of warm water and stir until a rough dough forms. Turn it out onto a floured "
    "table and knead it for ten minutes, pushing it away with the heel of your hand and folding it back, until it "
    "is smooth and springs back when pressed. Put it back in the bowl, cover it with a damp cloth and leave it "
    "somewhere warm for an hour, until it has doubled in size. Knock it back, shape it into a round, place it on a "
    "baking tray and let it rise for another forty minutes. Bake it at two hundred and twenty degrees for thirty "
    "minutes, until the crust is golden and the loaf sounds hollow when tapped underneath. Let it cool before you cut it.",
)
PROMPT = "Repeat the following passage exactly.\n\n{passage}\n\nPassage: "  # a completion prompt: the model copies


def grounded_workload(num_prompts: int, output_len: int, tokenizer, vocab_size: int, seed: int = 0,
                      passage_len: int = 300) -> Workload:
    """Prompts that ask for a passage in them to be repeated (plain completion text), the passages taking turns. Without a tokenizer (token-id-only models), a random passage of ids, a separator and its
    first tokens again: the same shape, for speed runs whose weights copy nothing anyway."""
    prompts = []
    for i in range(num_prompts):
        if tokenizer is not None:
            prompts.append(tokenizer.encode(PROMPT.format(passage=PASSAGES[i % len(PASSAGES)])))
        else:
            passage = random_workload(1, (passage_len, passage_len), (1, 1), vocab_size, seed=seed + i).prompts[0]
            prompts.append(passage + [FIRST_ID] + passage[:8])
    return Workload(prompts, [output_len] * num_prompts)
