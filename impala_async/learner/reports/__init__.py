"""What the learner reports: every part's counters gathered into one snapshot a report (``counters.py``), made a
metrics.jsonl record and a console line (``metrics.py``), a Prometheus scrape (``prom.py``) and TensorBoard scalars
(``tboard.py``); the update's histograms (``histograms.py``) and the watch that warns of a collapsing policy
(``watch.py``). docs/metrics.md lists every figure."""
