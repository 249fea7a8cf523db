"""The benchmark harness: every system of ``benchmarks.md`` on the same synthetic collections, side by side.

Not part of the installed ``gpusparse`` package: it lives in a source checkout, beside the
other benchmark scripts of ``bench/``, and imports ``gpusparse`` like any user would.

* :mod:`.systems`: our kernels and the GPU baselines (the paper's monolithic and chunked
  pipelines, SPARe-iterative, cuSPARSE through ``torch.sparse``, dense matmul and its
  ``torch.compile``, the document-parallel kernel), one small class each;
* :mod:`.cpu_engines`: Seismic, BMP and PISA adapters (optional packages), run by
  :mod:`.cpu_worker` in a process of its own on the job :mod:`.cpu_job` writes;
* :mod:`.runner`: the run loop (timing, memory, exactness, floors) and the result file;
* :mod:`.report`: JSON → Markdown table and matplotlib plots;
* :mod:`.paper` and :mod:`.paper_report`: the paper's remaining experiments and its
  figures beside ours (the quality part runs :class:`gpusparse.pipeline.TextPipeline`);
* :mod:`.cli`: the ``bench`` command group.

``gpusparse bench run|report|paper|paper-report`` runs :mod:`.cli` from a checkout (the
``gpusparse`` command finds this folder next to ``src/``); so does ``python -m
gpusparse_bench`` with ``bench/`` on ``PYTHONPATH`` (or from inside ``bench/``).
"""
