"""Per-document scores of refkjv_continue and refkjv_needle (lm-eval loads this file by the task YAMLs' `!function`)."""

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


def needle_results(doc: dict, results: list[tuple[float, bool]]) -> dict[str, tuple[float, int]]:
    """bits_per_byte of the needle's rest: its log-likelihood and its length in bytes, the pair lm-eval's
    `bits_per_byte` aggregation sums over documents (as for its rolling perplexity tasks)."""
    loglikelihood, _ = results[0]
    return {"bits_per_byte": (loglikelihood, len(doc["target"].encode("utf-8")))}
