"""What the notebooks measure and judge: each module computes numbers from pagedwindow's runs and, where the
report has a gate, the pass/fail verdict; ``pagedwindow.viz`` draws and writes them.

One concept per module:
- ``runtime``: device / dtype names from notebook parameters, the environment summary, the backend that ran (an
  observer of ``pagedwindow.api``'s dispatch) and the CUDA launches' prefill kernel and K/V copy path;
- ``plan_geometry``: what each tile of a ``PrefillPagedPlan`` covers (packed rows, tokens, keys, pages read and
  skipped) and the visibility mask of a request;
- ``explorer``: a random paged batch for any plan a user types in (``pagedwindow.testing``), run through a
  backend, against float64, and its gate (notebook 02);
- ``paged_replay``: HF's captured per-layer q/k/v replayed through the paged API, and the one-hot value probe
  that reads back the attention weights a backend actually used;
- ``prefill_detail``: notebook 01's per-head, per-position and per-distance errors beside the layer oracle's gate;
- ``decode``: notebook 03's case from its parameters, and the greedy-decode oracle's verdict as metrics;
- ``bench_results``: committed benchmark results, validated, tabulated and gated (notebook 04, ``pagedwindow bench``).

Nothing here imports matplotlib; importing ``pagedwindow.measure`` loads nothing heavy.
"""
