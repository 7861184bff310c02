"""Records: what was measured and what is made of it. A ``Trial`` and the ``Runner`` interface
(``trial``), measuring precision (``precision``), statistical efficiency and goodput (``goodput``),
a run's outcome (``outcome``), the SQLite ``TrialStore`` (``store``; its file's checks and errors:
``store_file``), the shipped warm-start dataset (``warmstart``), featurized trial sets (``dataset``,
``training_set``) and the loop's ``History`` (``history``). It may import ``tuner.features`` (to
featurize trials), nothing above it."""
