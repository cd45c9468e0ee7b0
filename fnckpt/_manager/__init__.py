"""Layer 8, ``CheckpointManager`` and what it runs on: the manager, its parts made from the
constructor's options (``parts``) and its saver (``manager``, ``saver``), the step index and
claims (``steps``, ``claims``), self-healing restores (``recovery``, ``health``), tiers
(``tiers``), retention (``retention``, pure, and ``retention_runner``), incremental lineage
and references kept by forks (``lineage``, ``fork``), save intervals (``interval``,
``starts``) and preemption (``preemption``).

May import: ``_export``, ``_save``, ``_restore``, ``_sources``, ``_io``, ``_format``,
``_layout`` and ``fnckpt._errors`` / ``fnckpt._version``.
"""
