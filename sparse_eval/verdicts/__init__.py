"""Claims and their verdicts: what an experiment declares it will test before its runs (``claims``: comparisons,
tests, margins; checked at start and recorded with each run) and the verdicts recomputed from the records
(``evaluate``: equivalent / non-inferior / better / worse / inferior / undecided, the tables it writes;
``python -m sparse_eval.verdicts``).  ``claims`` imports only ``statistics``; ``evaluate`` reads results through
``collect`` and ``store`` and is never imported by a run."""
