"""The step cost benchmark's parts (``benchmarks/step_cost.py`` runs them): ``design``, ``calls`` (the measured
functions), ``probes`` (FLOP estimates, profiles), ``workers`` (fresh-process memory and RL-step measurements) and
``report``."""
