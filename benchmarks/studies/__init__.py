"""The benchmarks' own code that outgrew one script, or that two scripts share (the generic parts are in
``harness``): ``studies.ablation`` (the paired ablation's design, records, tables and text; ``ablation.py`` runs it,
``lr_window.py`` reads its records), ``studies.scores`` (per-completion gradient scores and their Gram statistics:
``grad_variance.py``, ``proxies.py``, ``variance_long.py``) and ``studies.step_cost`` (``step_cost.py``'s measured calls,
subprocess workers and report; ``profile_norms_gpu.py`` reuses its calls)."""
