"""The data the engines read, as plain tensors: the paper's padded posting lists
(:mod:`.postings`, with their one builder), the document-major forward copy
(:mod:`.forward`), the tiled layout (:mod:`.tiled`), host statistics (:mod:`.statistics`)
and the typed state that holds what is derived from an index (:mod:`.derived`). Nothing
here launches a kernel or chooses an engine."""
