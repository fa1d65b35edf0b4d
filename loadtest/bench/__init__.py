"""``fairgate bench``: the same workload direct to a vLLM backend and through fairgate.

One module per scenario (``newcomer``, ``utilization``, ``mixed``, ``fairness``,
``overhead``, ``scheduler``); shared pieces: the streaming client (``client``), load
shapes (``loadgen``), statistics (``stats``), processes (``procs``, ``env``) and the
report writer (``report``). See ``loadtest/RESULTS.md`` for the numbers.
"""
