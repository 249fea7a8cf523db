"""The benchmark: every system of ``benchmarks.md`` on the same synthetic collections, side by side.

* :mod:`~gpusparse.bench.systems`: our kernels and the GPU baselines (the paper's monolithic
  and chunked pipelines, SPARe-iterative, cuSPARSE through ``torch.sparse``, dense matmul
  and its ``torch.compile``, the document-parallel kernel), one small class each;
* :mod:`~gpusparse.bench.cpu_engines`: Seismic, BMP and PISA adapters (optional packages);
* :mod:`~gpusparse.bench.runner`: the run loop (timing, memory, exactness, floors) and the
  result file;
* :mod:`~gpusparse.bench.report`: JSON → Markdown table and matplotlib plots.

``gpusparse bench run`` and ``gpusparse bench report`` are the commands. Importing this
package imports nothing heavy.
"""
