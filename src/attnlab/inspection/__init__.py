"""Looking inside a model: head scores, interventions, memory-light pattern capture, experiments.

- `scores`: the head detectors of Olsson et al. 2022 (previous-token, induction/prefix-matching,
  duplicate-token, first-token, local-window, copying) computed from attention patterns and weights.
- `interventions`: hook functions for `model.run_with_hooks` that ablate a head or patch an
  activation.
- `capture`: attention patterns of chosen layers and heads for long inputs, without every T×T
  matrix.
- `experiments`: the chapters' claims as runnable experiments (induction, scaling, extrapolation,
  coreference).

Nothing is imported here, so `import attnlab.inspection.scores` stays light.
"""
