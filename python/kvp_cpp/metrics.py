"""RULER's text-match metrics (``scripts/eval/synthetic/constants.py`` and ``scripts/eval/evaluate.py``).

Scores are percentages rounded to 2 decimals, averaged over samples. Predictions are post-processed as RULER's
evaluate.py does before scoring: strip, replace every control character ``[\\x00-\\x1f]`` with a newline, strip.
"""
from __future__ import annotations

import re
from typing import Callable, Dict, Sequence

_CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f]")


def postprocess_prediction(prediction: str) -> str:
    return _CONTROL_CHARACTERS.sub("\n", prediction.strip()).strip()


def match_all(prediction: str, references: Sequence[str]) -> float:
    """Fraction of the references that occur in the prediction (case-insensitive substring)."""
    prediction = prediction.lower()
    return sum(1.0 for reference in references if reference.lower() in prediction) / len(references)


def match_part(prediction: str, references: Sequence[str]) -> float:
    """1 if any reference occurs in the prediction (case-insensitive substring), else 0."""
    prediction = prediction.lower()
    return 1.0 if any(reference.lower() in prediction for reference in references) else 0.0


def _average(
    per_sample: Callable[[str, Sequence[str]], float],
    predictions: Sequence[str],
    references: Sequence[Sequence[str]],
) -> float:
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} reference lists")
    if not predictions:
        raise ValueError("no predictions to score")
    total = sum(per_sample(postprocess_prediction(p), refs) for p, refs in zip(predictions, references))
    return round(total / len(predictions) * 100, 2)


def string_match_all(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's metric for niah, vt, cwe and fwe: mean fraction of references found, x100."""
    return _average(match_all, predictions, references)


def string_match_part(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's metric for qa: share of samples where any reference is found, x100."""
    return _average(match_part, predictions, references)


METRICS: Dict[str, Callable[[Sequence[str], Sequence[Sequence[str]]], float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
}


def score(metric: str, predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Score predictions with the metric named in a RULER sample's ``metric`` field."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; known: {', '.join(METRICS)}")
    return METRICS[metric](predictions, references)
