"""lm-eval's transformers backend, the same log-likelihoods faster: the log-softmax over the rows it scores.

lm-eval 0.4's `HFLM._loglikelihood_tokens` (lm_eval/models/huggingface.py) takes the log-softmax of a batch's
logits at every position of every document, then keeps, per document, only its continuation's positions
(`_select_cont_toks`). A needle's haystack is hundreds of positions for a verse's rest, a multiple-choice
context several verses for a few words of choice: most of those rows are thrown away, and over a 4,096-token
vocabulary in float32 their log-softmax is a large share of a small model's evaluation. A row's log-softmax
depends on that row alone and torch computes each row the same way in a batch or in a slice, so taking it
after the selection gives every kept row's bits (tests/test_evaluate.py compares an evaluation's records
with upstream's; docs/toolchain.md says what it saves and when it can go).

The patch is for the evaluation process only (eval/quality/accuracy.py applies it on the hf backend): in
huggingface.py's namespace, `F.log_softmax` hands the logits back as they are, and `_select_cont_toks`
takes the log-softmax of what it selected, with the same dtype. A class that runs a log-likelihood loop of
its own (lm-eval's multimodal `HFMultimodalLM`, whose module's `F` is torch's) gets upstream's selection.
"""

from __future__ import annotations


def log_softmax_scored_rows() -> bool:
    """Patch lm-eval's hf backend as the module says; True if this call patched it (False when already)."""
    import torch.nn.functional as torch_F
    from lm_eval.models import huggingface

    hflm = huggingface.HFLM
    upstream = hflm._select_cont_toks
    if getattr(upstream, "scored_rows", False):
        return False
    loop = hflm._loglikelihood_tokens  # the loop whose module namespace gets the deferring `F`

    class Deferred:
        """torch.nn.functional, but for a log-softmax left to `_select_cont_toks`."""

        def __getattr__(self, name):
            return getattr(torch_F, name)

        @staticmethod
        def log_softmax(logits, dim=-1, dtype=None):
            return logits

    def _select_cont_toks(self, logits, contlen=None, inplen=None):
        rows = upstream(self, logits, contlen=contlen, inplen=inplen)
        if type(self)._loglikelihood_tokens is not loop:  # its own loop took the log-softmax already
            return rows
        return torch_F.log_softmax(rows, dim=-1, dtype=self.softmax_dtype)

    _select_cont_toks.scored_rows = True
    _select_cont_toks.upstream = upstream
    huggingface.F = Deferred()
    hflm._select_cont_toks = _select_cont_toks
    return True
