"""Notebook support for pagedwindow: parameters, paths, artifacts and the drawings; what the notebooks measure and
judge is in ``pagedwindow.measure``.

One concept per module:
- ``paths``: the repository root, relative paths resolved against it, a notebook's ``out_dir``, paths as shown;
- ``params``: each notebook's parameters checked up front (strings from ``papermill -p`` parsed);
- ``artifacts``: ``metrics.json`` (JSON-safe), CSV rows and HTML tables written into a notebook's ``out_dir``;
- ``figures``: matplotlib set-up (Agg unless a notebook kernel renders inline) and saving PNGs;
- ``plan_drawing``: the mask, the plan's tiles and a per-tile error map, drawn (notebook 02);
- ``prefill_plots``: notebook 01's per-head, per-position and per-distance errors, plotted;
- ``decode_views``: a greedy-decode oracle result as a line of text, a token table, plots and its verdict;
- ``bench_plots``: benchmark results plotted.

Importing ``pagedwindow.viz`` loads nothing heavy; import the submodule you need.
"""
