"""One run below the launcher: the run spec and everything a run does between its config and its records.

``experiment`` (model and samples loaded once, a method's run, identity, run directory, summary), ``run_config`` (the
frozen ``RunConfig`` the launcher builds once and the ``Experiment`` takes; the config's methods composed and checked),
``run_spec`` (the typed ``RunSpec`` the rest takes), ``batching`` (batches, their order from ``ordering``,
out-of-memory), ``memory`` and ``estimate`` (the start-time memory and CPU-time checks), ``wandb_logger`` (optional
logging of a run's samples and summary). The launcher (``launcher``: ``runner``, ``sweep``, ``preflight``) calls into
this wing.

May import: the ground floor (``config``, ``identity``, ...), ``results.store``, ``generation``,
``models``, ``methods``, ``attention``, ``tasks``, ``invariance``, ``verdicts.claims``, ``results.results_table``'s
labels; never the launcher (``runner``, ``sweep``, ``preflight``, ``cli``) nor ``results.collect`` or ``report``."""
