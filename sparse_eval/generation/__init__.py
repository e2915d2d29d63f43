"""Generation: what a task asks of the model and how the model answers it, for left-padded batches.

``requests`` (a sample's request: a teacher-forced log-likelihood or a greedy generation, with its key and limits;
torch-free, the tasks build them) and ``engine`` (``Engine``: teacher-forced NLL and greedy generation under a
protocol, through the attention plug-in's session).

May import: ``attention`` (the session and its cache), ``invariance``, ``models.placement``; the tasks and the run
wing import this one, never the other way."""
