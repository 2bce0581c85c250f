"""Notebook support for pagedwindow: figures, artifacts and the thin drivers the notebooks call.

One concept per module:
- ``paths``: the repository root, relative paths resolved against it, a notebook's ``out_dir``, paths as shown;
- ``params``: each notebook's parameters checked up front (strings from ``papermill -p`` parsed);
- ``runtime``: device / dtype names from notebook parameters, the environment summary, the backend that ran (and
  the CUDA launches' prefill kernel and K/V copy path);
- ``artifacts``: ``metrics.json`` (JSON-safe), CSV rows and HTML tables written into a notebook's ``out_dir``;
- ``figures``: matplotlib set-up (Agg unless a notebook kernel renders inline) and saving PNGs;
- ``plan_geometry``: what each tile of a ``PrefillPagedPlan`` covers (packed rows, tokens, keys, pages read and
  skipped) and the visibility mask of a request;
- ``plan_drawing``: the mask, the plan's tiles and a per-tile error map, drawn;
- ``explorer``: a random paged batch for any plan a user types in, run through a backend, against float64;
- ``paged_replay``: HF's captured per-layer q/k/v replayed through the paged API, and the one-hot value probe
  that reads back the attention weights a backend actually used;
- ``prefill_detail`` / ``prefill_plots``: notebook 01's per-head, per-position and per-distance errors, plotted;
- ``decode_views``: a greedy-decode oracle result (``pagedwindow.hf.decode_oracle``) as a table, metrics, plots;
- ``bench_results`` / ``bench_plots``: committed benchmark results, validated, tabulated and plotted.

Importing ``pagedwindow.viz`` loads nothing heavy; import the submodule you need.
"""
