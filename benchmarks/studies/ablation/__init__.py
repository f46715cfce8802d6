"""The paired ablation on the real model (``benchmarks/ablation.py`` runs it): ``design`` (arms, lrs, contrasts, the lr
window's grid), ``records`` (one json per finished run), ``tables`` (values from the records), ``render`` and ``when``
(markdown: ``ablation.md``, the README's "When to use OBLR-PO" and the baseline in training), ``plots``."""
