"""A local verifiers environment under verifiers_rl's default id, `reverse-text` (the Environments Hub
module of that id is installed by `prime env install` from Prime Intellect's hub, not from PyPI, and
reads a hub dataset): reverse a short text, rewarded by the longest-common-subsequence ratio of the
parsed answer to the reversed text. Its texts are generated here."""

import difflib
import random

import verifiers as vf
from datasets import Dataset

WORDS = "river stone maple cloud amber lantern quiet harbor violet meadow copper signal".split()


def load_environment(num_examples: int = 64, seed: int = 0) -> vf.Environment:
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5))) for _ in range(num_examples)]
    dataset = Dataset.from_list([{"question": t, "answer": t[::-1]} for t in texts])
    parser = vf.XMLParser(["answer"], answer_field="answer")

    def lcs_reward(completion, answer, **kwargs) -> float:
        guess = parser.parse_answer(completion) or ""
        return difflib.SequenceMatcher(None, guess, answer).ratio()

    return vf.SingleTurnEnv(
        dataset=dataset,
        system_prompt=f"Reverse the given text character by character. {parser.get_format_str()}",
        parser=parser,
        rubric=vf.Rubric(funcs=[lcs_reward], parser=parser),
    )
