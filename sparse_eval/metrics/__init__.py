"""How a score is made: each benchmark's metric of one prediction (``ruler``, ``longbench``: one module per benchmark,
written from its definition) and how sure a score over samples is (``statistics``: bootstrap intervals, paired
differences, equivalence verdicts).  Imports nothing of the project: tasks, results and verdicts all stand on it."""
