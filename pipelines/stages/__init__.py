"""The stages, one module each (quantize, evaluate, bench, size, serve), and the engines they start.

A stage module has one public function: a card, a build and a tracker in, a typed result out
(pipelines/core/store/results/), run through the stage framework (pipelines/core/framework/runner.py). A stage imports
pipelines/core/, eval/ and quant/, and its own helpers here (engines.py, served_accuracy.py); never another
stage, the gate (pipelines/decision/), tracking or presentation.
"""
