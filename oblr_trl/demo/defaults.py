"""Defaults shared by every entry point that builds the embedded tiny model (`examples/demo.py`, `examples/oblrpo.py`,
`examples/evaluate.py`, `examples/recipes/tiny_cpu.yaml`), so they all start from the same warmed-up
model: the same task, warm-up seed and number of SFT steps give the same cached weights."""

TINY_TASK = "chain_sum"
TINY_WARMUP_STEPS = 200  # SFT steps: ~35% greedy held-out accuracy on chain_sum, room for RL to improve
TINY_WARMUP_SEED = 0
