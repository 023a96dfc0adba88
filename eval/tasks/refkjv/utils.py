"""Per-document scores of refkjv_continue and refkjv_needle, and refkjv_ppl's chapters (lm-eval loads this file
by the task YAMLs' `!function`)."""

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


PPL_EVERY = 6
"""refkjv_ppl scores every sixth held-out chapter (20 of 119): bits per byte is summed over thousands of tokens a
chapter, so the paired interval of a build against the baseline is narrow with a few chapters (the report's
documents-needed figure); every sixth, in the file's canonical order, spreads them over the whole Bible (18
of the 48 books the held-out chapters come from)."""


def ppl_chapters(dataset):
    """The chapters refkjv_ppl scores (lm-eval's `process_docs`): every PPL_EVERY-th, in the file's order."""
    return dataset.select(range(0, len(dataset), PPL_EVERY))
