"""Benchmarks: what full content hashing and the commit protocol cost, next to what people use.

The questions (``ckptfs bench hash|save|interleaved|s3|latest|fresh|incremental|fixed``, or ``all``;
the scripts in ``benchmarks/`` call the same functions), rendered (``ckptfs bench report``) into
``benchmarks.md`` with plots in ``img/``, under ``--out DIR`` (default: the current directory;
never the installed package; the repository's scripts write ``docs/benchmarks.md``).  Only the
core dependencies are needed to import `ckptfs.bench.cli` (``ckptfs --help`` offers ``bench``);
a question that needs more raises `ckptfs.bench.common.BenchDependencyError` naming
``pip install "ckptfs[bench]"``.  One module per concern:

* `ckptfs.bench.common`: sizes, timing with peak RSS, machine description, the
  transformer-shaped states (parameters + AdamW ``exp_avg``/``exp_avg_sq``);
* `ckptfs.bench.variants`: each thing timed (ckptfs with every algorithm, durable and fast;
  ``torch.save``/``torch.load``, ``safetensors``, DCP; raw s3fs ``pipe``/``cat``) and the runner
  measuring one variant in a fresh process;
* `ckptfs.bench.save`: **save** (local disk), **interleaved** (the save targets with the
  variants interleaved run by run) and **s3** (a moto S3 server);
* `ckptfs.bench.hashing`: **hash**, throughput of every algorithm, ckptfs's hasher against
  the raw library, per chunk;
* `ckptfs.bench.latest`: **latest**, storage requests and time to resolve the latest
  checkpoint among 10 to 10,000 (`CountingStorage`,
  `count_http`);
* `ckptfs.bench.fresh`: **fresh**, import + first save/load in a new process;
* `ckptfs.bench.incremental`: **incremental**, what incremental saves (format v3) write and
  cost against full saves and DCP (LoRA-like, RL-like, full fine-tuning, ``keep_last=5``
  retention, S3, a fresh process);
* `ckptfs.bench.fixed`: **fixed**, the fixed costs: a tiny state's save and load, a verified
  64 MiB load, a fresh process's verified 1 GiB load, the in-place sharded load at 2 ranks
  (`ckptfs.bench.sharded.bench_inplace`), each against DCP and ``torch.save``/``torch.load``,
  interleaved round by round; `ckptfs.bench.fixed_report` renders its section and plot;
* `ckptfs.bench.report`: target ratios, the Markdown report and its plots
  (`ckptfs.bench.markdown`: pyplot, and one section spliced into an existing report);
* `ckptfs.bench.cli`: ``ckptfs bench ...`` (``add_subcommands``, ``main``) and the isolated
  worker's entry point (``python -m ckptfs.bench.cli SPEC``).

Why it is built this way:

* every comparison is a ratio of two medians measured side by side in one run, because this
  machine is shared and noisy: absolute figures drift between runs, ratios much less;
* each variant runs in a fresh subprocess, and its peak resident memory is taken from the
  kernel's high-water mark reset right before the timed call (``/proc/self/clear_refs``), so the
  extra memory of one library is not inherited by the next;
* this VM hands memory that sat free for a few seconds back to the host, and the next first touch
  is 6-9x slower; every timed run is preceded by touching and freeing a few GiB, or the figures
  would swing with idle time.  Loads read from the page cache (warm), as the issue's figures do.
"""
