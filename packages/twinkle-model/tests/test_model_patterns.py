"""Module patterns (peft's string target_modules) on the linear-time matcher of twinkle.model.patterns:
the same answers as `re.fullmatch` on random patterns and as peft on the module names of a real model,
work bounded by the name's length times the pattern's size (counted, not timed), refusals by name."""

from __future__ import annotations

import itertools
import random
import re
import warnings

import pytest
from peft import LoraConfig
from peft.tuners.tuners_utils import check_target_module_exists

from twinkle.model.multi_lora.spec import AdapterSpec
from twinkle.model.patterns import Pattern, PatternError, compile_pattern
from twinkle.model.patterns.syntax import parse

# what peft users write for target_modules (HF docs, model cards, LLaMA-Factory / axolotl configs)
PEFT_PATTERNS = [
    r".*\.(q_proj|v_proj)",
    r".*(q_proj|k_proj|v_proj|o_proj)",
    r"model\.layers\.\d+\.mlp\..*",
    r"(?:.*\.)?(gate|up)_proj",
    r".*mlp\.down_proj",
    r".*[qkv]_proj",
    r".*self_attn.*",
    r"model.layers.0.self_attn.q_proj",
    r"model\.layers\.[01]\.self_attn\.(q|k|v|o)_proj",
    r"(.*\.)?(o_proj|down_proj)$",
    r"^model\.layers\.\d{1,2}\.(self_attn|mlp)\.\w+$",
    r".*\.layers\.[0-9]+\.self_attn\.(?P<part>q|k|v)_proj",
    r".*visual.*mlp\.gate_proj",
    r"model\.language_model\..*\.(q_proj|v_proj)",
    r".*\.experts\.\d+\.(gate|up|down)_proj",
    r".*(attn|attention).*(query|key|value|[qkv]_proj)",
    r"lm_head",
    r".*",
]


def _peft_selects(pattern: str, names: list[str]) -> list[str]:
    config = LoraConfig(target_modules=pattern)
    return [n for n in names if check_target_module_exists(config, n)]


def test_peft_patterns_select_what_peft_selects_on_a_vision_language_model():
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from twinkle.hub import resolve_model_path

    config = AutoConfig.from_pretrained(resolve_model_path("twinkle://qwen2.5-vl-tiny"))
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    names = [n for n, _ in model.named_modules()]
    hits = {}
    for pattern in PEFT_PATTERNS:
        ours = [n for n in names if compile_pattern(pattern).fullmatch(n)]
        assert ours == _peft_selects(pattern, names), pattern
        hits[pattern] = len(ours)
    assert hits[r".*visual.*mlp\.gate_proj"] > 0 and hits[r"model\.language_model\..*\.(q_proj|v_proj)"] > 0
    assert hits["lm_head"] == 1 and hits[".*"] == len(names)


def _random_pattern(r: random.Random, depth: int = 0) -> str:
    k = r.random()
    if depth > 3 or k < 0.35:
        atoms = ["a", "b", ".", r"\.", r"\d", r"\w", r"\W", r"\s", "[ab]", "[^a]", "[a-c.]", r"[\d.]", "[]a]", "[a-]"]
        return r.choice([*atoms, "_", "1", "^", "$", r"\A", r"\Z", r"\n", ""])
    if k < 0.55:
        return "".join(_random_pattern(r, depth + 1) for _ in range(r.randint(2, 3)))
    if k < 0.7:
        return "|".join(_random_pattern(r, depth + 1) for _ in range(r.randint(2, 3)))
    inner = _random_pattern(r, depth + 1)
    group = r.choice(["(%s)", "(?:%s)", "(?P<g>%s)"]) % inner if r.random() < 0.7 else inner
    return group + r.choice(["*", "+", "?", "{2}", "{0,2}", "{1,}", "{,2}", "*?", "+?", "{1,3}?", "{", "{}", "{a}", ""])


def test_random_patterns_answer_what_re_answers():
    """Seeded random patterns over the supported syntax (anchors, empty loops, lazy quantifiers, literal
    braces, classes with ']' and '-'), each against every string of up to three characters over
    "ab.\\n1" and random longer ones: every answer is re.fullmatch's; every pattern re refuses is refused."""
    r = random.Random(20261205)
    strings = [""] + ["".join(p) for n in range(1, 4) for p in itertools.product("ab.\n1", repeat=n)]
    checked = 0
    for _ in range(700):
        pattern = _random_pattern(r)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                expected = re.compile(pattern)
            except re.error:
                with pytest.raises(PatternError):
                    compile_pattern(pattern)
                continue
        if "++" in pattern or "}+" in pattern or "?+" in pattern or "*+" in pattern:
            continue  # possessive quantifiers: refused (test_refusals_name_the_construct)
        ours = compile_pattern(pattern)
        longer = ["".join(r.choice("ab.\n_1c") for _ in range(r.randint(4, 9))) for _ in range(10)]
        for s in strings + longer:
            assert ours.fullmatch(s) == (expected.fullmatch(s) is not None), (pattern, s)
        checked += 1
    assert checked > 500


@pytest.mark.parametrize(
    "pattern",
    [r"model\.lay(.|.)*X", r"(a+)+$", r"(.*a){12}", r"(x+x+)+y", r"(.*)*\.(q|v)_proj\d"],
)
def test_work_is_linear_in_the_name(pattern):
    """Patterns that backtrack exponentially in `re` (`model\\.lay(.|.)*X` took 5-9 s a name on the
    server): the matcher's counted steps stay within (name length + 1) x (program size + 2), so a name
    8x longer costs at most ~8x; the same name again costs one step a character."""
    work = {}
    for length in (40, 320):
        name = ("model.layers." + "a" * length)[: length - 1] + "!"  # a near miss: the costly case for `re`
        fresh = Pattern(pattern, parse(pattern))  # no cached states
        assert fresh.fullmatch(name) is False
        assert fresh.work <= (length + 1) * (len(fresh) + 2), (length, fresh.work, len(fresh))
        work[length] = fresh.work
        before = fresh.work
        fresh.fullmatch(name)
        assert fresh.work - before <= length + 1  # every state cached: a lookup a character
    assert work[320] <= 8.5 * work[40], work


@pytest.mark.parametrize(
    "pattern, named",
    [
        (r"(a)\1", r"the escape \1 (a backreference"),
        (r"(?P<x>a)(?P=x)", "named backreference"),
        (r".*(?=proj)", "lookahead (?=...)"),
        (r"^(?!.*visual).*q_proj", "negative lookahead (?!...)"),
        (r"(?<=self_attn\.)q_proj", "lookbehind"),
        (r"(?>a+)b", "atomic group"),
        (r"a*+", "possessive quantifier"),
        (r"(?i)Q_PROJ", "inline flags (?i"),
        (r"\bq_proj", r"word boundary \b"),
        (r"(a)(?(1)b|c)", "conditional group"),
        (r"a{5000}", "expands to 5000 automaton states"),
        (r"q_proj(", "not a valid regular expression"),
        ("(" * 40 + ")" * 40, "nests groups deeper than 32"),
    ],
)
def test_refusals_name_the_construct(pattern, named):
    with pytest.raises(PatternError) as e:
        compile_pattern(pattern)
    assert named in str(e.value) and isinstance(e.value, ValueError)


def test_adapter_spec_matches_on_the_linear_matcher():
    """AdapterSpec (the engine's target selection) refuses an unsupported pattern when built, and selects
    with the matcher: its counted work grows with the names it reads."""
    with pytest.raises(ValueError, match="lookbehind"):
        AdapterSpec.from_lora_config(LoraConfig(r=2, target_modules=r"(?<=x)q_proj"))
    pattern = r"model\.lay(.|.)*X"
    spec = AdapterSpec.from_lora_config(LoraConfig(r=2, target_modules=pattern))
    names = [f"model.layers.{i}.self_attn.{p}_proj" for i in range(64) for p in "qkvo"] + ["model.layersX"]
    before = compile_pattern(pattern).work
    assert spec.select_from(names) == ["model.layersX"]
    assert (
        0
        < compile_pattern(pattern).work - before
        <= sum(len(n) + 1 for n in names) * (len(compile_pattern(pattern)) + 2)
    )
