"""The test prompts, shared by the engine runner (vLLM's environment) and the tests (kvstore's)."""

import random

VOCAB = 400  # the tiny Llama's tokenizer has a few more ids; stay below


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, VOCAB) for _ in range(length)]
