"""Per-document scores of refkjv_continue (lm-eval loads this file by the task YAML's `!function`)."""

from __future__ import annotations


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """exact_match: the generated rest of the verse equals the real one (spaces at the ends aside);
    chrf: sacrebleu's sentence chrF of the generation against it, scaled to 0-1, so that a build that
    departs late from the text scores near one that does not."""
    import sacrebleu

    generated, target = results[0].strip(), doc["target"].strip()
    return {
        "exact_match": float(generated == target),
        "chrf": sacrebleu.sentence_chrf(generated, [target]).score / 100,
    }
