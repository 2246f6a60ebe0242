"""Built-in operators (installed as `plexrl.operators`), one module per family:
`data` (sample_prompts), `rollout` (rollout, logprob), `verify`, `advantage` (grpo_advantage), `train`,
`evaluate`. Each module imports torch lazily so that validating a pipeline stays fast."""
