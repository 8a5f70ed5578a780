"""The GPU monitor: NVML samples as rows of plain data, their CSV log, window summaries and plots.

One module per part, each importable on its own (none imports the verb):

    rows.py      the sample row: COLUMNS (units in the names), ISO UTC times, blank rows
    backends.py  PynvmlBackend (nvidia-ml-py) and FakeNvml (tests, demos, `--fake N`), one interface
    sampler.py   sample(), Monitor (never raises), InProcessSampler (a thread beside a step loop)
    csvlog.py    CsvLog (daily <host>-<date>.csv), read_rows, read_window
    summary.py   summarize_window: rows of a time window -> per-GPU figures (a dict), for the ledgers
    plot.py      plot(): util, memory, power, temperature per GPU to a PNG; --window parsing
    cli.py       the `tuneledger monitor` verb (and `monitor plot`)

Every part hands on plain dicts keyed by rows.COLUMNS, so the verdict (tuneledger.diagnose) reads
summaries and never touches the sampler.
"""
