"""GPUSparse inside the tools IR people already use; one module per tool, each an optional extra.

* :mod:`.pyterrier`: ``GPUSparseRetriever`` and ``GPUSparseIndexer``, PyTerrier transformers
  (``pip install 'gpusparse[pyterrier]'``);
* :mod:`.sentence_transformers`: ``SparseEncoderAdapter``, any sentence-transformers
  ``SparseEncoder`` as the encoder of ``encode``/``pipeline``
  (``pip install 'gpusparse[sentence-transformers]'``);
* :mod:`.encoders`: ``make_encoder``, the one place that picks an encoder backend by name;
* :mod:`.ciff`: the Common Index File Format, export and import (``pip install 'gpusparse[ciff]'``),
  with the protobuf messages of :mod:`._ciff_messages`.

Importing this package imports none of these tools; each module imports its tool where it is
used and says what to install when it is missing (:func:`._require.require`).
"""
