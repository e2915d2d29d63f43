"""Results: what a run leaves on disk and everything read back from it.

``store`` (a run directory's layout, lock, progress and failure records, samples and summary), ``status`` (a run's
state: done, running, failed, pending), ``collect`` (every run under a folder as one table with intervals, from
``metrics.statistics``), ``contrast`` (two methods' paired difference over seeds), ``results_table`` (the table a launch
prints) and ``terminal_table`` (the collected table fitted to a terminal). ``python -m sparse_eval.results.collect`` and
``python -m sparse_eval.results.status`` are the user's commands.

May import: the ground floor (``identity``, ``method_facts``, ``metrics``), ``tasks.base`` and ``methods`` for labels;
never the launcher (``runner``, ``sweep``, ``preflight``, ``cli``), the run wing (``run``) nor ``report``, which reads
it."""
