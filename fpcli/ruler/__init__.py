"""RULER-style accuracy check (``fp eval``): synthetic long-context tasks generated on the spot,
scored by string match, run for several profiles side by side.

Modules, one job each:

- ``haystack``: the filler text that pads a sample to its length (generated, or the user's documents);
- ``tasks``: the task generators (needle single / multi-key / multi-value, variable tracking,
  common-word extraction) and the fit of a sample to an exact token length;
- ``scoring``: RULER's string-match metric;
- ``runner``: one engine per profile in turn, every sample through each, cells aggregated;
- ``render``: the table on stderr.

The report schema (``fp.eval/1``) is built in ``runner.eval_report``; ``docs/eval.md`` explains the
tasks, the metric, and how to read the table.
"""
