"""The model as TransformerLens shows it: hook points named by module path, the activation cache and
its views, TransformerLens's activation names, stacked weights and factored matrices.

hooks (HookPoint, HookedModule) -> cache (ActivationCache) -> names (get_act_name, test_prompt);
weights (TransformerLensViews) -> factored_matrix. Nothing here imports the model: the model is
built with these parts.
"""
