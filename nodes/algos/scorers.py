"""Rule-based scores: one per sample, from its text.

`score()` picks the grader by the sample's `data_source`; a user grader is a `module:function`
reference resolved once with importlib. Plain Python (no torch), so checking a pipeline's data
against the graders stays quick; `token_rewards` puts the scores on the token grid.
"""

from __future__ import annotations

import importlib
import math
import re
from typing import Callable, Optional

_NUMBER = r"-?[\d,]*\.?\d+"
_STRICT = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)
_CLIP_CHARS = 300  # only the tail of a long answer is searched, as verl does


def _to_number(text: str) -> Optional[float]:
    try:
        return float(text.replace(",", "").replace("$", "").strip())
    except ValueError:
        return None


def extract_gsm8k_answer(text: str, method: str = "strict") -> Optional[str]:
    """strict: the number after the last `####`; flexible: the last number anywhere. Commas kept
    here, stripped when compared."""
    tail = text[-_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
    elif method == "flexible":
        found = _ANY_NUMBER.findall(tail)
    else:
        raise ValueError(f"unknown gsm8k extraction method {method!r}; expected 'strict' or 'flexible'")
    return found[-1] if found else None


def gsm8k_score(solution_str: str, ground_truth, method: str = "strict", format_score: float = 0.0, score: float = 1.0) -> float:
    """`score` when the extracted number equals the ground truth, `format_score` when a number was
    extracted but is wrong, 0 when none was."""
    answer = extract_gsm8k_answer(solution_str, method)
    if answer is None:
        return 0.0
    got, want = _to_number(answer), _to_number(str(ground_truth))
    if got is not None and want is not None and math.isclose(got, want, rel_tol=0.0, abs_tol=1e-9):
        return float(score)
    return float(format_score)


def last_boxed(text: str) -> Optional[str]:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), nested braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start)
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


_MATH_DROP = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "$", " ")


def normalize_math(answer: str) -> str:
    """Light normalisation so equal answers in different spellings compare equal."""
    s = answer.strip()
    for token in _MATH_DROP:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("^{\\circ}", "").replace("^\\circ", "")
    s = re.sub(r"\\text\{\s*([^}]*)\}", r"\1", s)
    return s.rstrip(".")


def math_equal(a: str, b: str) -> bool:
    a, b = normalize_math(a), normalize_math(b)
    if a == b:
        return True
    x, y = _to_number(a), _to_number(b)
    return x is not None and y is not None and math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9)


def math_score(solution_str: str, ground_truth, format_score: float = 0.0, score: float = 1.0) -> float:
    """The last `\\boxed{}` against the ground truth (itself boxed or bare)."""
    answer = last_boxed(solution_str)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    truth = last_boxed(truth) or truth
    return float(score) if math_equal(answer, truth) else float(format_score)


SCORERS: dict[str, Callable[..., float]] = {
    "openai/gsm8k": gsm8k_score,
    "gsm8k": gsm8k_score,
    "demo/arith": gsm8k_score,
    "demo/agent_sum": gsm8k_score,
    "math": math_score,
    "lighteval/MATH": math_score,
    "DigitalLearningGmbH/MATH-lighteval": math_score,
}


def score(data_source: str, solution_str: str, ground_truth, extra_info=None, **params) -> float:
    """Built-in score of one sample, grader chosen by `data_source`; `params` go to the grader
    (e.g. method='flexible', format_score=0.1). `extra_info` is accepted for the user-scorer
    signature and unused by the built-in graders."""
    grader = SCORERS.get(data_source)
    if grader is None:
        raise ValueError(
            f"no built-in scorer for data_source {data_source!r}; known: {', '.join(SCORERS)} "
            "(or give a custom scorer as 'module:function')"
        )
    return grader(solution_str, ground_truth, **params)


def resolve_scorer(ref: str) -> Callable[..., float]:
    """'package.module:function' -> the callable, with the same signature as `score`."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"scorer reference {ref!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"scorer {ref!r}: cannot import module {module_name!r} ({e})") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"scorer {ref!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"scorer {ref!r}: {attr!r} is a {type(fn).__name__}, not a callable")
    return fn
